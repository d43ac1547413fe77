// Op declarations of tf_sfctr. Naming rule: C++ op `Sfctr<Name>` is exposed in
// Python as `sfctr_<name>` (tf_sfctr/_ops.py), so our ops never collide with
// TensorFlow's or another plugin's. The store ops take the store as a
// resource and work on host memory; device-side rows are stock tf.Variables.
// SfctrUnique and SfctrSegmentSums are stateless batch kernels (CPU).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

Status VectorOfUnknown(InferenceContext* c, int output) {
  c->set_output(output, c->Vector(InferenceContext::kUnknownDim));
  return OkStatus();
}

// Input 1 of a store op: a vector of ids.
Status IdsVector(InferenceContext* c, ShapeHandle* ids) {
  return c->WithRank(c->input(1), 1, ids);
}

// SfctrSegmentSums: data [N, D], segment_ids [N], num_segments. Gathered
// (SfctrGatherSegmentSums): data [M, D], data_rows [N], segment_ids [N],
// num_segments. Outputs [num_segments, D] and, with squares, the same
// (else [0, D]).
Status SegmentSumsShape(InferenceContext* c, bool gathered) {
  const int segments_at = gathered ? 2 : 1;
  ShapeHandle data, per_id, segments;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &data));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(segments_at), 1, &segments));
  if (gathered) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &per_id));
  } else {
    per_id = data;
  }
  shape_inference::DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(per_id, 0), c->Dim(segments, 0), &unused));
  shape_inference::DimensionHandle n;
  TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(segments_at + 1, &n));
  bool squares = false;
  TF_RETURN_IF_ERROR(c->GetAttr("squares", &squares));
  c->set_output(0, c->Matrix(n, c->Dim(data, 1)));
  c->set_output(1, c->Matrix(squares ? n : c->MakeDim(0), c->Dim(data, 1)));
  return OkStatus();
}

}  // namespace

REGISTER_OP("SfctrStoreCreate")
    .Output("store: resource")
    .Attr("dim: int >= 1")
    .Attr("num_state: int >= 0")
    .Attr("state_init: list(float)")
    .Attr("init_kind: string")
    .Attr("init_a: float")
    .Attr("init_b: float")
    .Attr("seed: int")
    .Attr("max_rows: int >= 0")
    .Attr("cache_capacity: int >= 1")
    .Attr("expected_rows: int >= 0 = 0")
    .Attr("reserve_rows: bool = false")
    .Attr("table_name: string = ''")
    .Attr("host_rows_dir: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Creates an embedding store (host hash table + device-cache directory) and
returns a reference-counted handle; the store is freed with its last handle.
expected_rows (0: no estimate) sizes the host table's indexes up front;
reserve_rows also allocates and touches the row memory of that many rows.
table_name (e.g. the owning layer's name) names the table in errors.
host_rows_dir (a local directory; empty: none) keeps the host table's large
row blocks in an unnamed file there, mapped into memory.
)doc");

REGISTER_OP("SfctrCachePrepare")
    .Input("store: resource")
    .Input("ids: int64")
    .Input("hint_ids: int64")
    .Input("hint_steps: int32")
    .Attr("num_parts: int >= 1 = 1")
    .Attr("skip_if_refused: bool = false")
    .Attr("require_distinct: bool = false")
    .Output("slots: int32")
    .Output("miss_slots: int32")
    .Output("miss_rows: num_parts * float")
    .Output("evict_slots: int32")
    .Output("evict_ids: int64")
    .Output("evict_uses: int64")
    .Output("prepared: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      ShapeHandle hint_ids, hint_steps;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &hint_ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &hint_steps));
      TF_RETURN_IF_ERROR(c->Merge(hint_ids, hint_steps, &hint_ids));
      c->set_output(0, ids);
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 1));
      int num_parts;
      TF_RETURN_IF_ERROR(c->GetAttr("num_parts", &num_parts));
      for (int p = 0; p < num_parts; ++p) {
        c->set_output(2 + p, c->Matrix(InferenceContext::kUnknownDim,
                                       InferenceContext::kUnknownDim));
      }
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 2 + num_parts));
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 3 + num_parts));
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 4 + num_parts));
      c->set_output(5 + num_parts, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Cache management of one training step for distinct `ids`: assigns a cache slot
to each id, evicts ids the step does not use (their slots, ids and use counts
are returned for SfctrHostWrite) and fetches the rows (value and optimizer
state) that must be loaded into `miss_slots`, split column-wise into
`num_parts` equal parts (one per device variable: value, then each state row).
The host fetch runs on TF's intra-op thread pool while the directory is
updated. `hint_ids` (may be empty) are ids that later batches use,
`hint_steps` (>= 1) how many batches later: cached ones are evicted only after
every unhinted slot, the furthest use first. Fails, changing nothing, when the
ids exceed the cache capacity or the host table's max_rows, the hints are
malformed, or (with require_distinct, for ids the caller did not de-duplicate
itself) an id repeats; without require_distinct a repeated id is placed once.
With skip_if_refused, a refusal of the ids (capacity, max_rows, a repeat) is
not an error: nothing changes, `prepared` is false, slots are -1 and the other
outputs empty (a lookahead plan that cannot be made is no plan; the step of
that batch then fails itself). `prepared` is true otherwise.
)doc");

REGISTER_OP("SfctrHostWrite")
    .Input("store: resource")
    .Input("ids: int64")
    .Attr("num_parts: int >= 1 = 1")
    .Input("rows: num_parts * float")
    .Input("counts: int64")
    .Attr("mark_changed: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, unused;
      TF_RETURN_IF_ERROR(IdsVector(c, &ids));
      int num_parts;
      TF_RETURN_IF_ERROR(c->GetAttr("num_parts", &num_parts));
      for (int p = 0; p < num_parts; ++p) {
        ShapeHandle rows;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(2 + p), 2, &rows));
        shape_inference::DimensionHandle n;
        TF_RETURN_IF_ERROR(c->Merge(c->Dim(ids, 0), c->Dim(rows, 0), &n));
      }
      return c->WithRank(c->input(2 + num_parts), 1, &unused);
    })
    .Doc(R"doc(
Stores full-width rows (value and optimizer state) in the host table, given
as `num_parts` column blocks whose widths add up to the row width (e.g. the
gathered value and state rows, without concatenating them first). `counts` is
empty or holds one use count per id, added to the id's counter. Rows are
flagged changed (for a changed_only export) when `mark_changed`, except those
whose count is 0. Every caller in the library flags: evictions, and a flush's
write-back of dirty rows (an update that lands after the flush that credited
its use must reach the next delta).
)doc");

REGISTER_OP("SfctrHostAssign")
    .Input("store: resource")
    .Input("ids: int64")
    .Input("values: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, values;
      TF_RETURN_IF_ERROR(IdsVector(c, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &values));
      shape_inference::DimensionHandle n;
      return c->Merge(c->Dim(ids, 0), c->Dim(values, 0), &n);
    })
    .Doc("Sets row values in the host table and resets their optimizer state.");

REGISTER_OP("SfctrHostRead")
    .Input("store: resource")
    .Input("ids: int64")
    .Output("rows: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(IdsVector(c, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), InferenceContext::kUnknownDim));
      return OkStatus();
    })
    .Doc(R"doc(
Reads full-width rows from the host table; ids never stored get their initial
row and are not inserted.
)doc");

REGISTER_OP("SfctrLookupValues")
    .Input("store: resource")
    .Input("cache_rows: resource")
    .Input("ids: int64")
    .Output("rows: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), InferenceContext::kUnknownDim));
      return OkStatus();
    })
    .Doc(R"doc(
Current values of ids outside training (no optimizer state): a cached id's row
from the cache rows variable, any other id's from the host table (the initial
value of an id never stored, which is not inserted). No side effects. CPU only.
)doc");

REGISTER_OP("SfctrCacheProbe")
    .Input("store: resource")
    .Input("ids: int64")
    .Output("slots: int32")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(IdsVector(c, &ids));
      c->set_output(0, ids);
      return OkStatus();
    })
    .Doc("Cache slot of each id, or -1 when not cached. No side effects.");

REGISTER_OP("SfctrCacheEntries")
    .Input("store: resource")
    .Input("hold_ids: int64")
    .Output("ids: int64")
    .Output("slots: int32")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 0));
      return VectorOfUnknown(c, 1);
    })
    .Doc("The cached ids and slots whose rows a flush writes back to the host: those "
         "marked dirty (SfctrCacheMarkDirty) since their last write-back; the caller "
         "marks them clean once written (SfctrCacheMarkClean). Credits the cached uses "
         "to the host table and flags the rows used since the last call changed. The "
         "ids of hold_ids (a lookahead plan's, counted before their step trains them) "
         "keep one use in the cache, credited after that step.");

REGISTER_OP("SfctrCacheMarkDirty")
    .Input("store: resource")
    .Input("slots: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Marks cache slots whose rows a table update changed: the next flush writes "
         "them back. Slots outside [0, cache capacity) are ignored.");

REGISTER_OP("SfctrCacheMarkClean")
    .Input("store: resource")
    .Input("slots: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Marks cache slots whose rows a flush has written back to the host.");

REGISTER_OP("SfctrCacheClear")
    .Input("store: resource")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Forgets the cache directory; rows must have been flushed before.");

REGISTER_OP("SfctrHostExport")
    .Input("store: resource")
    .Output("ids: int64")
    .Output("rows: float")
    .Output("counts: int64")
    .Attr("columns: int = -1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 0));
      c->set_output(1, c->Matrix(InferenceContext::kUnknownDim,
                                 InferenceContext::kUnknownDim));
      return VectorOfUnknown(c, 2);
    })
    .Doc("Every row of the host table with its use count. columns > 0: only the first "
         "`columns` floats of each row (the embedding without its optimizer state); "
         "-1: whole rows.");

REGISTER_OP("SfctrHostExportRange")
    .Input("store: resource")
    .Input("cursor: int64")
    .Input("max_rows: int64")
    .Output("ids: int64")
    .Output("rows: float")
    .Output("counts: int64")
    .Output("next_cursor: int64")
    .Attr("changed_only: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 0));
      c->set_output(1, c->Matrix(InferenceContext::kUnknownDim,
                                 InferenceContext::kUnknownDim));
      TF_RETURN_IF_ERROR(VectorOfUnknown(c, 2));
      c->set_output(3, c->Scalar());
      return OkStatus();
    })
    .Doc("A part of the host table for saving it a part at a time: up to max_rows whole "
         "rows (with their ids and use counts) from `cursor` on (0 at the start), and the "
         "cursor of the next part (-1 once every row was returned). The parts add up to "
         "the table when nothing changes its ids between the calls. With changed_only, "
         "only the rows flagged changed (written since the previous such export), whose "
         "flags it clears.");

REGISTER_OP("SfctrHostAddCounts")
    .Input("store: resource")
    .Input("ids: int64")
    .Input("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(IdsVector(c, &ids));
      return c->Merge(ids, c->input(2), &ids);
    })
    .Doc("Adds to the use counters of stored ids (restoring a checkpoint).");

REGISTER_OP("SfctrStoreRelease")
    .Input("store: resource")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Frees the memory of a store whose owner is gone (every row of the host table
and the cache directory) and marks it released: every later op on it fails.
A function traced before may keep the handle, and with it the resource, alive.
)doc");

REGISTER_OP("SfctrHostClear")
    .Input("store: resource")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Removes every row of the host table.");

REGISTER_OP("SfctrHostPrune")
    .Input("store: resource")
    .Input("min_uses: int64")
    .Input("decay: double")
    .Output("removed: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Removes from the host table the ids used in fewer than min_uses training steps,
except ids in the cache and evictions whose write-back is pending; returns how
many were removed. Their rows are reused by later inserts. Then, with decay
below 1, every remaining id's use count is multiplied by decay, rounded down.
)doc");

REGISTER_OP("SfctrStoreRemove")
    .Input("store: resource")
    .Input("ids: int64")
    .Output("removed: int64")
    .Output("cached: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Removes ids from the cache (dropping their cached rows, not writing them back)
and from the host table. Returns how many of them the host table held, and how
many of those were cached. A removed id that comes back starts from its initial
row. The caller makes sure no write-back is pending and drops a prepared plan
holding any of the ids.
)doc");

REGISTER_OP("SfctrHostTakeRemoved")
    .Input("store: resource")
    .Output("removed: int64")
    .Output("complete: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
The ids removed from the host table (prune, remove) since the previous call
and not stored again since, ascending. complete is false when removals were
not being logged (the first call, and the first after the table was cleared
by a restore): removed is then empty, every stored row is flagged changed so
that the next changed_only export is the whole table, and removals are logged
from then on.
)doc");

REGISTER_OP("SfctrHostPruneToSize")
    .Input("store: resource")
    .Input("max_rows: int64")
    .Input("decay: double")
    .Output("removed: int64")
    .Output("min_uses: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Removes from the host table the least used ids until at most max_rows rows
remain, never ids in the cache or evictions whose write-back is pending (so
more may remain). Ids of one use count go in the order of their values.
Returns how many were removed, and min_uses: the use count of the most used
id removed, plus one (0 if none was). Then decay scales the remaining use
counts as in SfctrHostPrune.
)doc");

REGISTER_OP("SfctrHostUseCountHistogram")
    .Input("store: resource")
    .Output("held: int64")
    .Output("per_count: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(65536));
      return OkStatus();
    })
    .Doc(R"doc(
The rows the host table holds, and per use count c (0..65535) how many of its
ids that a prune could remove (not cached, no pending write-back) have it:
the first part of SfctrHostPruneToSize, for a table sharded over processes.
)doc");

REGISTER_OP("SfctrHostTiedIds")
    .Input("store: resource")
    .Input("count: int64")
    .Output("ids: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return OkStatus();
    })
    .Doc(R"doc(
The ids of the host table that a prune could remove and that were used exactly
count times, ascending.
)doc");

REGISTER_OP("SfctrHostPruneBelow")
    .Input("store: resource")
    .Input("below: int64")
    .Input("decay: double")
    .Input("last: int64")
    .Output("removed: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Removes from the host table the ids used fewer than below times and, when last
holds an id, those used exactly below times whose value is at most it; never
ids in the cache or evictions whose write-back is pending. Returns how many
were removed. Then decay scales the remaining use counts as in SfctrHostPrune.
)doc");

REGISTER_OP("SfctrHostSetSeed")
    .Input("store: resource")
    .Input("seed: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Sets the seed of the per-id initializer (restoring a checkpoint).");

REGISTER_OP("SfctrStoreStats")
    .Input("store: resource")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(9));
      return OkStatus();
    })
    .Doc(R"doc(
[hits, misses, evictions, host_rows, cache_capacity, cached_rows,
write_backs_by_handle, host_bytes, host_file_bytes].
)doc");

REGISTER_OP("SfctrHostDropFileRows")
    .Input("store: resource")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Writes the host rows kept in the host_rows_dir file out to the disk and drops
them from memory, so that the next reads come from the disk (a no-op without
host_rows_dir). For tests and benchmarks; not synchronised with a training step.
)doc");

REGISTER_OP("SfctrStoreSetCounters")
    .Input("store: resource")
    .Input("counters: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Sets [hits, misses, evictions] (used when restoring a checkpoint).");

REGISTER_OP("SfctrUnique")
    .Input("ids: int64")
    .Output("unique_ids: int64")
    .Output("inverse: int32")
    .Output("group_sizes: int32")
    .Attr("num_groups: int >= 1 = 1")
    .SetShapeFn([](InferenceContext* c) {
      int num_groups = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("num_groups", &num_groups));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->input(0));
      c->set_output(2, c->Vector(num_groups));
      return OkStatus();
    })
    .Doc(R"doc(
The distinct ids of a batch (Virtual Sparse Ids) and, for every id, the index
of its value among them (same shape as ids). With num_groups == 1 the result
equals tf.unique: first-occurrence order. With num_groups > 1 the distinct ids
are grouped by owner (Mix64(id) mod num_groups, the owner function of a
model-parallel table), first-occurrence
order within a group, and group_sizes counts each group: the send order of a
model-parallel all-to-all, with the inverse already pointing into it.
)doc");

REGISTER_OP("SfctrSegmentSums")
    .Input("data: float")
    .Input("segment_ids: int32")
    .Input("num_segments: int32")
    .Attr("squares: bool = false")
    .Attr("max_shards: int = 0")
    .Output("sums: float")
    .Output("sums_of_squares: float")
    .SetShapeFn([](InferenceContext* c) { return SegmentSumsShape(c, /*gathered=*/false); })
    .Doc(R"doc(
Sums of the rows of data [N, D] per segment: sums[s] adds the rows i with
segment_ids[i] == s, in row order (tf.math.unsorted_segment_sum on CPU adds in
the same order). With squares, sums_of_squares[s] adds their element-wise
squares in the same pass; otherwise it is [0, D]. Segment ids must be in
[0, num_segments). The backward of a de-duplicated embedding lookup: one read
of the per-occurrence gradient gives both sums Adagrad needs. A large input is
split over segment ranges for intra-op pool threads that are free, into at most
max_shards ranges (0: half the pool's threads, at least 1); the result does not
depend on the split.
)doc");

REGISTER_OP("SfctrGatherSegmentSums")
    .Input("data: float")
    .Input("data_rows: int32")
    .Input("segment_ids: int32")
    .Input("num_segments: int32")
    .Attr("squares: bool = false")
    .Attr("max_shards: int = 0")
    .Output("sums: float")
    .Output("sums_of_squares: float")
    .SetShapeFn([](InferenceContext* c) { return SegmentSumsShape(c, /*gathered=*/true); })
    .Doc(R"doc(
SfctrSegmentSums of the rows data[data_rows[i]] (i in [0, N)), read in place:
the same sums, in the same order, as of tf.gather(data, data_rows), without
that [N, D] tensor. The backward of a combined multi-hot lookup (data is the
gradient of the combined rows [B, D], data_rows each id's row of the batch and
segment_ids its index among the distinct ids) and the forward of one whose
rows came from other ranks (data the distinct rows, data_rows each id's index
among them, segment_ids its row of the batch). data_rows must be in
[0, rows of data).
)doc");

REGISTER_OP("SfctrVarSegmentSums")
    .Input("var: resource")
    .Input("data_rows: int32")
    .Input("segment_ids: int32")
    .Input("num_segments: int32")
    .Attr("max_shards: int = 0")
    .Output("sums: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle per_id, segments;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &per_id));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &segments));
      shape_inference::DimensionHandle unused;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(per_id, 0), c->Dim(segments, 0), &unused));
      shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(3, &n));
      c->set_output(0, c->Matrix(n, c->UnknownDim()));
      return OkStatus();
    })
    .Doc(R"doc(
SfctrGatherSegmentSums of the rows of a float32 matrix variable, read under its
lock. The sums[s] add var[data_rows[i]] over the i with segment_ids[i] == s, in
order of i, with no [N, D] tensor of the gathered rows. The forward of a
combined multi-hot lookup from the device cache: data_rows are each id's cache
slot, segment_ids its row of the batch. Upcoming rows of the variable are
prefetched. The sums are those of tf.gather then SfctrSegmentSums, bit for bit.
)doc");

REGISTER_OP("SfctrSparseApplyAdagrad")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("grad: float")
    .Input("indices: int32")
    .Input("grad_sq: float")
    .Attr("max_shards: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &unused));
      ShapeHandle grad, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 1, &indices));
      shape_inference::DimensionHandle n;
      return c->Merge(c->Dim(grad, 0), c->Dim(indices, 0), &n);
    })
    .Doc(R"doc(
Adagrad on the rows `indices` of the float variables `var` and `accum`
([rows, dim]), with `grad` [n, dim] and `indices` [n]:
  accum[k] += grad_sq[i]   (grad[i] * grad[i] when grad_sq has no elements)
  var[k]   -= (lr * grad[i]) / (sqrt(accum[k]) + epsilon)
for k = indices[i], in index order. The same result, bit for bit, as
ResourceSparseApplyAdagradV2 (after a scatter-add of grad_sq when given), on
one CPU thread, with the rows of upcoming indices prefetched: several times
faster than TF's CPU kernel when the rows are scattered over a large table. A
large update is split over column ranges for intra-op pool threads that are
free, into at most max_shards ranges (0: half the pool's threads, at least 1).
Every index is checked before any row changes.
)doc");

REGISTER_OP("SfctrSparseApplyFtrl")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("linear: resource")
    .Input("lr: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l2_shrinkage: float")
    .Input("lr_power: float")
    .Input("grad: float")
    .Input("indices: int32")
    .Input("grad_sq: float")
    .Attr("max_shards: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      for (int k = 3; k < 8; ++k) TF_RETURN_IF_ERROR(c->WithRank(c->input(k), 0, &unused));
      ShapeHandle grad, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(8), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(9), 1, &indices));
      shape_inference::DimensionHandle n;
      return c->Merge(c->Dim(grad, 0), c->Dim(indices, 0), &n);
    })
    .Doc(R"doc(
FTRL-Proximal on the rows `indices` of the float variables `var`, `accum` and
`linear` ([rows, dim]), with `grad` [n, dim] and `indices` [n]; for k =
indices[i], in index order, elementwise (s = grad_sq[i], or grad[i]^2 when
grad_sq has no elements; x^-p is sqrt(x) for lr_power -0.5):
  n' = accum[k] + s
  linear[k] += grad[i] + 2 * l2_shrinkage * var[k] - (n'^-p - accum[k]^-p) / lr * var[k]
  var[k] = (clip(linear[k], -l1, l1) - linear[k]) / (n'^-p / lr + 2 * l2)
  accum[k] = n'
ResourceSparseApplyFtrlV2's formula (with s = grad^2), with the rows of
upcoming indices prefetched; large updates are split over column ranges for
free intra-op pool threads (at most max_shards; 0: half the pool's threads).
Every index is checked before any row changes.
)doc");

REGISTER_OP("SfctrNonFiniteMarker")
    .Input("x: float")
    .Output("marker: float")
    .Attr("squares: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
0.0 when every element of x is finite, NaN when one is NaN or +-Inf (with
`squares`, also when one's square overflows float32): a scalar for
CheckNumerics, from one pass on one thread (a reduce_sum over the pool waits
for busy pool threads inside a training step).
)doc");

REGISTER_OP("SfctrGatherRows")
    .Input("var: resource")
    .Input("indices: int32")
    .Attr("max_shards: int = 0")
    .Output("rows: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), c->UnknownDim()));
      return OkStatus();
    })
    .Doc(R"doc(
var[indices] for a float matrix variable and an int32 index vector: what
ResourceGather gives, with the rows of the index 32 ahead prefetched. A large
gather gives ranges of the output to intra-op pool threads that are free and
does the rest itself, in at most max_shards ranges (0: half the pool's
threads, at least 1); TF's kernel splits the gather over the pool and, inside
a busy training step, waits for it.
)doc");

REGISTER_OP("SfctrGatherTensorRows")
    .Input("params: float")
    .Input("indices: int32")
    .Attr("max_shards: int = 0")
    .Output("rows: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), c->Dim(params, 1)));
      return OkStatus();
    })
    .Doc(R"doc(
params[indices] for a float matrix tensor and an int32 index vector (rows that
came back from an all-to-all, spread to the batch's ids): SfctrGatherRows on
a tensor instead of a variable.
)doc");

REGISTER_OP("SfctrRowIds")
    .Input("row_splits: Tsplits")
    .Attr("Tsplits: {int32, int64}")
    .Output("row_ids: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &splits));
      return VectorOfUnknown(c, 0);
    })
    .Doc(R"doc(
The row of each value of a 2-D ragged tensor from its row_splits (its
value_rowids(), as int32), in one pass on one thread. TF's value_rowids builds
a [rows, longest row] mask and a search over the splits costs a binary search
per value. row_splits must start at 0 and never decrease, and the rows must
fit in int32.
)doc");

REGISTER_OP("SfctrGatherIndex")
    .Input("params: int32")
    .Input("indices: int32")
    .Output("output: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &params));
      c->set_output(0, c->input(1));
      return OkStatus();
    })
    .Doc(R"doc(
params[indices] for an int32 vector params and int32 indices of any shape (the
result has their shape): tf.gather's result, on one thread. For the small
index tables of a step (slots[inverse]): TF's kernel splits such a gather over
the intra-op pool, and inside a busy step waiting for the pool costs more than
the gather.
)doc");

REGISTER_OP("SfctrIdsEqual")
    .Input("a: int64")
    .Input("b: int64")
    .Output("equal: bool")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
True when a and b have the same number of elements and equal elements in
order (shapes are not compared): whether a batch's distinct ids are the ones a
lookahead plan was made for. One pass on one thread that stops at the first
difference; tf.equal plus reduce_all split the work over the intra-op pool,
and inside a busy step they wait for it.
)doc");

REGISTER_OP("SfctrFirstBadInverse")
    .Input("ids: int64")
    .Input("unique_ids: int64")
    .Input("inverse: Tidx")
    .Attr("Tidx: {int32, int64}")
    .Output("position: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
The first position i where inverse[i] is not in [0, size(unique_ids)) or
unique_ids[inverse[i]] != ids[i], or -1: whether a de-duplicated feature
describes its ids (every position checked, in one pass on one thread). ids and
inverse must have the same number of elements (shapes are not compared).
)doc");

REGISTER_OP("SfctrFrame")
    .Input("sections: N * float64")
    .Input("counts: N * int32")
    .Output("message: float64")
    .Output("splits: int32")
    .Attr("N: int >= 1")
    .Attr("steady: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 2;
      ShapeHandle counts, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 1, &counts));
      for (int k = 0; k < n; ++k) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(k), 1, &unused));
        TF_RETURN_IF_ERROR(c->Merge(counts, c->input(n + k), &unused));
      }
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, counts);
      return OkStatus();
    })
    .Doc(R"doc(
One all-to-all message from N sections of 64-bit words, each in destination
order (counts[k][r] words of section k go to rank r, consecutive, rank by
rank). The part for rank r is a header of N words (counts[0..N)[r] as int64
bits) followed by its words of section 0, 1, ... N-1; splits[r] is that
part's length. One pass on one thread, where ragged gathers and slices of the
same layout were a hundred small ops on a model-parallel step's critical path.
With steady, the message is followed by zeros up to a steady length (n words
rounded up to a multiple of 2^(bit_length(n) - 4)): an all-to-all sends only
the splits' words, and an input whose shape rarely changes lets Horovod's
response cache skip the negotiation.
)doc");

REGISTER_OP("SfctrUnframe")
    .Input("message: float64")
    .Input("sizes: int32")
    .Output("sections: N * float64")
    .Output("counts: int32")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      ShapeHandle sizes, message;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &message));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &sizes));
      for (int k = 0; k < n; ++k) c->set_output(k, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(n, c->Matrix(c->Dim(sizes, 0), n));
      return OkStatus();
    })
    .Doc(R"doc(
The inverse of SfctrFrame on what an all-to-all delivered: message holds
sizes[s] words from each rank s, in rank order, each part framed by
SfctrFrame with N sections. sections[k] is section k of every part, sender
by sender; counts[s][k] how many words of it came from rank s. A part whose
header does not match its length fails the op, naming the sender.
)doc");

}  // namespace tensorflow
