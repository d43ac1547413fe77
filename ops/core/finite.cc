#include "finite.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sfctr {
namespace {

template <bool kSquares>
bool AllFiniteImpl(const float* x, int64_t n) {
  int64_t i = 0;
  float rest = 0.0f;
#if defined(__SSE2__)
  __m128 acc0 = _mm_setzero_ps(), acc1 = _mm_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
    if (kSquares) {
      a = _mm_mul_ps(a, a);
      b = _mm_mul_ps(b, b);
    }
    acc0 = _mm_add_ps(acc0, _mm_sub_ps(a, a));
    acc1 = _mm_add_ps(acc1, _mm_sub_ps(b, b));
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_add_ps(acc0, acc1));
  rest = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) {
    const float y = kSquares ? x[i] * x[i] : x[i];  // (IEEE: y - y is not folded)
    rest += y - y;
  }
  return rest == 0.0f;  // false for NaN
}

}  // namespace

bool AllFinite(const float* x, int64_t n, bool squares) {
  return squares ? AllFiniteImpl<true>(x, n) : AllFiniteImpl<false>(x, n);
}

}  // namespace sfctr
