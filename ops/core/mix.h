// 64-bit mixing functions shared by the host table, the initializer and the
// distributed owner function. TF-free.
#ifndef TF_SFCTR_OPS_CORE_MIX_H_
#define TF_SFCTR_OPS_CORE_MIX_H_

#include <cstdint>

namespace sfctr {

// The splitmix64 finalizer: a bijection on 64-bit words with good avalanche.
constexpr uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// The half of Mix2 that depends on its second word alone, for callers that
// combine one word with many small counters (an initializer's columns) and
// look these up instead of computing them again: Mix2(a, b) is
// Mix64(a ^ Mix2Second(b)).
constexpr uint64_t Mix2Second(uint64_t b) { return Mix64(b + 0x9e3779b97f4a7c15ULL); }

// Combines two words into one well-mixed word (order matters).
constexpr uint64_t Mix2(uint64_t a, uint64_t b) { return Mix64(a ^ Mix2Second(b)); }

// A uniform float in [0, 1) from the top 24 bits of a mixed word.
inline float UnitFloat(uint64_t bits) {
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_MIX_H_
