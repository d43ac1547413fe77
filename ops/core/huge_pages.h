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

#include <atomic>
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

// The tables' arrays (host table indexes, row blocks and use counts, the
// cache directory) are allocated through TrackAllocation, which counts their
// bytes and, for tests only, can refuse an allocation the way an exhausted
// system does (std::bad_alloc). Tests of the out-of-memory paths set `limit`
// or `countdown` (core tests directly; the op library from the test-only
// environment variable SFCTR_TEST_HOST_MEMORY_LIMIT, see store_kernels.cc).
// Nothing else sets them: unset, an allocation only adds to `live`.
struct AllocationHook {
  std::atomic<int64_t> live{0};       // bytes allocated here and not yet freed
  std::atomic<int64_t> limit{-1};     // refuse what would take `live` above this (-1: none)
  std::atomic<int64_t> countdown{-1};  // allocations that still succeed, then none (-1: off)
  std::atomic<int64_t> refused{0};    // allocations refused so far
};

inline AllocationHook& TestAllocationHook() {
  static AllocationHook hook;
  return hook;
}

// Counts `bytes` about to be allocated; throws std::bad_alloc if a test's
// limit refuses them.
inline void TrackAllocation(size_t bytes) {
  AllocationHook& h = TestAllocationHook();
  const int64_t b = static_cast<int64_t>(bytes);
  if (h.countdown.load(std::memory_order_relaxed) >= 0 &&
      h.countdown.fetch_sub(1, std::memory_order_relaxed) <= 0) {
    h.countdown.store(0, std::memory_order_relaxed);  // stays exhausted
    h.refused.fetch_add(1, std::memory_order_relaxed);
    throw std::bad_alloc();
  }
  const int64_t before = h.live.fetch_add(b, std::memory_order_relaxed);
  const int64_t limit = h.limit.load(std::memory_order_relaxed);
  if (limit >= 0 && before + b > limit) {
    h.live.fetch_sub(b, std::memory_order_relaxed);
    h.refused.fetch_add(1, std::memory_order_relaxed);
    throw std::bad_alloc();
  }
}

inline void UntrackAllocation(size_t bytes) {
  TestAllocationHook().live.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

// Heap memory for `bytes` bytes (counted); free it with FreeHeap(p, bytes).
inline void* AllocateHeap(size_t bytes) {
  TrackAllocation(bytes);
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) {
    UntrackAllocation(bytes);
    throw std::bad_alloc();
  }
  return p;
}

inline void FreeHeap(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::free(p);
  UntrackAllocation(bytes);
}

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
    TrackAllocation(bytes);
    char* raw = static_cast<char*>(mmap(nullptr, bytes + extra, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (raw == MAP_FAILED) {
      UntrackAllocation(bytes);
      throw std::bad_alloc();
    }
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
  return AllocateHeap(bytes);
}

inline void FreeLarge(void* p, size_t bytes) {
#if defined(SFCTR_OWN_MAPPINGS)
  if (bytes >= kOwnMapping) {
    munmap(p, WholePages(bytes));
    UntrackAllocation(WholePages(bytes));
    return;
  }
#endif
  FreeHeap(p, bytes);
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
