#include "ftrl.h"

#include <algorithm>
#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sfctr {
namespace {

constexpr int64_t kAhead = 8;  // as in adagrad.cc

inline void PrefetchRow(const float* row, int64_t width) {
  for (int64_t d = 0; d < width; d += 16) __builtin_prefetch(row + d, 1);
}

// One row's columns [begin, end); kSqrt: lr_power is -0.5.
template <bool kSqrt>
inline void UpdateRow(float* w, float* a, float* z, const float* g, const float* s,
                      const FtrlParams& p, int64_t begin, int64_t end) {
  const float two_shrink = 2.0f * p.l2_shrinkage, two_l2 = 2.0f * p.l2;
  int64_t d = begin;
#if defined(__SSE2__)
  if (kSqrt) {  // four lanes, the same operations in the same order as below
    const __m128 vlr = _mm_set1_ps(p.lr), vl1 = _mm_set1_ps(p.l1),
                 vneg_l1 = _mm_set1_ps(-p.l1), vshrink = _mm_set1_ps(two_shrink),
                 vl2 = _mm_set1_ps(two_l2);
    for (; d + 4 <= end; d += 4) {
      const __m128 wv = _mm_loadu_ps(w + d), gv = _mm_loadu_ps(g + d),
                   nv = _mm_loadu_ps(a + d);
      const __m128 nn = _mm_add_ps(nv, s != nullptr ? _mm_loadu_ps(s + d) : _mm_mul_ps(gv, gv));
      const __m128 pn = _mm_sqrt_ps(nn), po = _mm_sqrt_ps(nv);
      const __m128 zv = _mm_sub_ps(
          _mm_add_ps(_mm_loadu_ps(z + d), _mm_add_ps(gv, _mm_mul_ps(vshrink, wv))),
          _mm_mul_ps(_mm_div_ps(_mm_sub_ps(pn, po), vlr), wv));
      _mm_storeu_ps(z + d, zv);
      const __m128 clipped = _mm_min_ps(_mm_max_ps(zv, vneg_l1), vl1);
      _mm_storeu_ps(w + d, _mm_div_ps(_mm_sub_ps(clipped, zv),
                                      _mm_add_ps(_mm_div_ps(pn, vlr), vl2)));
      _mm_storeu_ps(a + d, nn);
    }
  }
#endif
  for (; d < end; ++d) {
    const float wv = w[d], gv = g[d], nv = a[d];
    const float nn = nv + (s != nullptr ? s[d] : gv * gv);
    const float pn = kSqrt ? std::sqrt(nn) : std::pow(nn, -p.lr_power);
    const float po = kSqrt ? std::sqrt(nv) : std::pow(nv, -p.lr_power);
    const float zv = z[d] + (gv + two_shrink * wv) - (pn - po) / p.lr * wv;
    z[d] = zv;
    const float clipped = std::min(std::max(zv, -p.l1), p.l1);
    w[d] = (clipped - zv) / (pn / p.lr + two_l2);
    a[d] = nn;
  }
}

template <bool kSqrt>
void Columns(float* var, float* accum, float* linear, int64_t dim, const float* grad,
             const float* grad_sq, const int32_t* idx, int64_t n, const FtrlParams& p,
             int64_t begin, int64_t end) {
  const int64_t width = end - begin;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t ahead = static_cast<int64_t>(idx[i + kAhead]) * dim + begin;
      PrefetchRow(var + ahead, width);
      PrefetchRow(accum + ahead, width);
      PrefetchRow(linear + ahead, width);
    }
    const int64_t row = static_cast<int64_t>(idx[i]) * dim;
    UpdateRow<kSqrt>(var + row, accum + row, linear + row, grad + i * dim,
                     grad_sq != nullptr ? grad_sq + i * dim : nullptr, p, begin, end);
  }
}

}  // namespace

void FtrlColumns(float* var, float* accum, float* linear, int64_t dim, const float* grad,
                 const float* grad_sq, const int32_t* idx, int64_t n, const FtrlParams& p,
                 int64_t begin, int64_t end) {
  if (p.lr_power == -0.5f) {
    Columns<true>(var, accum, linear, dim, grad, grad_sq, idx, n, p, begin, end);
  } else {
    Columns<false>(var, accum, linear, dim, grad, grad_sq, idx, n, p, begin, end);
  }
}

}  // namespace sfctr
