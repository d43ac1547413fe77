// Whether every element of a float array is finite. TF-free.
#ifndef TF_SFCTR_OPS_CORE_FINITE_H_
#define TF_SFCTR_OPS_CORE_FINITE_H_

#include <cstdint>

namespace sfctr {

// True when no element of x[0..n) is NaN or +-Inf and, with `squares`, no
// element's square overflows float32 either (|x| of about 2**64 or more).
// One pass, four lanes at a time: y - y is 0 for a finite y and NaN
// otherwise (y = x, or x * x), and a NaN survives every later addition.
bool AllFinite(const float* x, int64_t n, bool squares = false);

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_FINITE_H_
