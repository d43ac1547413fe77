// Adagrad on the rows of a table, one row per index. TF-free.
//
// For each i: a = acc[idx[i]], w = var[idx[i]], g = grad[i] (rows of `dim`
// floats):
//   a += s                     (s = grad_sq[i], or g * g when grad_sq is null)
//   w -= (lr * g) / (sqrt(a) + epsilon)
// in this order and with these roundings, which is what TF's
// ResourceSparseApplyAdagradV2 CPU kernel computes (checked bit for bit by
// tests/test_sparse_apply_adagrad_op.py), so the two are interchangeable.
//
// Why it exists: TF's kernel takes ~100 ns per 16-float row on one thread
// when the rows are scattered over a table larger than the caches (its loop
// waits on each row's cache misses in turn). This one prefetches the rows of
// the indices a few steps ahead and updates four lanes at a time with SSE;
// in index order (a repeated index is updated twice, in turn). The kernel
// splits wide rows by column ranges (AdagradColumns) over free pool threads.
#ifndef TF_SFCTR_OPS_CORE_ADAGRAD_H_
#define TF_SFCTR_OPS_CORE_ADAGRAD_H_

#include <cstdint>

namespace sfctr {

// Callers check 0 <= idx[i] < rows of var/acc.
void AdagradRows(float* var, float* acc, int64_t dim, const float* grad,
                 const float* grad_sq, const int32_t* idx, int64_t n, float lr,
                 float epsilon);

// The same on columns [begin, end) of every row only. Each element's updates
// depend only on that element, so shards of disjoint column ranges may run
// at once, also when an index repeats (each thread keeps index order).
void AdagradColumns(float* var, float* acc, int64_t dim, const float* grad,
                    const float* grad_sq, const int32_t* idx, int64_t n, float lr,
                    float epsilon, int64_t begin, int64_t end);

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_ADAGRAD_H_
