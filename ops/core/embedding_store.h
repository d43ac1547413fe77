// An embedding store: the host table plus the directory of the device cache
// that sits in front of it. This is the object one TensorFlow resource holds.
// TF-free.
#ifndef TF_SFCTR_OPS_CORE_EMBEDDING_STORE_H_
#define TF_SFCTR_OPS_CORE_EMBEDDING_STORE_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "cache_directory.h"
#include "host_table.h"
#include "parallel.h"
#include "status.h"

namespace sfctr {

struct StoreOptions {
  HostTableOptions table;
  int64_t cache_capacity = 1024;
};

// What one training step must do on the device after Prepare.
struct PrepareResult {
  std::vector<int32_t> slots;        // cache slot of every input id
  std::vector<int32_t> miss_slots;   // slots to fill ...
  std::vector<float> miss_rows;      // ... with these full-width rows
  std::vector<int32_t> evict_slots;  // slots whose rows must go back ...
  std::vector<int64_t> evict_ids;    // ... to the host under these ids,
  std::vector<uint32_t> evict_uses;  // ... adding these use counts
};

struct StoreStats {
  int64_t hits, misses, evictions, host_rows, cache_capacity, cached_rows;
  int64_t write_backs_by_handle;  // write-backs that skipped the id lookup
  int64_t host_bytes;             // host table's allocated bytes
  int64_t host_file_bytes;        // of those, rows mapped from host_rows_dir's file
};

class EmbeddingStore {
 public:
  explicit EmbeddingStore(const StoreOptions& options);

  HostTable& table() { return table_; }
  const HostTable& table() const { return table_; }
  int64_t cache_capacity() const { return directory_.capacity(); }

  // One training step's cache management for `n` distinct ids: maps each id
  // to a slot, picks victims among slots the step does not use and fetches
  // the missing rows from the host table (creating new ids). Fails without
  // changing anything if the ids do not fit in the cache or the host table
  // would exceed max_rows. The caller writes the evicted rows back with
  // WriteBack(evict_ids, rows, evict_uses) before reusing their slots (the
  // uses ride along so that each host row is visited once).
  // With a `schedule`, the host fetch runs on it while this thread updates
  // the directory; Prepare returns when both are done. `hints` name ids of
  // later batches, kept in the cache when others can go (CacheDirectory).
  // With `require_distinct`, ids that repeat fail (changing nothing) instead
  // of being placed once: for ids the caller did not de-duplicate itself (a
  // repeated id would get its update applied once per copy).
  // Out of host memory it fails (ResourceExhausted) with the cache as it was;
  // new ids the fetch created before that keep their (initial) host rows.
  CoreStatus Prepare(const int64_t* ids, int64_t n, PrepareResult* result,
                     const Scheduler* schedule = nullptr,
                     const EvictionHints& hints = EvictionHints(),
                     bool require_distinct = false);

  // Stores full-width rows of `ids` in the host table, adding `counts` (if
  // given) to their use counters. When `ids` are exactly the last Prepare's
  // evictions, the rows go straight to where the cache remembered them
  // (HostTable::WriteRows: no hashing, no index probe); any other ids take
  // HostTable::Write (see there for running out of memory).
  // `mark_changed` as for HostTable::Write.
  CoreStatus WriteBack(const int64_t* ids, int64_t n, const float* rows,
                       const uint32_t* counts, bool mark_changed = true);

  // Removes every host row (the cache must be cleared or flushed first).
  void ClearHost();

  // Frees the host table (HostTable::Release) and the cache directory's
  // entries, for a store nothing uses any more.
  void Release();

  // Removes the host rows of ids used in fewer than `min_count` steps
  // (HostTable::Prune), never those of cached ids or of the last Prepare's
  // evictions (their write-back may be pending). Returns how many went.
  // `decay` then scales the remaining use counters (HostTable::Prune).
  int64_t PruneHost(uint32_t min_count, double decay = 1.0);

  // The same for the least used ids until at most `max_rows` rows remain
  // (HostTable::PruneToSize); `*min_count` as there.
  int64_t PruneHostToSize(int64_t max_rows, uint32_t* min_count, double decay = 1.0);

  // PruneHostToSize in parts (HostTable::UseCountHistogram, TiedIds and
  // PruneBelow), for a table sharded over processes that bounds the rows of
  // all its shards: the same ids stay (cached ones, pending evictions) as
  // long as nothing trains the store between the parts.
  std::vector<int64_t> HostUseCountHistogram(int64_t* held);
  std::vector<int64_t> HostTiedIds(uint32_t count);
  int64_t PruneHostBelow(uint32_t below, bool has_last, int64_t last, double decay = 1.0);

  // Removes `ids` from the cache (their rows are dropped, not written back)
  // and from the host table; returns how many of them the host table held
  // (every cached id has a host row). Out of memory (std::bad_alloc) it
  // removes nothing.
  // A removed id that comes back starts from its initial row. The caller
  // makes sure no write-back of a Prepare is pending and drops a prepared
  // plan that holds any of the ids. On return `*cached` holds how many of
  // them were cached.
  int64_t Remove(const int64_t* ids, int64_t n, int64_t* cached);

  // Write-backs that took the by-handle path (for tests).
  int64_t write_backs_by_handle() const {
    std::lock_guard<std::mutex> lock(mu_);
    return write_backs_by_handle_;
  }

  // Slots of `ids` (-1 when not cached), without side effects.
  void Probe(const int64_t* ids, int64_t n, int32_t* slots) const;

  // Current values (n x dim, no optimizer state) of `ids` for a read outside
  // training: a cached id's row from `cache_rows` (the device cache's rows as
  // a host array, capacity x dim), any other's from the host table (the
  // initial value of an id never stored, which is not inserted). No side
  // effects. The caller holds the cache rows still while this runs.
  // With a scheduler, a large host read runs on up to `threads` threads
  // (HostTable::Find).
  void LookupValues(const int64_t* ids, int64_t n, const float* cache_rows, float* out,
                    const Scheduler* schedule = nullptr, int threads = 1) const;

  // The cached ids (and their slots) whose rows a flush must write back:
  // those whose slots are marked dirty (MarkDirty: a table update changed
  // them since their last write-back; the rest are as the host table holds
  // them). The caller writes them, then marks them clean (MarkClean). Also
  // credits the cached use counts to the host table and flags the rows
  // used since the last call changed (HostTable). The ids of `hold` (n_hold
  // of them: a lookahead plan's, counted when the next batch was prepared,
  // before its step trains them) keep one use in the cache, credited (and
  // flagged) after that step.
  void CachedEntries(std::vector<int64_t>* ids, std::vector<int32_t>* slots,
                     const int64_t* hold = nullptr, int64_t n_hold = 0);

  // See CacheDirectory::MarkDirty / MarkClean.
  void MarkDirty(const int32_t* slots, int64_t n);
  void MarkClean(const int32_t* slots, int64_t n);

  // Forgets the cache directory (rows must have been flushed).
  void ClearCache();

  StoreStats Stats() const;
  void SetCounters(int64_t hits, int64_t misses, int64_t evictions);

 private:
  // The ids a prune must keep (cached ones, pending evictions); mu_ held.
  std::unordered_set<int64_t> PruneKeepLocked();
  CoreStatus PrepareLocked(const int64_t* ids, int64_t n, PrepareResult* result,
                           const Scheduler* schedule, const EvictionHints& hints,
                           bool require_distinct);
  CoreStatus WriteBackLocked(const int64_t* ids, int64_t n, const float* rows,
                             const uint32_t* counts, bool mark_changed);
  // Fails naming an id of `ids` that repeats. `slots` are Classify's
  // (equal slots >= 0 are a repeated cached id); the misses (`miss_ids`)
  // are checked with a small hash set.
  CoreStatus CheckDistinct(const int64_t* ids, int64_t n, const int32_t* slots,
                           const std::vector<int64_t>& miss_ids);

  HostTable table_;
  mutable std::mutex mu_;  // guards directory_ and the pending write-back
  CacheDirectory directory_;
  // The last Prepare's evictions and where their host rows live.
  std::vector<int64_t> pending_ids_;
  std::vector<uint64_t> pending_handles_;
  int64_t write_backs_by_handle_ = 0;
  std::vector<uint64_t> slot_bits_;  // CheckDistinct's slots seen, one bit each
  CacheDirectory::CommitUndo commit_undo_;  // Prepare's, to undo a Commit
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_EMBEDDING_STORE_H_
