// FTRL-Proximal on the rows of a table, one row per index. TF-free.
//
// For each i, with k = idx[i] and every element of the row (w = var, n =
// accum, z = linear; g = grad[i]; s = grad_sq[i], or g * g when grad_sq is
// null; p = lr_power; l2 already includes beta / (2 * lr)):
//   n' = n + s
//   z += (g + 2 * l2_shrinkage * w) - (n'^-p - n^-p) / lr * w
//   w  = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 * l2)
//   n  = n'
// (x^-p is sqrt(x) when p = -0.5), which is what TF's
// ResourceSparseApplyFtrlV2 computes with s = g * g.
//
// Why it exists: TF's CPU kernel walks the rows one at a time with Eigen
// expressions, waiting on each row's cache misses; on a step's 32k rows of
// 16 floats it took several times as long as the Adagrad update. This one
// prefetches the rows of the indices a few steps ahead. In index order (a
// repeated index is updated twice, in turn).
#ifndef TF_SFCTR_OPS_CORE_FTRL_H_
#define TF_SFCTR_OPS_CORE_FTRL_H_

#include <cstdint>

namespace sfctr {

struct FtrlParams {
  float lr;
  float l1;
  float l2;  // including beta / (2 * lr)
  float l2_shrinkage;
  float lr_power;
};

// Columns [begin, end) of every row; callers check 0 <= idx[i] < rows.
// Each element's update depends only on that element, so shards of
// disjoint column ranges may run at once.
void FtrlColumns(float* var, float* accum, float* linear, int64_t dim, const float* grad,
                 const float* grad_sq, const int32_t* idx, int64_t n, const FtrlParams& p,
                 int64_t begin, int64_t end);

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_FTRL_H_
