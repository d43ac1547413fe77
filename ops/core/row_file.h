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
//
// fork(): the mappings are not inherited (MADV_DONTFORK), so a child process
// can neither see nor change its parent's rows through them; a child that
// touches an inherited table crashes instead of corrupting the parent's. A
// RowFile used in another process than the one that opened it never changes
// the file (no new mappings, no holes, no truncation), so a child that exits
// or drops the table leaves the parent's rows alone.
#ifndef TF_SFCTR_OPS_CORE_ROW_FILE_H_
#define TF_SFCTR_OPS_CORE_ROW_FILE_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
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

// The disk under the row file has no room for more rows (or the file
// reached the largest size the file system or a limit allows).
class DiskFull : public std::bad_alloc {
 public:
  const char* what() const noexcept override { return "no space left for the row file"; }
};

// Is the exception being handled (inside a catch block) a DiskFull? For
// errors that must say whether memory or the disk ran out.
bool HandlingDiskFull();

class RowFile {
 public:
  // Opens an unnamed file in `dir`. Throws RowFileError.
  static std::shared_ptr<RowFile> Open(const std::string& dir);
  ~RowFile();
  RowFile(const RowFile&) = delete;
  RowFile& operator=(const RowFile&) = delete;

  // Maps `bytes` (rounded up to whole pages) of file space, read and
  // written as memory, initially zero. `*offset` receives its place in the
  // file, for Unmap. Throws DiskFull when the disk has no room for it and
  // std::bad_alloc when it cannot be mapped (or in a forked child).
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

  // Starts writing [offset, offset + bytes) to the disk without waiting
  // (sync_file_range): pages written once are then clean, so memory
  // pressure can drop them at once instead of waiting for the kernel's
  // periodic writeback (under a cgroup v1 memory limit, dirty file pages
  // cannot be reclaimed, and a growing table was killed by the limit).
  // Once more than kWritebackWindow bytes are being written (per file, so
  // per table), waits for the oldest ranges to reach the disk first: pages
  // under writeback cannot be reclaimed either, and a writer faster than
  // the disk (a restore) piled them up until a cgroup v1 limit killed it.
  // So a table grows at most at its disk's speed, a training step's new
  // rows too (the caller holds its shard's lock meanwhile).
  void StartWriteback(uint64_t offset, uint64_t bytes) const;
  static constexpr uint64_t kWritebackWindow = 16 << 20;

  // Is the page holding `p` (inside a mapping of this file) in memory?
  static bool Resident(const void* p);

  const std::string& dir() const { return dir_; }
  // Bytes of the file that are mapped now (the rows' disk space).
  uint64_t mapped_bytes() const;
  // The file's length: mapped ranges and holes kept for reuse.
  uint64_t length() const;
  // Bytes handed to StartWriteback and not waited for (at most
  // kWritebackWindow).
  uint64_t writing_bytes() const;
  // Bytes of ranges StartWriteback has waited for, in all.
  uint64_t waited_bytes() const;

 private:
  RowFile(int fd, std::string dir);
  // Called with mu_ held: is this the process that opened the file?
  bool Owner() const;

  const int fd_;
  const std::string dir_;
  const pid_t owner_;       // the process that opened the file
  const uint64_t page_;     // the system's page size
  mutable std::mutex mu_;
  uint64_t end_ = 0;        // the file's length: ranges past it are unused
  uint64_t mapped_ = 0;     // bytes mapped now
  std::map<uint64_t, std::pair<void*, uint64_t>> mappings_;  // offset -> (start, length)
  // Unmapped ranges (holes) by length -> offsets, reused by Map before the
  // file grows: a table cleared and refilled (a restore) takes the same
  // space again instead of growing the file.
  std::multimap<uint64_t, uint64_t> free_;
  // Ranges handed to StartWriteback whose writing has not been waited for,
  // oldest first, and their bytes.
  mutable std::mutex writeback_mu_;
  mutable std::deque<std::pair<uint64_t, uint64_t>> writing_;
  mutable uint64_t writing_bytes_ = 0;
  mutable uint64_t waited_bytes_ = 0;
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_ROW_FILE_H_
