#include "adagrad.h"

#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sfctr {
namespace {

// Rows this many indices ahead are prefetched: enough to keep several
// misses in flight, few enough that they are still cached when used.
constexpr int64_t kAhead = 8;

inline void PrefetchRow(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 1);
}

inline void UpdateScalar(float* w, float* a, float g, float s, float lr,
                         float epsilon) {
  *a += s;
  *w -= (lr * g) / (std::sqrt(*a) + epsilon);
}

}  // namespace

void AdagradColumns(float* var, float* acc, int64_t dim, const float* grad,
                    const float* grad_sq, const int32_t* idx, int64_t n, float lr,
                    float epsilon, int64_t begin, int64_t end) {
#if defined(__SSE2__)
  const __m128 vlr = _mm_set1_ps(lr);
  const __m128 veps = _mm_set1_ps(epsilon);
#endif
  const int64_t width = end - begin;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t ahead = idx[i + kAhead];
      PrefetchRow(var + ahead * dim + begin, width);
      PrefetchRow(acc + ahead * dim + begin, width);
    }
    float* w = var + static_cast<int64_t>(idx[i]) * dim;
    float* a = acc + static_cast<int64_t>(idx[i]) * dim;
    const float* g = grad + i * dim;
    const float* s = grad_sq != nullptr ? grad_sq + i * dim : nullptr;
    int64_t d = begin;
#if defined(__SSE2__)
    for (; d + 4 <= end; d += 4) {
      const __m128 gv = _mm_loadu_ps(g + d);
      const __m128 sv = s != nullptr ? _mm_loadu_ps(s + d) : _mm_mul_ps(gv, gv);
      const __m128 av = _mm_add_ps(_mm_loadu_ps(a + d), sv);
      _mm_storeu_ps(a + d, av);
      const __m128 den = _mm_add_ps(_mm_sqrt_ps(av), veps);
      _mm_storeu_ps(w + d, _mm_sub_ps(_mm_loadu_ps(w + d), _mm_div_ps(_mm_mul_ps(vlr, gv), den)));
    }
#endif
    for (; d < end; ++d) {
      UpdateScalar(w + d, a + d, g[d], s != nullptr ? s[d] : g[d] * g[d], lr, epsilon);
    }
  }
}

void AdagradRows(float* var, float* acc, int64_t dim, const float* grad,
                 const float* grad_sq, const int32_t* idx, int64_t n, float lr,
                 float epsilon) {
  AdagradColumns(var, acc, dim, grad, grad_sq, idx, n, lr, epsilon, 0, dim);
}

}  // namespace sfctr
