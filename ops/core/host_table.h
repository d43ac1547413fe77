// The host-memory embedding table: int64 id -> one row of `dim` floats plus
// `num_state` optimizer-state rows of `dim` floats each, stored contiguously.
//
// Layout (see docs/design.md, "Host table"): the table is split into lock
// stripes (shards) chosen by a mix of the id. Each shard has an
// open-addressing index of 12-byte entries {id, row number}, grown by 3/2
// while small and by about 5/4 past 4096 entries (so it is at least 54%, once
// large about 65%, full), and an arena of row blocks whose size
// grows geometrically, with 4 bytes per row beside them (a 16-bit use
// counter and a "changed" flag, RowMeta), so rows
// never move when the index grows and a small table stays small. TF-free.
#ifndef TF_SFCTR_OPS_CORE_HOST_TABLE_H_
#define TF_SFCTR_OPS_CORE_HOST_TABLE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "parallel.h"

#include "huge_pages.h"
#include "initializer.h"
#include "row_file.h"
#include "status.h"

namespace sfctr {

struct HostTableOptions {
  int dim = 8;
  int num_state = 0;               // optimizer state rows per id
  std::vector<float> state_init;   // one value per state row (size num_state)
  InitializerSpec init;
  int64_t max_rows = 0;            // 0: unbounded
  // Rows the table is expected to hold (0: no estimate). The indexes are
  // sized for them up front (the constructor throws std::bad_alloc when that
  // memory is not there) and again after Clear() (skipped then if it is
  // not), so that filling the table does not rehash them step by step. Not
  // a limit.
  int64_t expected_rows = 0;
  // With expected_rows: also allocate the row memory of each shard's share
  // up front and write one byte per page of it, so that inserting those
  // rows later never waits for the OS to hand out fresh pages (a first
  // touch costs ~2-13 us per 4 KiB page on the VMs measured; docs/design.md,
  // "Host table", reserve_rows). The memory is held even if fewer ids arrive.
  bool reserve_rows = false;
  int num_shards = 64;             // lock stripes; rounded up to a power of 2
  std::string name;                // names the table in errors (may be empty)
  // A directory on a local disk: when set, the row blocks of 64 KiB and more
  // live in an unnamed file there, mapped into memory (row_file.h), so the
  // kernel can page rows out to the disk. The constructor throws
  // RowFileError when the directory cannot hold the file.
  std::string rows_dir;
};

class HostTable {
 public:
  explicit HostTable(const HostTableOptions& options);
  HostTable(const HostTable&) = delete;
  HostTable& operator=(const HostTable&) = delete;

  int dim() const { return options_.dim; }
  int num_state() const { return options_.num_state; }
  // Floats per stored row: the value and its optimizer state.
  int width() const { return width_; }
  int64_t max_rows() const { return options_.max_rows; }
  const std::string& name() const { return options_.name; }
  // "host table 'name'", or "the host table" without a name: for errors.
  static std::string Describe(const std::string& name) {
    return name.empty() ? std::string("the host table") : "host table '" + name + "'";
  }
  std::string Describe() const { return Describe(options_.name); }
  int64_t size() const { return size_.load(std::memory_order_relaxed); }

  // Writes the initial full-width row (value from the initializer, state
  // from state_init) of `id` into `out`.
  void InitialRow(int64_t id, float* out) const;

  // Copies the stored full-width rows of `ids` into `out` (n x width); ids not
  // present get their initial row and are not inserted. With `values_only`,
  // only each row's value (n x dim), without its optimizer state. With a
  // scheduler, a large read (kParallelFindIds ids or more) runs its shards
  // on up to `threads` threads (computing initial rows of unseen ids, and
  // the index misses of random ids, are per-id work that parallelizes).
  void Find(const int64_t* ids, int64_t n, float* out, bool values_only = false,
            const Scheduler* schedule = nullptr, int threads = 1) const;
  static constexpr int64_t kParallelFindIds = 8192;

  // Number of distinct ids among `ids` that are not stored (duplicates in
  // `ids` counted once).
  int64_t CountMissing(const int64_t* ids, int64_t n) const;

  // Reserves room for `rows` new rows against max_rows. Fails, changing
  // nothing, when the table would exceed its limit. A successful reservation
  // must be handed to exactly one of the *Reserved calls below.
  CoreStatus Reserve(int64_t rows);
  void Release(int64_t rows);

  // Like Find, but inserts missing ids with their initial row. `reserved` rows
  // must have been reserved; unused reservations are released. If given,
  // `use_counts` receives each id's use counter (0 for new ids).
  // If given, `handles` receives where each id's row lives (see WriteRows).
  // Out of host memory, fails (ResourceExhausted) part-way: the ids inserted
  // until then stay, with their initial rows, counted in size(); the outputs
  // of the others are not filled. It does not hold off Prune, Remove or
  // Clear (Write does): a caller counting missing ids, reserving and
  // inserting must not run those in between, or the reservation no longer
  // matches (EmbeddingStore::Prepare holds its lock, which they take too).
  CoreStatus FindOrInsertReserved(const int64_t* ids, int64_t n, float* out,
                                  int64_t reserved, uint32_t* use_counts = nullptr,
                                  uint64_t* handles = nullptr);

  // A row's place in the table: never 0, valid until Clear() (rows never
  // move). Writing by handle skips hashing and the index probe.
  static uint64_t MakeHandle(uint64_t shard, uint32_t row) {
    return (shard << 32 | row) + 1;
  }
  // Changed flags: a row is flagged when it is inserted and whenever it is
  // written with new values (see each writer), and ExportRange with
  // `changed_only` returns the flagged rows and clears their flags: the
  // rows changed since the previous such export.
  //
  // Stores full-width rows at handles from FindOrInsertReserved, adding
  // add_counts (if given) to their use counters. A row is flagged changed
  // unless its add_count is 0 (an evicted row no step used since it was
  // last written back holds what the host row holds).
  void WriteRows(const uint64_t* handles, int64_t n, const float* rows,
                 const uint32_t* add_counts = nullptr);

  // Stores full-width rows (value and state), inserting missing ids. If
  // given, add_counts[i] is added to the use counter of ids[i] on the way
  // (the cache hands back the uses of evicted rows with their values).
  // Rows are flagged changed when `mark_changed`, except those whose
  // add_count is 0 (the library always flags: evictions and a flush's
  // write-back of dirty rows alike).
  // Fails (ResourceExhausted), changing nothing, past max_rows. Out of host
  // memory, fails part-way: each row is then either stored whole or
  // unchanged, size() counts exactly the ids inserted, and repeating the
  // call stores the rest.
  CoreStatus Write(const int64_t* ids, int64_t n, const float* rows,
                   const uint32_t* add_counts = nullptr, bool mark_changed = true);

  // Sets the value part of rows (n x dim) and resets their optimizer state to
  // state_init, inserting missing ids.
  CoreStatus AssignValues(const int64_t* ids, int64_t n, const float* values);

  // Adds counts[i] to the use counter of ids[i] (no-op for an id not
  // stored); use counters saturate at 65535. With `mark_changed`, the rows
  // whose count is above 0 are flagged changed too.
  void AddUseCounts(const int64_t* ids, int64_t n, const uint32_t* counts,
                    bool mark_changed = false);
  // Flags a stored id's row changed (no-op if absent). Allocates nothing.
  void MarkChanged(int64_t id);

  // Snapshot of every stored row, in no particular order.
  void Export(std::vector<int64_t>* ids, std::vector<float>* rows,
              std::vector<uint32_t>* counts) const;

  // Same, written into caller buffers sized by `allocate(n)`, which is
  // called once with the exact row count while every shard is locked. With
  // 0 < columns < width(), only each row's first `columns` floats (the
  // embedding without its optimizer state) are written, `columns` apart.
  template <typename Allocate>
  void ExportTo(Allocate allocate, int64_t columns = -1) const;

  // A part of the table, for saving it a chunk at a time (tables larger than
  // memory): appends to `ids`, `rows` (whole rows, width() floats each) and
  // `counts` the stored rows from position `*cursor` on, up to `max_rows`
  // of them, and advances `*cursor` past them. A cursor starts at 0 and is
  // kNoMoreRows once every row was returned. Locks one shard at a time: the
  // parts add up to the table only if nothing inserts, removes or clears
  // rows between the calls (rows written in between are returned as they
  // are when their part is read). Keeps a map of one shard's row ids
  // between calls (8 bytes per row of that shard). With `changed_only`,
  // returns only the rows flagged changed, of the `max_rows` it passes, and
  // clears their flags (a row written again later is flagged again). The
  // flags are cleared only once the part is handed over: while it is read
  // they are marked as being exported, and an exception (std::bad_alloc)
  // or a `deliver` that returns false (the caller could not take the part)
  // flags them changed again, so that no later delta misses them; the
  // cursor then does not move.
  static constexpr uint64_t kNoMoreRows = ~uint64_t{0};
  void ExportRange(uint64_t* cursor, int64_t max_rows, std::vector<int64_t>* ids,
                   std::vector<float>* rows, std::vector<int64_t>* counts,
                   bool changed_only = false,
                   const std::function<bool()>& deliver = nullptr) const;

  // Removes every stored id whose use counter is below `min_count`, except
  // the ids in `keep`; returns how many were removed. Out of memory
  // (std::bad_alloc, from its scratch lists) it stops with each shard
  // pruned or untouched and size() right. Their rows go to a
  // free list that later inserts take first (memory is reused, not given
  // back), and their handles become invalid. A removed id that comes back
  // starts from its initial row, as if never seen.
  // With `decay` below 1, every id that stays (kept ones too) then has its
  // use counter multiplied by `decay` and rounded down, so that counts
  // weigh recent uses more (an id no step uses again falls to 0: any count
  // c >= 1 becomes at most c - 1). The row is not flagged changed.
  int64_t Prune(uint32_t min_count, const std::unordered_set<int64_t>& keep,
                double decay = 1.0);

  // Removes the given ids (those stored; repeats and absent ids are
  // skipped); returns how many were removed. Like Prune, their rows go to
  // the free list and their handles become invalid; unlike it, only the
  // shards of `ids` are visited and their indexes are not rebuilt (each
  // entry is deleted in place). Out of memory (std::bad_alloc, before any
  // shard changed) it removes nothing.
  int64_t Remove(const int64_t* ids, int64_t n);

  // Removes the least used ids, except those in `keep`, until at most
  // `max_rows` rows remain (or only kept ones); returns how many were
  // removed. Ids of equal use count go in the order of their values, so
  // tables holding the same ids and counts (data-parallel replicas) remove
  // the same ids. `*min_count` gets the use count of the most used id
  // removed plus one (0 if none was). `decay` as for Prune, after the
  // removal (the ids that go are chosen by the counts before it).
  int64_t PruneToSize(int64_t max_rows, const std::unordered_set<int64_t>& keep,
                      uint32_t* min_count, double decay = 1.0);

  // PruneToSize in parts, for a table sharded over processes that bounds
  // their total (each part takes its own locks; nothing else may write the
  // table between them for the parts to agree):
  // UseCountHistogram gives the rows held (kept ones too) and, per use
  // count c (0..65535), how many ids not in `keep` have it;
  std::vector<int64_t> UseCountHistogram(const std::unordered_set<int64_t>& keep,
                                         int64_t* held) const;
  // TiedIds the ids not in `keep` used exactly `count` times, ascending;
  std::vector<int64_t> TiedIds(uint32_t count, const std::unordered_set<int64_t>& keep) const;
  // PruneBelow removes the ids not in `keep` used fewer than `below` times,
  // and, with `has_last`, those used exactly `below` times whose value is
  // at most `last`; returns how many went. `decay` as for Prune.
  int64_t PruneBelow(uint32_t below, bool has_last, int64_t last,
                     const std::unordered_set<int64_t>& keep, double decay = 1.0);

  // Removes every row.
  void Clear();

  // Frees everything the table holds, for good: every row, the indexes
  // (with expected_rows too) and the row file (its descriptor and disk
  // space). Only for a table nothing uses any more: a later write would
  // grow indexes from nothing, in memory.
  void Release();

  // The ids removed (Prune, PruneToSize, Remove) since the previous call,
  // except those stored again since, in ascending order, for following the
  // table from outside (a serving store kept up to date with
  // ExportRange(changed_only) deltas, which cannot show removals). Returns
  // true when that list is complete. The table keeps the list only between
  // calls: before the first call, after a Clear, and when the list could
  // not get memory, removals are not logged, and the call returns false
  // with `removed` empty; it then flags every stored row changed, so that
  // the next changed_only export is the whole table (a follower rebuilds
  // from it), and logs removals from then on. Holds every shard, like
  // Prune. Logging never makes a removal fail. With `deliver`, the list is
  // dropped only if deliver(*removed) returns true (the caller could hand
  // it on; else the next call returns it again, with any later removals).
  bool TakeRemoved(std::vector<int64_t>* removed,
                   const std::function<bool(const std::vector<int64_t>&)>& deliver = nullptr);

  // Changes the seed of the initializer (when restoring a checkpoint, before
  // any row is created; not synchronised with concurrent readers).
  void SetInitSeed(uint64_t seed);

  // Bytes held by indexes and arenas (allocated capacity, not payload).
  size_t AllocatedBytes() const;
  // Of those, the row blocks mapped from the row file (0 without rows_dir):
  // page cache the kernel can write out and drop, not anonymous memory.
  size_t FileBytes() const { return row_file_ ? row_file_->mapped_bytes() : 0; }
  const std::string& rows_dir() const { return options_.rows_dir; }
  // The row file's length (0 without rows_dir): what its mapped blocks and
  // the holes kept for reuse span.
  size_t RowFileLength() const { return row_file_ ? row_file_->length() : 0; }
  // Bytes of new rows handed to the disk and not yet waited for.
  size_t RowFileWriting() const { return row_file_ ? row_file_->writing_bytes() : 0; }
  size_t RowFileWaited() const { return row_file_ ? row_file_->waited_bytes() : 0; }
  // With rows_dir: is the page of any of a few rows of `ids` (up to 8,
  // spread over them) on the disk, not in memory? Reads of rows on disk are
  // then started together (POSIX_FADV_WILLNEED) before they are copied, as
  // they are whenever the previous batch read was slow. False without
  // rows_dir.
  bool SampledRowsOnDisk(const int64_t* ids, int64_t n) const;
  // With rows_dir: writes the rows on file out and drops them from memory
  // (RowFile::DropFromMemory). Not synchronised with writers.
  void DropFileRowsFromMemory() {
    if (row_file_) row_file_->DropFromMemory();
  }

  // Index capacity (entries) of each shard.
  std::vector<size_t> IndexEntries() const;

  // The error of a call that ran out of host memory: the table's size and
  // memory, what the call did (`outcome`) and what to do about it.
  CoreStatus OutOfMemory(const std::string& outcome) const;

 private:
#pragma pack(push, 4)
  struct Entry {  // 12 bytes
    int64_t id;
    uint32_t row;  // kEmptyRow marks an empty entry
  };
#pragma pack(pop)
  static constexpr uint32_t kEmptyRow = 0xffffffffu;
  static constexpr uint32_t kMaxCount = 0xffffu;

  // What a row has beside its floats.
  struct RowMeta {
    uint16_t count;    // steps that used the id (saturating)
    uint16_t changed;  // kChanged, kExporting (in a changed_only part being read) or 0
  };
  static constexpr uint16_t kChanged = 1, kExporting = 2;
  // After a changed_only part: its rows (shard << 32 | row, marked
  // kExporting) become unflagged if `delivered`, else flagged changed
  // again; a row a writer flagged meanwhile stays flagged.
  void SettleExported(const std::vector<uint64_t>& marked, bool delivered) const;
  // ExportRange's reading: appends the part and marks its changed_only rows
  // kExporting, listing them in `marked`.
  void ExportRangeLocked(uint64_t* cursor, int64_t max_rows, std::vector<int64_t>* ids,
                         std::vector<float>* rows, std::vector<int64_t>* counts,
                         bool changed_only, std::vector<uint64_t>* marked) const;

  // Row blocks: the largest (capped) blocks are mapped on huge pages, see
  // AddBlockLocked; the others, and the use counts, come from the heap.
  struct BlockDeleter {
    size_t bytes = 0;
    bool large = false;  // from AllocateLarge, else AllocateHeap (or the file)
    std::shared_ptr<RowFile> file;  // mapped from this file at `offset`
    uint64_t offset = 0;
    void operator()(void* p) const {
      if (file) {
        file->Unmap(p, bytes, offset);
      } else if (large) {
        FreeLarge(p, bytes);
      } else {
        FreeHeap(p, bytes);
      }
    }
  };

  struct Shard {
    mutable std::mutex mu;
    std::vector<Entry, LargeAllocator<Entry>> entries;  // any size
    uint32_t used = 0;                          // occupied entries
    std::vector<std::unique_ptr<float[], BlockDeleter>> blocks;
    std::vector<std::unique_ptr<RowMeta[], BlockDeleter>> meta_blocks;  // one per row block
    uint32_t rows = 0;                          // rows handed out from arena
    std::vector<uint32_t> free_rows;            // arena rows of pruned ids
    uint64_t generation = 0;  // bumped by every insert, prune and clear
    std::vector<int64_t> removed;  // ids removed since TakeRemoved (if logging)
  };
  // Makes room in the shard's removal log for n more ids (if logging;
  // prune_mu_ held unique), so that logging them cannot throw. Without the
  // memory, logging stops (TakeRemoved then reports the list incomplete)
  // instead of the removal failing.
  void ReserveRemovalLogLocked(Shard& s, size_t n);
  void StopLoggingRemovalsLocked();
  // Clear and Release: drops every row and index (prune_mu_ held).
  void DropAllLocked();
  // UseCountHistogram and TiedIds (unsorted; `expected` ids reserved)
  // with prune_mu_ held by the caller.
  std::vector<int64_t> UseCountHistogramLocked(const std::unordered_set<int64_t>& keep,
                                               int64_t* held) const;
  std::vector<int64_t> TiedIdsLocked(uint32_t count, const std::unordered_set<int64_t>& keep,
                                     size_t expected) const;

  // The shard takes the hash's low bits, the index position its high bits
  // (HomeOf), so that the two are independent.
  uint64_t ShardIndex(uint64_t hash) const { return hash & shard_mask_; }
  static uint64_t HomeOf(uint64_t hash, uint64_t size) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(hash) * size) >> 64);
  }
  RowMeta& MetaOf(const Shard& s, uint32_t row) const;
  uint16_t& CountOf(const Shard& s, uint32_t row) const { return MetaOf(s, row).count; }
  // Prune's work, prune_mu_ held by the caller: removes the ids, not in
  // `keep`, for which remove(use count, id) is true.
  template <typename ShouldGo>
  int64_t PruneLocked(ShouldGo remove, const std::unordered_set<int64_t>& keep,
                      double decay);
  void AddSaturating(const Shard& s, uint32_t row, uint32_t count) const;
  // With a row file, while rows_on_disk_: asks the kernel to start reading
  // the pages of the rows of `ids` that the table holds (RowFile::WillNeed),
  // so that the reads of a batch's rows overlap. Locks each shard.
  void AdviseReads(const int64_t* ids, int64_t n) const;
  // The same for one row, its shard locked by the caller.
  void AdviseRowLocked(const Shard& s, uint32_t row) const;
  // After a batch read of n rows that took `seconds`: were its rows read
  // from the disk (far slower per row than from memory)? Sets rows_on_disk_.
  void NoteReadTime(int64_t n, double seconds) const;
  // Deletes `id`'s index entry (backward shift: later entries of its probe
  // run move back, so lookups need no tombstones) and puts its row on the
  // free list, which must have room for it. Caller holds the shard lock.
  bool EraseLocked(Shard& s, int64_t id, uint64_t hash);
  // Returns the entry of `id` or nullptr. Caller holds the shard lock.
  Entry* Locate(Shard& s, int64_t id, uint64_t hash) const;
  // Inserts `id` (must be absent) with a fresh arena row; returns its entry.
  Entry* InsertLocked(Shard& s, int64_t id, uint64_t hash) const;
  // Grows the index (by 3/2 while small, to the shard's next grid size once
  // large; more if needed) so that `want` entries fit under the maximum load.
  // Without the memory (std::bad_alloc) the shard keeps its index.
  void GrowLocked(Shard& s, uint64_t want) const;
  // Sizes an empty shard's index for its share of expected_rows.
  void PresizeLocked(Shard& s) const;
  float* RowPtr(const Shard& s, uint32_t row) const;
  float* AllocateRowLocked(Shard& s) const;
  // Appends the shard's next row block (and its use counts).
  void AddBlockLocked(Shard& s) const;
  // Allocates and touches the row blocks of an empty shard's share of
  // expected_rows (reserve_rows).
  void ReserveRowsLocked(Shard& s, uint64_t rows) const;
  // Calls fn(i, shard, hash) for every i < n, with the shard of ids[i]
  // locked. Ids are visited shard by shard (one lock per shard, not per id)
  // and the index entries of upcoming ids are prefetched: a batch of random
  // ids is bound by memory latency, and this keeps several misses in flight.
  // before_shard(shard, count) runs once per shard, locked, before its ids.
  // With a scheduler and parts > 1, ranges of shards run as that many
  // parts, concurrently (fn must then be safe for distinct ids' shards).
  template <typename Fn, typename BeforeShard>
  void ForEachByShard(const int64_t* ids, int64_t n, Fn fn, BeforeShard before_shard,
                      const Scheduler* schedule = nullptr, int parts = 1) const;
  template <typename Fn>
  void ForEachByShard(const int64_t* ids, int64_t n, Fn fn) const {
    ForEachByShard(ids, n, fn, [](Shard&, uint32_t) {});
  }

  HostTableOptions options_;
  std::shared_ptr<RowFile> row_file_;  // with rows_dir; the blocks share it
  // The last batch read from the row file was slow per row: its pages were
  // on the disk, and so, likely, are the next batch's (AdviseReads).
  mutable std::atomic<bool> rows_on_disk_{false};
  RowInitializer initializer_;
  int width_;
  std::unique_ptr<Shard[]> shards_;
  uint64_t shard_mask_;
  std::atomic<int64_t> size_{0};
  std::atomic<int64_t> reserved_{0};  // rows stored or reserved
  // Write counts the ids it will insert, reserves room for them and then
  // inserts: Prune and Clear must not remove rows in between (shared:
  // writers, unique: Prune and Clear).
  mutable std::shared_mutex prune_mu_;
  // Removals are logged per shard (Shard::removed) from the first
  // TakeRemoved on, until a Clear (guarded by prune_mu_ held unique).
  bool log_removals_ = false;
  // ExportRange's map from the arena rows of one shard to their ids, built
  // with one scan of the shard's index and kept for the shard's next parts
  // (rebuilding it for every part made a save quadratic in a shard's size).
  // Rebuilt when a part starts a shard, or when the shard's ids changed
  // since (its generation).
  struct ExportMap {
    uint64_t shard = ~uint64_t{0};
    uint64_t generation = 0;
    std::vector<int64_t> ids;    // per arena row
    std::vector<uint8_t> held;   // 0: the row of a pruned id
  };
  mutable std::mutex export_mu_;
  mutable ExportMap export_map_;
};

template <typename Allocate>
void HostTable::ExportTo(Allocate allocate, int64_t columns) const {
  const int64_t cols = (columns > 0 && columns < width_) ? columns : width_;
  const uint64_t num_shards = shard_mask_ + 1;
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(num_shards);
  uint64_t total = 0;
  for (uint64_t k = 0; k < num_shards; ++k) {
    locks.emplace_back(shards_[k].mu);
    total += shards_[k].used;
  }
  int64_t* ids = nullptr;
  float* rows = nullptr;
  int64_t* counts = nullptr;
  allocate(static_cast<int64_t>(total), &ids, &rows, &counts);
  int64_t i = 0;
  for (uint64_t k = 0; k < num_shards; ++k) {
    const Shard& s = shards_[k];
    for (const Entry& e : s.entries) {
      if (e.row == kEmptyRow) continue;
      ids[i] = e.id;
      counts[i] = CountOf(s, e.row);
      const float* src = RowPtr(s, e.row);
      std::copy(src, src + cols, rows + i * cols);
      ++i;
    }
  }
}

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_HOST_TABLE_H_
