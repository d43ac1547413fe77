// Thin TF kernels of the store ops (the host table and cache directory of one
// layer, as a TF resource) over the TF-free core in ops/core: each one unpacks
// its tensors, calls the core and packs the results. CPU kernels only: every
// input and output is host memory, so on a GPU machine TensorFlow places
// these ops on the CPU and copies slots/rows to the device variables. The
// training step's kernels that work on tensors and variables are in
// step_kernels.cc.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/platform/threadpool.h"

#include "../core/embedding_store.h"
#include "kernel_util.h"

namespace tensorflow {
namespace {

using sfctr_kernels::CatchOutOfMemory;
using sfctr_kernels::CheckFloatVariable;

// Test-only: SFCTR_TEST_HOST_MEMORY_LIMIT=<bytes> makes the tables of this
// library refuse memory beyond that many bytes (of host table indexes, row
// blocks and cache directories, all stores together), as an exhausted host
// would (sfctr::TestAllocationHook), so that tests can run a table out of
// memory without exhausting the machine (tests/test_out_of_memory.py). Read
// once, when the library is loaded. Never set it outside tests.
[[maybe_unused]] const bool kTestMemoryLimitRead = [] {
  const char* limit = std::getenv("SFCTR_TEST_HOST_MEMORY_LIMIT");
  if (limit != nullptr && *limit != '\0') {
    sfctr::TestAllocationHook().limit.store(std::strtoll(limit, nullptr, 10));
  }
  return true;
}();

class StoreResource : public ResourceBase {
 public:
  explicit StoreResource(const sfctr::StoreOptions& options) : store_(options) {}
  sfctr::EmbeddingStore& store() { return store_; }
  std::string DebugString() const override {
    const std::string& name = store_.table().name();
    return "SfctrEmbeddingStore(" + (name.empty() ? "" : "'" + name + "', ") +
           "dim=" + std::to_string(store_.table().dim()) +
           ", rows=" + std::to_string(store_.table().size()) + ")";
  }
  int64_t MemoryUsed() const override {
    return static_cast<int64_t>(store_.table().AllocatedBytes());
  }
  // Set once by SfctrStoreRelease (the Python object owning the table was
  // deleted); the handle may live on in functions traced before.
  bool released() const { return released_.load(std::memory_order_acquire); }
  bool MarkReleased() { return !released_.exchange(true, std::memory_order_acq_rel); }

 private:
  sfctr::EmbeddingStore store_;
  std::atomic<bool> released_{false};
};

// `st` as a TF status. With `ctx` the errors about the table's room
// (max_rows, memory) name the op; with `table` (the owning layer's name) a
// message that does not name the table yet starts with it, so that a model
// of many tables says which one to enlarge.
Status ToTf(const sfctr::CoreStatus& st, OpKernelContext* ctx = nullptr,
            const std::string& table = "") {
  if (st.ok()) return OkStatus();
  std::string message = st.message();
  if (!table.empty() && message.find("'" + table + "'") == std::string::npos) {
    message = "table '" + table + "': " + message;
  }
  switch (st.code()) {
    case sfctr::CoreStatus::Code::kResourceExhausted:
      if (ctx != nullptr) {
        return errors::ResourceExhausted(ctx->op_kernel().type_string(), ": ", message);
      }
      return errors::ResourceExhausted(message);
    default:
      return errors::InvalidArgument(message);
  }
}

Status GetStore(OpKernelContext* ctx, core::RefCountPtr<StoreResource>* out) {
  return LookupResource(ctx, HandleFromInput(ctx, 0), out);
}

// Base of every kernel that works on a store: looks the resource up and
// hands it to ComputeOnStore, with running out of memory made an error.
class StoreOpKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final {
    core::RefCountPtr<StoreResource> res;
    OP_REQUIRES_OK(ctx, GetStore(ctx, &res));
    sfctr::EmbeddingStore& store = res->store();
    OP_REQUIRES(ctx, !res->released(),
                errors::FailedPrecondition(
                    store.table().Describe(), " was released: the CachedEmbedding "
                    "(or EmbeddingStore) that owned it was deleted, and only a function "
                    "traced before still refers to it. Keep the layer (or its model) alive "
                    "while its functions run"));
    CatchOutOfMemory(
        ctx,
        [&] {
          return "working on " + store.table().Describe() +
                 " (its rows are intact: each is stored whole or unchanged). Give the "
                 "process more memory, or bound the table with max_rows and remove rarely "
                 "used ids with prune.";
        },
        [&] { ComputeOnStore(ctx, store); });
  }

 protected:
  virtual void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) = 0;
};

Status CheckIds(const Tensor& ids) {
  if (!TensorShapeUtils::IsVector(ids.shape())) {
    return errors::InvalidArgument("ids must be a vector, got shape ",
                                   ids.shape().DebugString());
  }
  return OkStatus();
}

Status CheckRows(const Tensor& ids, const Tensor& rows, int64_t width,
                 const char* what) {
  TF_RETURN_IF_ERROR(CheckIds(ids));
  if (rows.dims() != 2 || rows.dim_size(0) != ids.dim_size(0) ||
      rows.dim_size(1) != width) {
    return errors::InvalidArgument(what, " must have shape [", ids.dim_size(0),
                                   ", ", width, "] (one row per id), got ",
                                   rows.shape().DebugString());
  }
  return OkStatus();
}

// Use counts as the core stores them: clamped to [0, 2^32 - 1].
std::vector<uint32_t> ClampCounts(const Tensor& counts) {
  auto c = counts.flat<int64_t>();
  std::vector<uint32_t> out(c.size());
  for (int64_t i = 0; i < c.size(); ++i) {
    out[i] = static_cast<uint32_t>(
        std::min<int64_t>(std::max<int64_t>(c(i), 0), 0xffffffffLL));
  }
  return out;
}

template <typename T>
void OutputVector(OpKernelContext* ctx, int index, const std::vector<T>& v) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(
                          index, TensorShape({static_cast<int64_t>(v.size())}),
                          &out));
  std::copy(v.begin(), v.end(), out->flat<T>().data());
}

// Use counts as an int64 output, converted on the way (no temporary buffer
// that could run out of memory after the store changed).
void OutputCounts(OpKernelContext* ctx, int index, const std::vector<uint32_t>& v) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(
                          index, TensorShape({static_cast<int64_t>(v.size())}), &out));
  std::copy(v.begin(), v.end(), out->flat<int64_t>().data());
}

class StoreCreateOp : public OpKernel {
 public:
  explicit StoreCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int dim, num_state;
    int64_t seed, max_rows, capacity, expected_rows;
    std::string kind;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_state", &num_state));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("state_init", &options_.table.state_init));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_kind", &kind));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_a", &options_.table.init.a));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_b", &options_.table.init.b));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_rows", &max_rows));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cache_capacity", &capacity));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("expected_rows", &expected_rows));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reserve_rows", &options_.table.reserve_rows));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &options_.table.name));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("host_rows_dir", &options_.table.rows_dir));
    OP_REQUIRES(ctx, sfctr::ParseInitKind(kind, &options_.table.init.kind),
                errors::InvalidArgument(
                    "init_kind must be constant, uniform, normal or "
                    "truncated_normal, got '", kind, "'"));
    OP_REQUIRES(ctx,
                static_cast<int>(options_.table.state_init.size()) == num_state,
                errors::InvalidArgument("state_init needs ", num_state,
                                        " values, got ",
                                        options_.table.state_init.size()));
    for (size_t k = 0; k < options_.table.state_init.size(); ++k) {
      OP_REQUIRES(ctx, std::isfinite(options_.table.state_init[k]),
                  errors::InvalidArgument("state_init[", k, "] must be finite, got ",
                                          options_.table.state_init[k]));
    }
    // What would make initial rows NaN or infinite for sure (a layer's
    // initializer is checked further in tf_sfctr/initializers.py, which
    // names its arguments).
    const float a = options_.table.init.a, b = options_.table.init.b;
    const sfctr::InitKind init_kind = options_.table.init.kind;
    const bool init_ok =
        std::isfinite(a) && std::isfinite(b) &&
        (init_kind == sfctr::InitKind::kUniform ? a <= b && std::isfinite(b - a)
         : init_kind == sfctr::InitKind::kConstant ? true
                                                   : b >= 0);
    OP_REQUIRES(ctx, init_ok,
                errors::InvalidArgument(
                    "init_a and init_b of a '", kind, "' initializer must be finite (uniform: "
                    "init_a <= init_b, init_b - init_a a finite float32; normal and "
                    "truncated_normal: init_b, the standard deviation, >= 0), got init_a ", a,
                    " and init_b ", b));
    OP_REQUIRES(ctx, capacity < (int64_t{1} << 31),
                errors::InvalidArgument("cache_capacity must be below 2^31"));
    OP_REQUIRES(ctx, num_state >= 0 && int64_t{dim} * (1 + num_state) < (int64_t{1} << 31),
                errors::InvalidArgument("dim * (1 + num_state) (floats per host row) must be "
                                        "below 2^31, got dim ", dim, " and num_state ",
                                        num_state));
    options_.table.dim = dim;
    options_.table.num_state = num_state;
    options_.table.init.seed = static_cast<uint64_t>(seed);
    options_.table.max_rows = max_rows;
    options_.table.expected_rows = expected_rows;
    options_.cache_capacity = capacity;
  }

  void Compute(OpKernelContext* ctx) override {
    StoreResource* resource = nullptr;
    try {
      resource = new StoreResource(options_);
    } catch (const sfctr::RowFileError& e) {
      ctx->CtxFailure(errors::InvalidArgument(
          sfctr::HostTable::Describe(options_.table.name), ": ", e.what()));
      return;
    } catch (const sfctr::DiskFull&) {
      ctx->CtxFailure(errors::ResourceExhausted(
          "no disk space in host_rows_dir '", options_.table.rows_dir, "' for the rows of ",
          sfctr::HostTable::Describe(options_.table.name),
          " that reserve_rows=True allocates up front; free space there, lower "
          "expected_rows, or set reserve_rows=False"));
      return;
    } catch (const std::exception&) {  // bad_alloc, or length_error past max_size
      ctx->CtxFailure(errors::ResourceExhausted(
          "not enough memory for the cache directory of cache_capacity=",
          options_.cache_capacity, " and the indexes of ",
          sfctr::HostTable::Describe(options_.table.name),
          options_.table.reserve_rows ? " and rows" : "", " sized for expected_rows=",
          options_.table.expected_rows,
          "; lower cache_capacity or expected_rows (or leave it unset)",
          options_.table.reserve_rows ? ", or set reserve_rows=False" : ""));
      return;
    }
    Tensor* handle = nullptr;
    AllocatorAttributes attr;
    attr.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &handle, attr));
    // The handle owns the only reference; the store dies with its last handle.
    handle->scalar<ResourceHandle>()() =
        ResourceHandle::MakeRefCountingHandle<StoreResource>(
            resource, ctx->device()->name());
  }

 private:
  sfctr::StoreOptions options_;
};

// Writes the n x width matrix `rows` into outputs [first, first + parts) as
// column blocks of width / parts each.
void OutputColumnBlocks(OpKernelContext* ctx, int first, int parts,
                        const std::vector<float>& rows, int64_t width) {
  const int64_t n = width == 0 ? 0 : static_cast<int64_t>(rows.size()) / width;
  const int64_t part_width = width / parts;
  for (int p = 0; p < parts; ++p) {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + p,
                                             TensorShape({n, part_width}), &out));
    float* dst = out->flat<float>().data();
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(rows.data() + i * width + p * part_width, part_width,
                  dst + i * part_width);
    }
  }
}

class CachePrepareOp : public StoreOpKernel {
 public:
  explicit CachePrepareOp(OpKernelConstruction* ctx) : StoreOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_parts", &num_parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("skip_if_refused", &skip_if_refused_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("require_distinct", &require_distinct_));
  }

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    const Tensor& hint_ids = ctx->input(2);
    const Tensor& hint_steps = ctx->input(3);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(hint_ids.shape()) &&
                    hint_steps.shape() == hint_ids.shape(),
                errors::InvalidArgument(
                    "hint_ids and hint_steps must be vectors of one length, got ",
                    hint_ids.shape().DebugString(), " and ",
                    hint_steps.shape().DebugString()));
    sfctr::EvictionHints hints;
    hints.ids = hint_ids.flat<int64_t>().data();
    hints.steps = hint_steps.flat<int32_t>().data();
    hints.n = hint_ids.NumElements();
    for (int64_t i = 0; i < hints.n; ++i) {
      OP_REQUIRES(ctx, hints.steps[i] >= 1,
                  errors::InvalidArgument(
                      "hint_steps[", i, "] = ", hints.steps[i],
                      ": a hint names a later batch, 1 (the next) or more"));
    }
    const int64_t width = store.table().width();
    OP_REQUIRES(ctx, width % num_parts_ == 0,
                errors::InvalidArgument("num_parts=", num_parts_,
                                        " does not divide the row width ", width));
    sfctr::PrepareResult r;
    thread::ThreadPool* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const sfctr::Scheduler schedule = [pool](std::function<void()> task) {
      pool->Schedule(std::move(task));
    };
    // With a one-thread pool (e.g. several ranks sharing a host, one thread
    // each) the fetch runs inline: a second busy thread would only compete.
    const bool parallel = pool != nullptr && pool->NumThreads() > 1;
    const sfctr::CoreStatus st = store.Prepare(ids.flat<int64_t>().data(), ids.NumElements(),
                                               &r, parallel ? &schedule : nullptr, hints,
                                               require_distinct_);
    // Prepare changes nothing when it fails (every check, including the host
    // rows' reservation against max_rows, comes before the directory
    // changes; out of host memory, the directory change is undone and only
    // new ids may have got their initial host rows), so a refused plan can
    // be skipped.
    const bool skipped = !st.ok() && skip_if_refused_;
    if (!skipped) OP_REQUIRES_OK(ctx, ToTf(st, ctx, store.table().name()));
    if (skipped) {
      // The caller reports the refusal by a code (other ranks too); the
      // reason (max_rows, memory, the disk of host_rows_dir) is only here:
      // an error log, which TF_CPP_MIN_LOG_LEVEL=2 still shows.
      // Two callers skip: a lookahead plan (the ids are the next batch's,
      // and the current step trains without a plan) and a sharded step's
      // owner (whose refusal every rank raises).
      LOG(ERROR) << "SfctrCachePrepare, " << store.table().Describe() << ": "
                 << ids.NumElements() << " ids were refused and nothing changed. If they "
                 << "are a lookahead plan's, they are the next batch's ids: the current "
                 << "step trains without a plan, and the next batch's own step prepares "
                 << "them again (and fails the same way if the cause remains). Cause: "
                 << st.message();
      r = sfctr::PrepareResult();
      r.slots.assign(ids.NumElements(), -1);
    }
    OutputVector(ctx, 0, r.slots);
    OutputVector(ctx, 1, r.miss_slots);
    OutputColumnBlocks(ctx, 2, num_parts_, r.miss_rows, width);
    const int next = 2 + num_parts_;
    OutputVector(ctx, next, r.evict_slots);
    OutputVector(ctx, next + 1, r.evict_ids);
    OutputCounts(ctx, next + 2, r.evict_uses);
    Tensor* prepared = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(next + 3, TensorShape({}), &prepared));
    prepared->scalar<bool>()() = !skipped;
  }

 private:
  int num_parts_;
  bool skip_if_refused_ = false;
  bool require_distinct_ = false;
};

class HostWriteOp : public StoreOpKernel {
 public:
  explicit HostWriteOp(OpKernelConstruction* ctx) : StoreOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mark_changed", &mark_changed_));
  }

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    OpInputList parts;
    OP_REQUIRES_OK(ctx, ctx->input_list("rows", &parts));
    const Tensor& counts = ctx->input(2 + parts.size());
    sfctr::HostTable& table = store.table();
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    const int64_t n = ids.NumElements();
    int64_t total = 0;
    for (int p = 0; p < parts.size(); ++p) {
      const Tensor& part = parts[p];
      OP_REQUIRES(ctx, part.dims() == 2 && part.dim_size(0) == n,
                  errors::InvalidArgument(
                      "rows must be [", n, ", columns] blocks (one row per id), "
                      "got ", part.shape().DebugString()));
      total += part.dim_size(1);
    }
    OP_REQUIRES(ctx, total == table.width(),
                errors::InvalidArgument(
                    "rows must have ", table.width(),
                    " columns in all (value and optimizer state), got ", total));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(counts.shape()) &&
                         (counts.NumElements() == 0 || counts.NumElements() == n),
                errors::InvalidArgument(
                    "counts must be empty or hold one count per id (", n,
                    "), got shape ", counts.shape().DebugString()));
    std::vector<uint32_t> add;
    if (counts.NumElements() > 0) add = ClampCounts(counts);
    const float* rows = nullptr;
    std::vector<float> joined;
    if (parts.size() == 1) {
      rows = parts[0].flat<float>().data();
    } else {
      joined.resize(n * total);
      int64_t col = 0;
      for (int p = 0; p < parts.size(); ++p) {
        const int64_t w = parts[p].dim_size(1);
        const float* src = parts[p].flat<float>().data();
        for (int64_t i = 0; i < n; ++i) {
          std::copy_n(src + i * w, w, joined.data() + i * total + col);
        }
        col += w;
      }
      rows = joined.data();
    }
    OP_REQUIRES_OK(ctx, ToTf(store.WriteBack(ids.flat<int64_t>().data(), n, rows,
                                             add.empty() ? nullptr : add.data(),
                                             mark_changed_),
                             ctx, store.table().name()));
  }

 private:
  bool mark_changed_ = true;
};

class HostAssignOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    const Tensor& values = ctx->input(2);
    sfctr::HostTable& table = store.table();
    OP_REQUIRES_OK(ctx, CheckRows(ids, values, table.dim(), "values"));
    const float* v = values.flat<float>().data();
    for (int64_t i = 0; i < values.NumElements(); ++i) {
      OP_REQUIRES(ctx, std::isfinite(v[i]),
                  errors::InvalidArgument(
                      "values must be finite; row ", i / table.dim(),
                      " (id ", ids.flat<int64_t>()(i / table.dim()),
                      ") holds ", v[i], ". Nothing was changed."));
    }
    OP_REQUIRES_OK(ctx, ToTf(table.AssignValues(ids.flat<int64_t>().data(),
                                                ids.NumElements(), v),
                             ctx));
  }
};

// The kernel's intra-op pool as a core Scheduler (none for a one-thread
// pool: e.g. several ranks sharing a host, one thread each, where a second
// busy thread would only compete).
struct PoolScheduler {
  explicit PoolScheduler(OpKernelContext* ctx) {
    thread::ThreadPool* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    if (pool != nullptr && pool->NumThreads() > 1) {
      threads = pool->NumThreads();
      schedule = [pool](std::function<void()> task) { pool->Schedule(std::move(task)); };
    }
  }
  const sfctr::Scheduler* get() const { return schedule ? &schedule : nullptr; }
  sfctr::Scheduler schedule;
  int threads = 1;
};

class HostReadOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    const sfctr::HostTable& table = store.table();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({ids.NumElements(), table.width()}),
                            &out));
    const PoolScheduler pool(ctx);
    table.Find(ids.flat<int64_t>().data(), ids.NumElements(), out->flat<float>().data(),
               /*values_only=*/false, pool.get(), pool.threads);
  }
};

// Values of ids for a read outside training (inference), in one kernel: the
// cached ones from the cache rows variable, the others from the host table
// (values only). CPU only: the variable must be in host memory.
class LookupValuesOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    using CPUDevice = Eigen::ThreadPoolDevice;
    const Tensor& ids = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &var));
    OP_REQUIRES_OK(ctx, CheckFloatVariable(var.get(), "cache_rows"));
    // As SfctrGatherRows: a shared lock for the whole read, so that a
    // concurrent update never sees a second reference and copies the cache.
    OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, float>(ctx, var.get()));
    tf_shared_lock lock(*var->mu());
    const Tensor& rows = *var->tensor();
    const int64_t dim = store.table().dim();
    OP_REQUIRES(ctx, rows.dims() == 2 && rows.dim_size(0) == store.cache_capacity() &&
                         rows.dim_size(1) == dim,
                errors::InvalidArgument("cache_rows must have shape [", store.cache_capacity(),
                                        ", ", dim, "] (the store's cache), got ",
                                        rows.shape().DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({ids.NumElements(), dim}), &out));
    const PoolScheduler pool(ctx);
    store.LookupValues(ids.flat<int64_t>().data(), ids.NumElements(),
                       rows.flat<float>().data(), out->flat<float>().data(), pool.get(),
                       pool.threads);
  }
};

class CacheProbeOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    store.Probe(ids.flat<int64_t>().data(), ids.NumElements(),
                       out->flat<int32_t>().data());
  }
};

class CacheEntriesOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& hold = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(hold.shape()),
                errors::InvalidArgument("hold_ids must be a vector, got shape ",
                                        hold.shape().DebugString()));
    std::vector<int64_t> ids;
    std::vector<int32_t> slots;
    store.CachedEntries(&ids, &slots, hold.flat<int64_t>().data(), hold.NumElements());
    OutputVector(ctx, 0, ids);
    OutputVector(ctx, 1, slots);
  }
};

// SfctrCacheMarkDirty (dirty = true) and SfctrCacheMarkClean.
class CacheMarkOp : public StoreOpKernel {
 public:
  CacheMarkOp(OpKernelConstruction* ctx, bool dirty) : StoreOpKernel(ctx), dirty_(dirty) {}

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& slots = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(slots.shape()),
                errors::InvalidArgument("slots must be a vector, got shape ",
                                        slots.shape().DebugString()));
    const int32_t* data = slots.flat<int32_t>().data();
    if (dirty_) {
      store.MarkDirty(data, slots.NumElements());
    } else {
      store.MarkClean(data, slots.NumElements());
    }
  }

 private:
  const bool dirty_;
};

class CacheMarkDirtyOp : public CacheMarkOp {
 public:
  explicit CacheMarkDirtyOp(OpKernelConstruction* ctx) : CacheMarkOp(ctx, true) {}
};

class CacheMarkCleanOp : public CacheMarkOp {
 public:
  explicit CacheMarkCleanOp(OpKernelConstruction* ctx) : CacheMarkOp(ctx, false) {}
};

class CacheClearOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    store.ClearCache();
  }
};

class HostExportOp : public StoreOpKernel {
 public:
  explicit HostExportOp(OpKernelConstruction* ctx) : StoreOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("columns", &columns_));
  }

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const int64_t full = store.table().width();
    OP_REQUIRES(ctx, columns_ == -1 || (columns_ >= 1 && columns_ <= full),
                errors::InvalidArgument("SfctrHostExport: columns must be -1 (whole rows) or "
                                        "1..", full, " (the row width), got ", columns_));
    const int64_t width = columns_ == -1 ? full : columns_;
    Status status;
    std::vector<int64_t> scratch_ids, scratch_counts;
    std::vector<float> scratch_rows;
    store.table().ExportTo(
        [&](int64_t n, int64_t** ids, float** rows, int64_t** counts) {
          Tensor *t_ids = nullptr, *t_rows = nullptr, *t_counts = nullptr;
          status = ctx->allocate_output(0, TensorShape({n}), &t_ids);
          if (status.ok()) {
            status = ctx->allocate_output(1, TensorShape({n, width}), &t_rows);
          }
          if (status.ok()) {
            status = ctx->allocate_output(2, TensorShape({n}), &t_counts);
          }
          if (!status.ok()) {  // write into scratch so the export can finish
            scratch_ids.resize(n);
            scratch_rows.resize(n * width);
            scratch_counts.resize(n);
            *ids = scratch_ids.data();
            *rows = scratch_rows.data();
            *counts = scratch_counts.data();
            return;
          }
          *ids = t_ids->flat<int64_t>().data();
          *rows = t_rows->flat<float>().data();
          *counts = t_counts->flat<int64_t>().data();
        }, width);
    OP_REQUIRES_OK(ctx, status);
  }

 private:
  int64_t columns_ = -1;
};

class HostExportRangeOp : public StoreOpKernel {
 public:
  explicit HostExportRangeOp(OpKernelConstruction* ctx) : StoreOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("changed_only", &changed_only_));
  }

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& cursor = ctx->input(1);
    const Tensor& max_rows = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(cursor.shape()) &&
                         TensorShapeUtils::IsScalar(max_rows.shape()),
                errors::InvalidArgument("SfctrHostExportRange: cursor and max_rows must be "
                                        "scalars"));
    const int64_t limit = max_rows.scalar<int64_t>()();
    OP_REQUIRES(ctx, limit >= 1,
                errors::InvalidArgument("SfctrHostExportRange: max_rows must be at least 1, "
                                        "got ", limit));
    uint64_t at = static_cast<uint64_t>(cursor.scalar<int64_t>()());
    std::vector<int64_t> ids, counts;
    std::vector<float> rows;
    const int64_t width = store.table().width();
    // The outputs are allocated while the table waits: a changed_only part
    // whose outputs cannot be allocated leaves its rows flagged (and the
    // cursor where it was) for the next call.
    Tensor* t_ids = nullptr;
    Tensor* t_rows = nullptr;
    Tensor* t_counts = nullptr;
    Tensor* next = nullptr;
    Status allocated;
    store.table().ExportRange(&at, limit, &ids, &rows, &counts, changed_only_, [&] {
      const int64_t n = static_cast<int64_t>(ids.size());
      allocated = ctx->allocate_output(0, TensorShape({n}), &t_ids);
      if (allocated.ok()) allocated = ctx->allocate_output(1, TensorShape({n, width}), &t_rows);
      if (allocated.ok()) allocated = ctx->allocate_output(2, TensorShape({n}), &t_counts);
      if (allocated.ok()) allocated = ctx->allocate_output(3, TensorShape({}), &next);
      return allocated.ok();
    });
    OP_REQUIRES_OK(ctx, allocated);
    std::copy(ids.begin(), ids.end(), t_ids->flat<int64_t>().data());
    std::copy(rows.begin(), rows.end(), t_rows->flat<float>().data());
    std::copy(counts.begin(), counts.end(), t_counts->flat<int64_t>().data());
    next->scalar<int64_t>()() = static_cast<int64_t>(at);  // -1: no more rows
  }

 private:
  bool changed_only_ = false;
};

class HostAddCountsOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    const Tensor& counts = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    OP_REQUIRES(ctx, counts.shape() == ids.shape(),
                errors::InvalidArgument("counts must have the shape of ids"));
    const std::vector<uint32_t> add = ClampCounts(counts);
    store.table().AddUseCounts(ids.flat<int64_t>().data(), ids.NumElements(),
                               add.data());
  }
};

class HostSetSeedOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& seed = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(seed.shape()),
                errors::InvalidArgument("seed must be a scalar, got shape ",
                                        seed.shape().DebugString()));
    store.table().SetInitSeed(
        static_cast<uint64_t>(seed.flat<int64_t>()(0)));
  }
};

// Not a StoreOpKernel: a second release is a no-op, not an error.
class StoreReleaseOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<StoreResource> res;
    OP_REQUIRES_OK(ctx, GetStore(ctx, &res));
    if (!res->MarkReleased()) return;
    res->store().Release();
  }
};

class HostClearOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    store.ClearHost();
  }
};

// The `decay` input (2) of the prune ops: a use-count factor in [0, 1].
Status GetDecay(OpKernelContext* ctx, double* decay) {
  const Tensor& t = ctx->input(2);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    return errors::InvalidArgument("decay must be a scalar");
  }
  const double value = t.scalar<double>()();
  if (!(value >= 0.0 && value <= 1.0)) {  // (NaN too)
    return errors::InvalidArgument("decay must be in [0, 1], got ", value);
  }
  *decay = value;
  return OkStatus();
}

class HostPruneOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& min_uses = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(min_uses.shape()),
                errors::InvalidArgument("min_uses must be a scalar"));
    const int64_t m = min_uses.scalar<int64_t>()();
    OP_REQUIRES(ctx, m >= 1 && m <= 65536,
                errors::InvalidArgument("min_uses must be in [1, 65536] (use counters "
                                        "saturate at 65535), got ", m));
    double decay = 1.0;
    OP_REQUIRES_OK(ctx, GetDecay(ctx, &decay));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = store.PruneHost(static_cast<uint32_t>(m), decay);
  }
};

class HostPruneToSizeOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& max_rows = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(max_rows.shape()),
                errors::InvalidArgument("max_rows must be a scalar"));
    const int64_t m = max_rows.scalar<int64_t>()();
    OP_REQUIRES(ctx, m >= 0, errors::InvalidArgument("max_rows must be >= 0, got ", m));
    double decay = 1.0;
    OP_REQUIRES_OK(ctx, GetDecay(ctx, &decay));
    Tensor* removed = nullptr;
    Tensor* min_uses = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &removed));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &min_uses));
    uint32_t threshold = 0;
    removed->scalar<int64_t>()() = store.PruneHostToSize(m, &threshold, decay);
    min_uses->scalar<int64_t>()() = threshold;
  }
};

class HostUseCountHistogramOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    int64_t held = 0;
    const std::vector<int64_t> per_count = store.HostUseCountHistogram(&held);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = held;
    OutputVector(ctx, 1, per_count);
  }
};

// The `count` input (1) of SfctrHostTiedIds and SfctrHostPruneBelow: a use
// count in [0, 65536] (counters saturate at 65535; 65536 is above all).
Status GetUseCount(OpKernelContext* ctx, const char* name, uint32_t* count) {
  const Tensor& t = ctx->input(1);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    return errors::InvalidArgument(name, " must be a scalar");
  }
  const int64_t value = t.scalar<int64_t>()();
  if (value < 0 || value > 65536) {
    return errors::InvalidArgument(name, " must be in [0, 65536], got ", value);
  }
  *count = static_cast<uint32_t>(value);
  return OkStatus();
}

class HostTiedIdsOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    uint32_t count = 0;
    OP_REQUIRES_OK(ctx, GetUseCount(ctx, "count", &count));
    OutputVector(ctx, 0, store.HostTiedIds(count));
  }
};

class HostPruneBelowOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    uint32_t below = 0;
    OP_REQUIRES_OK(ctx, GetUseCount(ctx, "below", &below));
    double decay = 1.0;
    OP_REQUIRES_OK(ctx, GetDecay(ctx, &decay));
    const Tensor& last = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(last.shape()) && last.NumElements() <= 1,
                errors::InvalidArgument("last must be a vector of 0 or 1 ids, got shape ",
                                        last.shape().DebugString()));
    const bool has_last = last.NumElements() == 1;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() =
        store.PruneHostBelow(below, has_last, has_last ? last.vec<int64_t>()(0) : 0, decay);
  }
};

class HostTakeRemovedOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    // The outputs are allocated before the table drops its list: a failed
    // allocation leaves the list for the next call.
    Tensor* complete = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &complete));
    std::vector<int64_t> removed;
    Status delivered;
    complete->scalar<bool>()() = store.table().TakeRemoved(
        &removed, [&](const std::vector<int64_t>& ids) {
          Tensor* out = nullptr;
          delivered = ctx->allocate_output(
              0, TensorShape({static_cast<int64_t>(ids.size())}), &out);
          if (!delivered.ok()) return false;
          std::copy(ids.begin(), ids.end(), out->flat<int64_t>().data());
          return true;
        });
    OP_REQUIRES_OK(ctx, delivered);
    if (ctx->mutable_output(0) == nullptr) OutputVector(ctx, 0, removed);  // (incomplete)
  }
};

class StoreRemoveOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckIds(ids));
    Tensor* removed = nullptr;
    Tensor* cached = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &removed));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &cached));
    int64_t num_cached = 0;
    removed->scalar<int64_t>()() =
        store.Remove(ids.flat<int64_t>().data(), ids.NumElements(), &num_cached);
    cached->scalar<int64_t>()() = num_cached;
  }
};

class StoreStatsOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const sfctr::StoreStats s = store.Stats();
    OutputVector(ctx, 0,
                 std::vector<int64_t>{s.hits, s.misses, s.evictions,
                                      s.host_rows, s.cache_capacity,
                                      s.cached_rows, s.write_backs_by_handle,
                                      s.host_bytes, s.host_file_bytes});
  }
};

class HostDropFileRowsOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext*, sfctr::EmbeddingStore& store) override {
    store.table().DropFileRowsFromMemory();
  }
};

class StoreSetCountersOp : public StoreOpKernel {
 public:
  using StoreOpKernel::StoreOpKernel;

 protected:
  void ComputeOnStore(OpKernelContext* ctx, sfctr::EmbeddingStore& store) override {
    const Tensor& c = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(c.shape()) && c.NumElements() == 3,
                errors::InvalidArgument("counters must be a vector of 3 values (hits, "
                                        "misses, evictions), got shape ",
                                        c.shape().DebugString()));
    auto v = c.flat<int64_t>();
    OP_REQUIRES(ctx, v(0) >= 0 && v(1) >= 0 && v(2) >= 0,
                errors::InvalidArgument("counters (hits, misses, evictions) must be >= 0, "
                                        "got ", v(0), ", ", v(1), ", ", v(2)));
    store.SetCounters(v(0), v(1), v(2));
  }
};

#define SFCTR_CPU_KERNEL(name, cls) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU), cls)

SFCTR_CPU_KERNEL("SfctrStoreCreate", StoreCreateOp);
SFCTR_CPU_KERNEL("SfctrCachePrepare", CachePrepareOp);
SFCTR_CPU_KERNEL("SfctrHostWrite", HostWriteOp);
SFCTR_CPU_KERNEL("SfctrHostAssign", HostAssignOp);
SFCTR_CPU_KERNEL("SfctrHostRead", HostReadOp);
SFCTR_CPU_KERNEL("SfctrCacheProbe", CacheProbeOp);
SFCTR_CPU_KERNEL("SfctrLookupValues", LookupValuesOp);
SFCTR_CPU_KERNEL("SfctrCacheEntries", CacheEntriesOp);
SFCTR_CPU_KERNEL("SfctrCacheMarkDirty", CacheMarkDirtyOp);
SFCTR_CPU_KERNEL("SfctrCacheMarkClean", CacheMarkCleanOp);
SFCTR_CPU_KERNEL("SfctrCacheClear", CacheClearOp);
SFCTR_CPU_KERNEL("SfctrHostExport", HostExportOp);
SFCTR_CPU_KERNEL("SfctrHostExportRange", HostExportRangeOp);
SFCTR_CPU_KERNEL("SfctrHostAddCounts", HostAddCountsOp);
SFCTR_CPU_KERNEL("SfctrHostClear", HostClearOp);
SFCTR_CPU_KERNEL("SfctrStoreRelease", StoreReleaseOp);
SFCTR_CPU_KERNEL("SfctrHostPrune", HostPruneOp);
SFCTR_CPU_KERNEL("SfctrStoreRemove", StoreRemoveOp);
SFCTR_CPU_KERNEL("SfctrHostTakeRemoved", HostTakeRemovedOp);
SFCTR_CPU_KERNEL("SfctrHostPruneToSize", HostPruneToSizeOp);
SFCTR_CPU_KERNEL("SfctrHostUseCountHistogram", HostUseCountHistogramOp);
SFCTR_CPU_KERNEL("SfctrHostTiedIds", HostTiedIdsOp);
SFCTR_CPU_KERNEL("SfctrHostPruneBelow", HostPruneBelowOp);
SFCTR_CPU_KERNEL("SfctrHostSetSeed", HostSetSeedOp);
SFCTR_CPU_KERNEL("SfctrStoreStats", StoreStatsOp);
SFCTR_CPU_KERNEL("SfctrStoreSetCounters", StoreSetCountersOp);
SFCTR_CPU_KERNEL("SfctrHostDropFileRows", HostDropFileRowsOp);

}  // namespace
}  // namespace tensorflow
