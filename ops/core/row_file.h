// Host-table rows in a file on a local disk (an SSD), mapped into memory.
// TF-free.
//
// A RowFile is one unnamed file in a directory the user names (created with
// O_TMPFILE, or created and unlinked at once where the file system lacks
// it), so nothing is left behind when the process ends, however it ends.
// The host table maps its large row blocks from it (MAP_SHARED) instead of
// from anonymous memory: the rows are then page cache, which the kernel
// writes to the disk and drops from memory when it needs the memory, and
// reads back on the next access. A table can so hold more rows than the
// machine has memory, as long as the rows a stretch of steps touches (the
// cache's misses and evictions) fit in what is left; the indexes, use
// counts and small blocks stay in memory. The kernel, not this code,
// decides which pages stay resident (least recently used, by page).
//
// Each mapping's disk space is reserved when it is made (posix_fallocate),
// so a full disk fails the allocation (DiskFull, a std::bad_alloc) instead
// of the process (a write to a mapped page that the disk cannot hold raises
// SIGBUS).
#ifndef TF_SFCTR_OPS_CORE_ROW_FILE_H_
#define TF_SFCTR_OPS_CORE_ROW_FILE_H_

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

namespace sfctr {

// The directory could not hold the row file (missing, not writable, not a
// directory...). what() names the directory and the system's reason.
class RowFileError : public std::runtime_error {
 public:
  explicit RowFileError(const std::string& message) : std::runtime_error(message) {}
};

// The disk under the row file has no room for more rows.
class DiskFull : public std::bad_alloc {
 public:
  const char* what() const noexcept override { return "no space left for the row file"; }
};

class RowFile {
 public:
  // Opens an unnamed file in `dir`. Throws RowFileError.
  static std::shared_ptr<RowFile> Open(const std::string& dir);
  ~RowFile();
  RowFile(const RowFile&) = delete;
  RowFile& operator=(const RowFile&) = delete;

  // Maps `bytes` (rounded up to whole pages) of new file space, read and
  // written as memory, initially zero. `*offset` receives its place in the
  // file, for Unmap. Throws DiskFull when the disk has no room for it and
  // std::bad_alloc when it cannot be mapped.
  void* Map(size_t bytes, uint64_t* offset);
  // Unmaps a range from Map and gives its disk space back.
  void Unmap(void* p, size_t bytes, uint64_t offset);

  // Writes every mapped page to the disk and drops it from memory (the
  // next access reads it back): what the kernel does under memory pressure,
  // on demand, for tests and benchmarks of rows that are not resident.
  void DropFromMemory();

  // Asks the kernel to start reading [offset, offset + bytes) of the file
  // into memory without waiting for it (POSIX_FADV_WILLNEED): many such
  // calls put many reads in flight, where touching the pages one by one
  // waits for each read in turn.
  void WillNeed(uint64_t offset, uint64_t bytes) const;

  // Is the page holding `p` (inside a mapping of this file) in memory?
  static bool Resident(const void* p);

  const std::string& dir() const { return dir_; }
  // Bytes of the file that are mapped now (the rows' disk space).
  uint64_t mapped_bytes() const;
  // Did the last Map fail for want of disk space?
  bool full() const { return full_.load(std::memory_order_relaxed); }

 private:
  RowFile(int fd, std::string dir) : fd_(fd), dir_(std::move(dir)) {}

  const int fd_;
  const std::string dir_;
  mutable std::mutex mu_;
  uint64_t end_ = 0;        // the next mapping starts here
  uint64_t mapped_ = 0;     // bytes mapped now
  std::map<uint64_t, std::pair<void*, uint64_t>> mappings_;  // offset -> (start, length)
  std::atomic<bool> full_{false};
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_ROW_FILE_H_
