#include "initializer.h"

#include <cmath>

#include "mix.h"

namespace sfctr {

bool ParseInitKind(const std::string& name, InitKind* kind) {
  if (name == "constant") {
    *kind = InitKind::kConstant;
  } else if (name == "uniform") {
    *kind = InitKind::kUniform;
  } else if (name == "normal") {
    *kind = InitKind::kNormal;
  } else if (name == "truncated_normal") {
    *kind = InitKind::kTruncatedNormal;
  } else {
    return false;
  }
  return true;
}

namespace {

// One standard normal sample from a stream position (Box-Muller on two
// independent uniforms derived from the position).
float StandardNormal(uint64_t base, uint64_t counter) {
  const uint64_t h1 = Mix2(base, 2 * counter);
  const uint64_t h2 = Mix2(base, 2 * counter + 1);
  // u1 in (0, 1] so log(u1) is finite.
  const double u1 = (static_cast<double>(h1 >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  const double u2 = static_cast<double>(h2 >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) *
                            std::cos(6.283185307179586 * u2));
}

}  // namespace

void RowInitializer::Fill(int64_t id, int dim, float* out) const {
  const uint64_t base = Mix2(spec_.seed, static_cast<uint64_t>(id));
  switch (spec_.kind) {
    case InitKind::kConstant:
      for (int j = 0; j < dim; ++j) out[j] = spec_.a;
      return;
    case InitKind::kUniform: {
      const float span = spec_.b - spec_.a;
      for (int j = 0; j < dim; ++j) {
        out[j] = spec_.a + span * UnitFloat(Mix2(base, j));
      }
      return;
    }
    case InitKind::kNormal:
      for (int j = 0; j < dim; ++j) {
        out[j] = spec_.a + spec_.b * StandardNormal(base, j);
      }
      return;
    case InitKind::kTruncatedNormal:
      for (int j = 0; j < dim; ++j) {
        // Resample until within two standard deviations; each column draws
        // from its own counter range so columns stay independent.
        float z = 0.0f;
        for (uint64_t k = 0;; ++k) {
          z = StandardNormal(base, (static_cast<uint64_t>(j) << 20) + k);
          if (std::fabs(z) <= 2.0f) break;
        }
        out[j] = spec_.a + spec_.b * z;
      }
      return;
  }
}

}  // namespace sfctr
