// Deterministic row initialisation: the initial value of id `id` is a pure
// function of (seed, id, column), so it does not depend on batch order, on the
// cache state or on which rank creates the row. TF-free.
#ifndef TF_SFCTR_OPS_CORE_INITIALIZER_H_
#define TF_SFCTR_OPS_CORE_INITIALIZER_H_

#include <cstdint>
#include <string>

namespace sfctr {

enum class InitKind { kConstant, kUniform, kNormal, kTruncatedNormal };

struct InitializerSpec {
  InitKind kind = InitKind::kUniform;
  // kConstant: value = a.  kUniform: [a, b).  kNormal / kTruncatedNormal:
  // mean = a, stddev = b (truncated at two standard deviations, like Keras).
  float a = -0.05f;
  float b = 0.05f;
  uint64_t seed = 0;
};

// Parses "constant" | "uniform" | "normal" | "truncated_normal"; returns false
// for anything else.
bool ParseInitKind(const std::string& name, InitKind* kind);

class RowInitializer {
 public:
  explicit RowInitializer(const InitializerSpec& spec) : spec_(spec) {}
  // Writes `dim` floats for `id` into `out`.
  void Fill(int64_t id, int dim, float* out) const;
  const InitializerSpec& spec() const { return spec_; }
  void set_seed(uint64_t seed) { spec_.seed = seed; }

 private:
  InitializerSpec spec_;
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_INITIALIZER_H_
