// CPU kernels of the training step that work on tensors and resource
// variables, not on a store: de-duplication (SfctrUnique), the backward's
// per-id sums, index and cache-row gathers, the gradient's finiteness check
// and the fused sparse Adagrad and FTRL updates. Each replaces a stock op
// measured slow inside a step on CPU (docs/design.md, "One training step");
// with a GPU visible the layer uses the stock ops instead.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/platform/threadpool.h"

#include "../core/adagrad.h"
#include "../core/dedup.h"
#include "../core/finite.h"
#include "../core/ftrl.h"
#include "../core/parallel.h"
#include "../core/segment_sum.h"
#include "kernel_util.h"

namespace tensorflow {
namespace {

// The variable behind resource input `input` as its creator named it
// ("user_table/cache_rows"), for an error that names the table: eager
// handles carry a "/<uid>" suffix, dropped here.
std::string VariableLabel(OpKernelContext* ctx, int input) {
  std::string name = HandleFromInput(ctx, input).name();
  const size_t slash = name.rfind('/');
  if (slash != std::string::npos && slash + 1 < name.size() &&
      name.find_first_not_of("0123456789", slash + 1) == std::string::npos) {
    name.resize(slash);
  }
  return name;
}

using sfctr_kernels::CatchOutOfMemory;
using sfctr_kernels::CheckFloatVariable;

class UniqueOp : public OpKernel {
 public:
  explicit UniqueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_groups", &num_groups_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("SfctrUnique takes at most 2^31 - 1 ids, got ", n));
    Tensor* inverse = nullptr;
    Tensor* sizes = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ids.shape(), &inverse));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_groups_}), &sizes));
    // One scratch table per thread, kept between batches (trimmed after a
    // huge one).
    thread_local sfctr::Deduplicator dedup;
    thread_local std::vector<int64_t> unique;
    const bool ran = CatchOutOfMemory(
        ctx, [n] { return "de-duplicating " + std::to_string(n) + " ids"; },
        [&] {
          dedup.Run(ids.flat<int64_t>().data(), n, num_groups_, &unique,
                    inverse->flat<int32_t>().data(), sizes->flat<int32_t>().data());
        });
    if (!ran) {  // give back what the scratch holds
      dedup.Trim(0);
      std::vector<int64_t>().swap(unique);
      return;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(unique.size())}), &out));
    std::copy(unique.begin(), unique.end(), out->flat<int64_t>().data());
    dedup.Trim(kKeptScratchBytes);
    if (unique.capacity() * sizeof(int64_t) > kKeptScratchBytes) {
      std::vector<int64_t>().swap(unique);
    }
  }

 private:
  // Per buffer (the table's scratch and the unique ids): batches up to ~1M ids
  // keep theirs.
  static constexpr size_t kKeptScratchBytes = size_t{16} << 20;
  int32_t num_groups_ = 1;
};

// Shards for `work` floats of work split over the intra-op pool: at most one
// per pool thread, `limit` and `max_shards`, each worth at least
// kMinWorkPerShard floats. max_shards 0 (the ops' default) means half the
// pool's threads, at least 1: inside a training step the step's other kernels
// run on the rest of the pool, and on this 2-core VM splitting over both
// threads made the step slower (docs/design.md, "Kernel shards"). RunShards
// gives a shard to a pool thread only if one is free, so a kernel inside a
// busy step does the work itself rather than wait for the pool.
constexpr int64_t kMinWorkPerShard = 1 << 18;

int64_t PoolShards(OpKernelContext* ctx, int64_t work, int64_t limit, int64_t max_shards) {
  thread::ThreadPool* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  const int64_t threads = pool == nullptr ? 1 : pool->NumThreads();
  const int64_t cap = max_shards > 0 ? max_shards : std::max<int64_t>(1, threads / 2);
  return std::max<int64_t>(1, std::min({threads, cap, work / kMinWorkPerShard, limit}));
}

// Reads the ops' max_shards attribute (0: automatic; negative is an error).
Status GetMaxShards(OpKernelConstruction* ctx, int64_t* max_shards) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("max_shards", max_shards));
  if (*max_shards < 0) {
    return errors::InvalidArgument("max_shards must be 0 (automatic) or positive, got ",
                                   *max_shards);
  }
  return OkStatus();
}

sfctr::Scheduler PoolScheduler(OpKernelContext* ctx) {
  thread::ThreadPool* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](std::function<void()> task) { pool->Schedule(std::move(task)); };
}

// sfctr::RunShards with shards - 1 helpers; its bookkeeping running out of
// memory (before any shard ran) fails the op.
template <typename Fn>
void RunKernelShards(OpKernelContext* ctx, const sfctr::Scheduler* schedule, int64_t shards,
                     const Fn& fn) {
  CatchOutOfMemory(
      ctx, [] { return std::string("splitting the work over the thread pool"); },
      [&] { sfctr::RunShards(schedule, shards, shards - 1, fn); });
}

// Runs read(var) on input 0, a float32 variable, holding its lock shared for
// the whole read, as TF's ResourceGather does: an update running beside it
// then never sees a second reference to the buffer and copies the table.
template <typename Read>
void ReadFloatVariable(OpKernelContext* ctx, const Read& read) {
  using CPUDevice = Eigen::ThreadPoolDevice;
  core::RefCountPtr<Var> var;
  OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
  // Before anything reads it as float (EnsureSparseVariableAccess may copy it
  // as float): these ops have no dtype attribute to guarantee it.
  OP_REQUIRES_OK(ctx, CheckFloatVariable(var.get(), "var"));
  OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, float>(ctx, var.get()));
  tf_shared_lock lock(*var->mu());
  read(*var->tensor());
}

// Where SegmentSumsOp reads its summed rows: the rows of data in order
// (SfctrSegmentSums), data[data_rows[i]] read in place
// (SfctrGatherSegmentSums), or var[data_rows[i]] from a float matrix
// variable read under its lock (SfctrVarSegmentSums).
enum class SumsOf { kRows, kGathered, kVariable };

template <SumsOf kSource>
class SegmentSumsOp : public OpKernel {
 public:
  explicit SegmentSumsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (kSource != SumsOf::kVariable) OP_REQUIRES_OK(ctx, ctx->GetAttr("squares", &squares_));
    OP_REQUIRES_OK(ctx, GetMaxShards(ctx, &max_shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    if (kSource != SumsOf::kVariable) {
      Sum(ctx, ctx->input(0));
      return;
    }
    ReadFloatVariable(ctx, [&](const Tensor& var) { Sum(ctx, var); });
  }

 private:
  void Sum(OpKernelContext* ctx, const Tensor& data) {
    constexpr bool kGathered = kSource != SumsOf::kRows;
    const char* data_name = kSource == SumsOf::kVariable ? "var" : "data";
    const Tensor& segments = ctx->input(kGathered ? 2 : 1);
    const Tensor& num_segments_t = ctx->input(kGathered ? 3 : 2);
    OP_REQUIRES(ctx, data.dims() == 2,
                errors::InvalidArgument(data_name, " must be a matrix [N, D], got shape ",
                                        data.shape().DebugString()));
    const int32_t* rows = nullptr;
    int64_t n = data.dim_size(0);
    if (kGathered) {
      const Tensor& data_rows = ctx->input(1);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(data_rows.shape()),
                  errors::InvalidArgument("data_rows must be a vector, got shape ",
                                          data_rows.shape().DebugString()));
      n = data_rows.dim_size(0);
      rows = data_rows.flat<int32_t>().data();
      const int64_t bad_row = sfctr::FirstBadSegment(rows, n, data.dim_size(0));
      OP_REQUIRES(ctx, bad_row < 0,
                  errors::InvalidArgument("data_rows[", bad_row, "] = ",
                                          bad_row < 0 ? 0 : rows[bad_row], " is not a row of ",
                                          data_name, " [0, ", data.dim_size(0), ")"));
    }
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(segments.shape()) && segments.dim_size(0) == n,
                errors::InvalidArgument(
                    "segment_ids must be a vector with one id per ",
                    kGathered ? "entry of data_rows (" : "row of data (", n, "), got shape ",
                    segments.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_segments_t.shape()),
                errors::InvalidArgument("num_segments must be a scalar, got shape ",
                                        num_segments_t.shape().DebugString()));
    const int64_t num_segments = num_segments_t.scalar<int32_t>()();
    OP_REQUIRES(ctx, num_segments >= 0,
                errors::InvalidArgument("num_segments must be >= 0, got ", num_segments));
    const int64_t dim = data.dim_size(1);
    const int32_t* seg = segments.flat<int32_t>().data();
    const int64_t bad = sfctr::FirstBadSegment(seg, n, num_segments);
    OP_REQUIRES(ctx, bad < 0,
                errors::InvalidArgument("segment_ids[", bad, "] = ", bad < 0 ? 0 : seg[bad],
                                        " is not in [0, ", num_segments, ")"));
    Tensor* sums = nullptr;
    Tensor* squares = nullptr;
    // Built with a status: num_segments is the caller's, and rows of data
    // with no elements can be of any width, so the product may overflow
    // (the TensorShape constructor would abort the process).
    TensorShape sums_shape;
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape({num_segments, dim}, &sums_shape));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, sums_shape, &sums));
    if (kSource != SumsOf::kVariable) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              1, squares_ ? sums_shape : TensorShape({0, dim}), &squares));
    }
    const float* in = data.flat<float>().data();
    float* out = sums->flat<float>().data();
    float* out_sq = squares_ ? squares->flat<float>().data() : nullptr;
    // Each shard owns a range of segments and scans all the segment ids:
    // shards are worth it only when the rows outweigh that scan.
    const int64_t shards = PoolShards(ctx, n * dim * (squares_ ? 2 : 1), num_segments,
                                      max_shards_);
    const int64_t per = (num_segments + shards - 1) / shards;
    const sfctr::Scheduler schedule = PoolScheduler(ctx);
    RunKernelShards(ctx, &schedule, shards, [&](int64_t s) {
      const int64_t begin = s * per;
      sfctr::SegmentSums(in, rows, seg, n, dim, begin, std::min(num_segments, begin + per), out,
                         out_sq);
    });
  }

  bool squares_ = false;
  int64_t max_shards_ = 0;
};

class GatherIndexOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& params = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(params.shape()),
                errors::InvalidArgument("params must be a vector, got shape ",
                                        params.shape().DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, indices.shape(), &out));
    const int32_t* p = params.flat<int32_t>().data();
    const int32_t* idx = indices.flat<int32_t>().data();
    int32_t* o = out->flat<int32_t>().data();
    const int64_t m = params.NumElements(), n = indices.NumElements();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t k = idx[i];
      OP_REQUIRES(ctx, k >= 0 && k < m,
                  errors::InvalidArgument("indices[", i, "] = ", k, " is not in [0, ", m, ")"));
      o[i] = p[k];
    }
  }
};

// The row of each value of a 2-D ragged tensor, from its row splits.
template <typename Split>
class RowIdsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& splits_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(splits_t.shape()) && splits_t.NumElements() > 0,
                errors::InvalidArgument("row_splits must be a vector of at least one split, "
                                        "got shape ", splits_t.shape().DebugString()));
    const Split* splits = splits_t.flat<Split>().data();
    const int64_t nrows = splits_t.NumElements() - 1;
    OP_REQUIRES(ctx, nrows <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument("a ragged tensor of ", nrows,
                                        " rows has row ids beyond int32"));
    const int64_t bad = sfctr::FirstBadSplit(splits, nrows);
    OP_REQUIRES(ctx, bad < 0,
                errors::InvalidArgument(
                    "row_splits must start at 0 and never decrease; row_splits[", bad,
                    "] = ", bad < 0 ? 0 : static_cast<int64_t>(splits[bad]),
                    bad > 0 ? " is below the split before it" : ""));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(splits[nrows])}), &out));
    sfctr::RowIdsFromSplits(splits, nrows, out->flat<int32_t>().data());
  }
};

// Whether two int64 tensors hold the same elements in order.
class IdsEqualOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    const int64_t n = a.NumElements();
    bool equal = n == b.NumElements();
    if (equal && n > 0) {
      equal = std::memcmp(a.flat<int64_t>().data(), b.flat<int64_t>().data(),
                          sizeof(int64_t) * n) == 0;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = equal;
  }
};

template <typename Index>
class FirstBadInverseOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const Tensor& unique = ctx->input(1);
    const Tensor& inverse = ctx->input(2);
    OP_REQUIRES(ctx, ids.NumElements() == inverse.NumElements(),
                errors::InvalidArgument("ids and inverse must have the same number of "
                                        "elements, got ", ids.NumElements(), " and ",
                                        inverse.NumElements()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = sfctr::FirstBadInverse(
        ids.flat<int64_t>().data(), unique.flat<int64_t>().data(), unique.NumElements(),
        inverse.flat<Index>().data(), ids.NumElements());
  }
};

class NonFiniteMarkerOp : public OpKernel {
 public:
  explicit NonFiniteMarkerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("squares", &squares_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    const bool finite =
        sfctr::AllFinite(x.flat<float>().data(), x.NumElements(), squares_);
    out->scalar<float>()() = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }

 private:
  bool squares_ = false;
};

// out = params[indices] for a float32 matrix and an int32 index vector, with
// the rows of the index 32 ahead prefetched; ranges of the output go to the
// intra-op pool when it is free and the gather is large.
void GatherMatrixRows(OpKernelContext* ctx, const Tensor& params, const Tensor& indices,
                      int64_t max_shards) {
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
              errors::InvalidArgument("indices must be a vector, got shape ",
                                      indices.shape().DebugString()));
  const int64_t rows = params.dim_size(0), dim = params.dim_size(1);
  const int64_t n = indices.NumElements();
  const int32_t* idx = indices.flat<int32_t>().data();
  for (int64_t i = 0; i < n; ++i) {
    OP_REQUIRES(ctx, idx[i] >= 0 && idx[i] < rows,
                errors::InvalidArgument("indices[", i, "] = ", idx[i], " is not in [0, ",
                                        rows, ")"));
  }
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
  const float* src = params.flat<float>().data();
  float* dst = out->flat<float>().data();
  // 32 rather than 8: the training step's forward gather (106k rows of a
  // 200k-row cache) measured 0.5-0.7 ms faster (docs/design.md).
  constexpr int64_t kAhead = 32;
  const int64_t shards = PoolShards(ctx, n * dim, n, max_shards);
  const int64_t per = (n + shards - 1) / shards;
  const sfctr::Scheduler schedule = PoolScheduler(ctx);
  RunKernelShards(ctx, &schedule, shards, [&](int64_t s) {
    const int64_t end = std::min(n, (s + 1) * per);
    for (int64_t i = s * per; i < end; ++i) {
      if (i + kAhead < end) {
        const float* ahead = src + static_cast<int64_t>(idx[i + kAhead]) * dim;
        for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(ahead + d);
      }
      std::memcpy(dst + i * dim, src + static_cast<int64_t>(idx[i]) * dim,
                  sizeof(float) * dim);
    }
  });
}

class GatherRowsOp : public OpKernel {
 public:
  explicit GatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxShards(ctx, &max_shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    ReadFloatVariable(ctx, [&](const Tensor& params) {
      OP_REQUIRES(ctx, params.dtype() == DT_FLOAT && params.dims() == 2,
                  errors::InvalidArgument("var must be a float32 matrix, got ",
                                          DataTypeString(params.dtype()), " ",
                                          params.shape().DebugString()));
      const Tensor& indices = ctx->input(1);
      GatherMatrixRows(ctx, params, indices, max_shards_);
    });
  }

 private:
  int64_t max_shards_ = 0;
};

// params[indices] for a float32 matrix tensor (rows an all-to-all returned).
class GatherTensorRowsOp : public OpKernel {
 public:
  explicit GatherTensorRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxShards(ctx, &max_shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& params = ctx->input(0);
    OP_REQUIRES(ctx, params.dims() == 2,
                errors::InvalidArgument("params must be a matrix, got shape ",
                                        params.shape().DebugString()));
    GatherMatrixRows(ctx, params, ctx->input(1), max_shards_);
  }

 private:
  int64_t max_shards_ = 0;
};

// Checks grad [n, dim], indices [n] within [0, rows) and grad_sq (grad's
// shape, or [0, 0] when absent: what the Python wrappers pass) of a sparse
// update; sets *has_sq. Every index is checked before any row changes.
Status CheckSparseUpdate(const Tensor& grad, const Tensor& indices, const Tensor& grad_sq,
                         int64_t rows, int64_t dim, bool* has_sq) {
  const int64_t n = indices.NumElements();
  if (!TensorShapeUtils::IsVector(indices.shape())) {
    return errors::InvalidArgument("indices must be a vector, got shape ",
                                   indices.shape().DebugString());
  }
  if (grad.dims() != 2 || grad.dim_size(0) != n || grad.dim_size(1) != dim) {
    return errors::InvalidArgument("grad must have shape [", n, ", ", dim, "], got ",
                                   grad.shape().DebugString());
  }
  *has_sq = grad_sq.shape() == grad.shape();
  if (!*has_sq && grad_sq.shape() != TensorShape({0, 0})) {
    return errors::InvalidArgument("grad_sq must have grad's shape ",
                                   grad.shape().DebugString(), " or be [0, 0] (absent), got ",
                                   grad_sq.shape().DebugString());
  }
  const int32_t* idx = indices.flat<int32_t>().data();
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= rows) {
      return errors::InvalidArgument("indices[", i, "] = ", idx[i], " is not in [0, ", rows,
                                     "); no row was changed");
    }
  }
  return OkStatus();
}

// Runs update(begin, end) over column ranges of the rows on free pool
// threads. Shards own ranges of whole cache lines (16 floats) of every row,
// so they never write one line from two threads; a repeated index keeps its
// order within each shard. `work` sizes the split (floats touched).
void RunColumnShards(OpKernelContext* ctx, int64_t dim, int64_t work, int64_t max_shards,
                     const std::function<void(int64_t, int64_t)>& update) {
  constexpr int64_t kLine = 16;
  const int64_t lines = (dim + kLine - 1) / kLine;
  const int64_t shards = PoolShards(ctx, work, lines, max_shards);
  const int64_t lines_per = (lines + shards - 1) / shards;
  const sfctr::Scheduler schedule = PoolScheduler(ctx);
  RunKernelShards(ctx, &schedule, shards, [&](int64_t s) {
    update(std::min(dim, s * lines_per * kLine), std::min(dim, (s + 1) * lines_per * kLine));
  });
}

// The variables are locked and readied for a sparse update the way TF's own
// ResourceSparseApply* kernels do it (training_op_helpers.h).
class SparseApplyAdagradOp : public OpKernel {
 public:
  explicit SparseApplyAdagradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxShards(ctx, &max_shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    using CPUDevice = Eigen::ThreadPoolDevice;
    for (int input : {0, 1}) {
      core::RefCountPtr<Var> v;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, input), &v));
      OP_REQUIRES_OK(ctx, CheckFloatVariable(v.get(), input == 0 ? "var" : "accum"));
    }
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1});
    Tensor var, accum;
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 0, /*lock_held=*/true, /*sparse=*/true, &var));
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 1, /*lock_held=*/true, /*sparse=*/true, &accum));
    OP_REQUIRES(ctx, var.IsInitialized() && accum.IsInitialized(),
                errors::FailedPrecondition("var and accum must be initialized"));
    OP_REQUIRES(ctx, var.dtype() == DT_FLOAT && accum.dtype() == DT_FLOAT,
                errors::InvalidArgument("var and accum must be float32"));
    OP_REQUIRES(ctx, var.dims() == 2 && var.shape() == accum.shape(),
                errors::InvalidArgument("var and accum must be matrices of one shape, got ",
                                        var.shape().DebugString(), " and ",
                                        accum.shape().DebugString()));
    const Tensor& lr = ctx->input(2);
    const Tensor& epsilon = ctx->input(3);
    const Tensor& grad = ctx->input(4);
    const Tensor& indices = ctx->input(5);
    const Tensor& grad_sq = ctx->input(6);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(lr.shape()) &&
                         TensorShapeUtils::IsScalar(epsilon.shape()),
                errors::InvalidArgument("lr and epsilon must be scalars"));
    const int64_t rows = var.dim_size(0), dim = var.dim_size(1);
    const int64_t n = indices.NumElements();
    bool has_sq = false;
    OP_REQUIRES_OK(ctx, CheckSparseUpdate(grad, indices, grad_sq, rows, dim, &has_sq));
    const int32_t* idx = indices.flat<int32_t>().data();
    float* w = var.flat<float>().data();
    float* a = accum.flat<float>().data();
    const float* g = grad.flat<float>().data();
    const float* g_sq = has_sq ? grad_sq.flat<float>().data() : nullptr;
    const float lr_v = lr.scalar<float>()(), eps_v = epsilon.scalar<float>()();
    RunColumnShards(ctx, dim, n * dim * (has_sq ? 4 : 3), max_shards_,
                    [&](int64_t begin, int64_t end) {
                      sfctr::AdagradColumns(w, a, dim, g, g_sq, idx, n, lr_v, eps_v, begin,
                                            end);
                    });
  }

 private:
  int64_t max_shards_ = 0;
};

// FTRL-Proximal on rows `indices` of var, accum and linear (sfctr::FtrlColumns);
// locked and checked like SparseApplyAdagradOp.
class SparseApplyFtrlOp : public OpKernel {
 public:
  explicit SparseApplyFtrlOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxShards(ctx, &max_shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    using CPUDevice = Eigen::ThreadPoolDevice;
    static const char* const kNames[] = {"var", "accum", "linear"};
    for (int input : {0, 1, 2}) {
      core::RefCountPtr<Var> v;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, input), &v));
      OP_REQUIRES_OK(ctx, CheckFloatVariable(v.get(), kNames[input]));
    }
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1, 2});
    Tensor vars[3];
    for (int input : {0, 1, 2}) {
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                              ctx, input, /*lock_held=*/true, /*sparse=*/true, &vars[input]));
      OP_REQUIRES(ctx, vars[input].IsInitialized() && vars[input].dtype() == DT_FLOAT,
                  errors::InvalidArgument(kNames[input], " must be an initialized float32 "
                                          "variable"));
    }
    OP_REQUIRES(ctx, vars[0].dims() == 2 && vars[0].shape() == vars[1].shape() &&
                         vars[0].shape() == vars[2].shape(),
                errors::InvalidArgument("var, accum and linear must be matrices of one "
                                        "shape, got ", vars[0].shape().DebugString(), ", ",
                                        vars[1].shape().DebugString(), " and ",
                                        vars[2].shape().DebugString()));
    sfctr::FtrlParams p;
    float* scalars[] = {&p.lr, &p.l1, &p.l2, &p.l2_shrinkage, &p.lr_power};
    for (int k = 0; k < 5; ++k) {
      const Tensor& t = ctx->input(3 + k);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(t.shape()),
                  errors::InvalidArgument("lr, l1, l2, l2_shrinkage and lr_power must be "
                                          "scalars"));
      *scalars[k] = t.scalar<float>()();
    }
    // The ranges ResourceSparseApplyFtrlV2 requires (the GPU path runs it):
    // the update divides by lr, so lr = 0 (a schedule decayed to zero) would
    // write NaN into the rows. Checked before any row changes; NaN fails too.
    OP_REQUIRES(ctx, p.lr > 0.0f,
                errors::InvalidArgument("FTRL's learning rate must be > 0, got ", p.lr,
                                        " (from the table optimizer's learning rate or "
                                        "its schedule; rows variable '",
                                        VariableLabel(ctx, 0), "'); no row was changed"));
    OP_REQUIRES(ctx, p.l1 >= 0.0f && p.l2 >= 0.0f && p.l2_shrinkage >= 0.0f,
                errors::InvalidArgument("FTRL's l1, l2 (with beta / (2 lr)) and "
                                        "l2_shrinkage must be >= 0, got ", p.l1, ", ", p.l2,
                                        " and ", p.l2_shrinkage, "; no row was changed"));
    OP_REQUIRES(ctx, p.lr_power <= 0.0f,
                errors::InvalidArgument("FTRL's learning_rate_power must be <= 0, got ",
                                        p.lr_power, "; no row was changed"));
    const Tensor& grad = ctx->input(8);
    const Tensor& indices = ctx->input(9);
    const Tensor& grad_sq = ctx->input(10);
    const int64_t rows = vars[0].dim_size(0), dim = vars[0].dim_size(1);
    const int64_t n = indices.NumElements();
    bool has_sq = false;
    OP_REQUIRES_OK(ctx, CheckSparseUpdate(grad, indices, grad_sq, rows, dim, &has_sq));
    const int32_t* idx = indices.flat<int32_t>().data();
    float* w = vars[0].flat<float>().data();
    float* a = vars[1].flat<float>().data();
    float* z = vars[2].flat<float>().data();
    const float* g = grad.flat<float>().data();
    const float* g_sq = has_sq ? grad_sq.flat<float>().data() : nullptr;
    RunColumnShards(ctx, dim, n * dim * (has_sq ? 5 : 4), max_shards_,
                    [&](int64_t begin, int64_t end) {
                      sfctr::FtrlColumns(w, a, z, dim, g, g_sq, idx, n, p, begin, end);
                    });
  }

 private:
  int64_t max_shards_ = 0;
};

#define SFCTR_CPU_KERNEL(name, cls) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU), cls)

SFCTR_CPU_KERNEL("SfctrUnique", UniqueOp);
SFCTR_CPU_KERNEL("SfctrSegmentSums", SegmentSumsOp<SumsOf::kRows>);
SFCTR_CPU_KERNEL("SfctrGatherSegmentSums", SegmentSumsOp<SumsOf::kGathered>);
SFCTR_CPU_KERNEL("SfctrVarSegmentSums", SegmentSumsOp<SumsOf::kVariable>);
SFCTR_CPU_KERNEL("SfctrGatherIndex", GatherIndexOp);
SFCTR_CPU_KERNEL("SfctrSparseApplyAdagrad", SparseApplyAdagradOp);
SFCTR_CPU_KERNEL("SfctrSparseApplyFtrl", SparseApplyFtrlOp);
SFCTR_CPU_KERNEL("SfctrNonFiniteMarker", NonFiniteMarkerOp);
SFCTR_CPU_KERNEL("SfctrGatherRows", GatherRowsOp);
SFCTR_CPU_KERNEL("SfctrGatherTensorRows", GatherTensorRowsOp);
SFCTR_CPU_KERNEL("SfctrIdsEqual", IdsEqualOp);
REGISTER_KERNEL_BUILDER(
    Name("SfctrRowIds").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tsplits"),
    RowIdsOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("SfctrRowIds").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tsplits"),
    RowIdsOp<int64_t>);
REGISTER_KERNEL_BUILDER(
    Name("SfctrFirstBadInverse").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tidx"),
    FirstBadInverseOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("SfctrFirstBadInverse").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tidx"),
    FirstBadInverseOp<int64_t>);

}  // namespace
}  // namespace tensorflow
