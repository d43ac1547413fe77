// A tiny assertion harness for the core tests (no external test framework, so
// the core builds with nothing but a C++17 compiler).
#ifndef TF_SFCTR_OPS_CORE_TESTS_CHECK_H_
#define TF_SFCTR_OPS_CORE_TESTS_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace sfctr_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& Registry() {
  static std::vector<Case> cases;
  return cases;
}

struct Register {
  Register(const char* name, std::function<void()> fn) {
    Registry().push_back(Case{name, std::move(fn)});
  }
};

inline int& Failures() {
  static int failures = 0;
  return failures;
}

}  // namespace sfctr_test

#define SFCTR_CONCAT_(a, b) a##b
#define SFCTR_CONCAT(a, b) SFCTR_CONCAT_(a, b)
#define TEST_CASE(name)                                              \
  static void name();                                                \
  static sfctr_test::Register SFCTR_CONCAT(reg_, name)(#name, name); \
  static void name()

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                 \
      ++sfctr_test::Failures();                                            \
      return;                                                              \
    }                                                                      \
  } while (0)

#define CHECK_EQ(a, b) CHECK((a) == (b))

#endif  // TF_SFCTR_OPS_CORE_TESTS_CHECK_H_
