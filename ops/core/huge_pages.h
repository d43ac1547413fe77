// Allocation of large arrays on transparent huge pages. TF-free.
//
// The cache directory and the host table's indexes are accessed at random:
// with 4 KiB pages, an array of many MB misses the TLB on almost every
// access. Arrays of 2 MiB or more are aligned to 2 MiB and marked
// MADV_HUGEPAGE, so that the kernel backs them with huge pages when it can
// (THP "madvise" or "always"); elsewhere this is a plain allocation. Only for
// arrays that are written whole when allocated: a huge page is resident as
// soon as one byte of it is touched. (The host table's row blocks fill
// gradually, so they stay on normal pages: huge pages there measured 1.3x
// faster prepare at 1M rows but up to 1.5x the resident bytes per row.)
#ifndef TF_SFCTR_OPS_CORE_HUGE_PAGES_H_
#define TF_SFCTR_OPS_CORE_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

// Own mappings on Linux, except under AddressSanitizer: it cannot put
// redzones around an mmap, so there every array comes from malloc and an
// overrun of a large index is reported too (make test-core-sanitize).
#if defined(__linux__) && !defined(__SANITIZE_ADDRESS__)
#define SFCTR_OWN_MAPPINGS 1
#include <sys/mman.h>
#endif

namespace sfctr {

constexpr size_t kHugePage = size_t{2} << 20;
// From this size on, arrays get their own mapping, returned to the system
// when freed (malloc keeps freed blocks of a few hundred KB in its heap,
// which showed as ~15 B/row of resident memory in a growing host table).
constexpr size_t kOwnMapping = size_t{64} << 10;

// `bytes` rounded up to whole 4 KiB pages: a mapping's own length.
inline size_t WholePages(size_t bytes) { return (bytes + 4095) & ~size_t{4095}; }

// Memory for `bytes` bytes; free it with FreeLarge(p, bytes).
inline void* AllocateLarge(size_t bytes) {
#if defined(SFCTR_OWN_MAPPINGS)
  if (bytes >= kOwnMapping) {
    // munmap needs a page-aligned start: trim the tail after whole pages
    // (trimmed at p + bytes, it failed and left up to 2 MiB mapped).
    bytes = WholePages(bytes);
    const bool huge = bytes >= kHugePage;
    // A huge page needs a 2 MiB aligned range: map 2 MiB more, trim it.
    const size_t extra = huge ? kHugePage : 0;
    char* raw = static_cast<char*>(mmap(nullptr, bytes + extra, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (raw == MAP_FAILED) throw std::bad_alloc();
    char* p = raw;
    if (huge) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(raw);
      p = reinterpret_cast<char*>((a + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1));
      if (p > raw) munmap(raw, p - raw);
      const size_t tail = (raw + bytes + extra) - (p + bytes);
      if (tail > 0) munmap(p + bytes, tail);
#if defined(MADV_HUGEPAGE)
      madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
    }
    return p;
  }
#endif
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

inline void FreeLarge(void* p, size_t bytes) {
#if defined(SFCTR_OWN_MAPPINGS)
  if (bytes >= kOwnMapping) {
    munmap(p, WholePages(bytes));
    return;
  }
#else
  (void)bytes;
#endif
  std::free(p);
}

// A std::allocator for std::vector that uses AllocateLarge.
template <typename T>
struct LargeAllocator {
  using value_type = T;
  LargeAllocator() = default;
  template <typename U>
  LargeAllocator(const LargeAllocator<U>&) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(AllocateLarge(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { FreeLarge(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const LargeAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LargeAllocator<U>&) const { return false; }
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_HUGE_PAGES_H_
