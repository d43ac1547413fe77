// The cache directory: which id occupies which device cache slot. It only
// manages indices; the rows themselves live in device variables.
//
// Eviction is least-frequently-used, found with a clock: every cached slot has
// a use counter (steps that used the id, seeded from the id's whole history
// in the host table when it is admitted, saturating at 255), and a histogram
// of the counters gives, for each step, the lowest counter value c such that
// enough slots the step does not use have a counter <= c. The hand then
// takes the slots below c it passes and, of those at c, as many as are still
// needed (ties go in clock order). Counters are halved
// every 16 x capacity hits, so past popularity fades. On power-law traces
// this keeps ~5% more hits than a generalised CLOCK (which lowers counters as
// its hand passes) and is within 1% of an exact history LFU
// (bench/cache_policy.py).
//
// Eviction hints: a step may also name ids that later batches will use, with
// how many batches ahead (the input pipeline reads ahead, so it knows). A
// cached id with a hint is evicted only after every unhinted slot the step
// does not use, and among hinted ids the furthest use goes first: Belady's
// rule inside the hint window, frequency outside it. No policy that does not
// look ahead can get close to Belady on an i.i.d. power-law stream (the best,
// keeping the most probable ids, reaches 0.87x of it at 5% cache); a window
// of two batches reaches 0.93x (bench/cache_policy.py).
// Not thread-safe: the owner serialises calls.
// TF-free.
#ifndef TF_SFCTR_OPS_CORE_CACHE_DIRECTORY_H_
#define TF_SFCTR_OPS_CORE_CACHE_DIRECTORY_H_

#include <cstdint>
#include <vector>

#include "huge_pages.h"
#include "status.h"

namespace sfctr {

// Ids later batches use: ids[i] is used `steps[i]` batches after the one
// being committed (1 = the next). Repeated ids keep their smallest distance.
struct EvictionHints {
  const int64_t* ids = nullptr;
  const int32_t* steps = nullptr;
  int64_t n = 0;
};

struct CacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
};

class CacheDirectory {
 private:
  struct Slot {
    int64_t id = 0;
    uint64_t step = 0;   // last step that used this slot
    uint32_t uses = 0;
    uint8_t freq = 0;
    uint8_t hint = 0;  // batches until a hinted later use (0: no hint), this Commit only
    bool occupied = false;
    uint64_t handle = 0;  // host row of the id (0: unknown)
  };

 public:
  struct Eviction {
    int64_t id;
    int32_t slot;
    uint32_t uses;        // steps that used the id while it was cached
    uint64_t handle = 0;  // where its host row lives (SetHandle), 0 if unknown
    bool dirty = false;   // an update changed the row since it was last written back
  };

  // What a Commit changed, for Rollback.
  class CommitUndo {
   private:
    friend class CacheDirectory;
    int64_t hand = 0, never_used = 0;
    uint64_t hits_since_halving = 0;
    CacheStats stats;
    size_t first_eviction = 0, first_miss_position = 0;
    std::vector<int64_t> misses;  // positions of the misses, in order
    std::vector<int32_t> chosen;  // the slot taken for each ...
    std::vector<Slot> replaced;   // ... and what it held before
  };

  explicit CacheDirectory(int64_t capacity);

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return size_; }
  const CacheStats& stats() const { return stats_; }
  void set_stats(const CacheStats& stats) { stats_ = stats; }

  // Slot of `id`, or -1. Read-only (no counters, no frequency change).
  int32_t Probe(int64_t id) const;

  // Probe of each of `ids` into slots[i], with the map entries of the ids
  // ahead prefetched (as Classify does).
  void ProbeMany(const int64_t* ids, int64_t n, int32_t* slots) const;

  // Classifies distinct `ids` (n of them) without changing anything: writes
  // the slot of each hit into slots[i] and -1 for each miss; returns the
  // number of misses. Fails if n exceeds the capacity.
  CoreStatus Classify(const int64_t* ids, int64_t n, int32_t* slots,
                      int64_t* num_misses) const;

  // Second half of a step, after Classify filled `slots`: marks the hits as in
  // use, gives every miss a slot (evicting ids the step does not use) and
  // appends the evicted ids to `evicted`. `miss_positions` receives the
  // indices i of the misses, in order. `hints` (ids of later batches) keep
  // their slots if enough others can go; they are only read when the step
  // has to evict. Everything it allocates comes first: out of memory
  // (std::bad_alloc) it changes nothing. With `undo`, records what it
  // changes there for Rollback.
  void Commit(const int64_t* ids, int64_t n, int32_t* slots,
              std::vector<int64_t>* miss_positions,
              std::vector<Eviction>* evicted,
              const EvictionHints& hints = EvictionHints(),
              CommitUndo* undo = nullptr);

  // Undoes the last Commit, which filled `undo`, given its ids, n and the
  // slots, miss_positions and evicted it returned (when the step cannot go
  // on, e.g. its host fetch ran out of memory): every id is cached in the
  // slot it had before, with its uses and host handle, and the counters are
  // as they were. (The hits' raised frequency counters stay; they only
  // order evictions.) Allocates nothing.
  void Rollback(const int64_t* ids, int64_t n, const int32_t* slots,
                const std::vector<int64_t>& miss_positions,
                const std::vector<Eviction>& evicted, const CommitUndo& undo);

  // Starts the frequency counter of a just-admitted slot from the id's use
  // history (steps it was used in before), so a hot id that was evicted
  // comes back protected instead of first in line for eviction.
  void SeedFrequency(int32_t slot, uint32_t past_uses);

  // Remembers where the host row of the id in `slot` lives (a HostTable
  // handle), handed back with its eviction; ClearHandles forgets them all
  // (when the host table is cleared).
  void SetHandle(int32_t slot, uint64_t handle) { slots_[slot].handle = handle; }
  void ClearHandles();

  // Every cached (id, slot, uses) triple; resets the use counters when
  // `reset_uses` (used when flushing to the host table), only once `out`
  // holds them all.
  void Entries(std::vector<Eviction>* out, bool reset_uses);

  // Sets every cached id's use counter to 0.
  void ResetUses();

  // Dirty slots: their rows changed in the cache (a table update) since
  // they were last written back, so a flush must write them. The caller
  // marks a step's slots when its update changes their rows, and clean once
  // a flush has written them. A Commit that evicts a slot reports its flag
  // with the eviction and clears it (the new id's row comes from the host);
  // Remove and Clear drop it. Slots outside [0, capacity) are ignored.
  void MarkDirty(const int32_t* slots, int64_t n);
  void MarkClean(const int32_t* slots, int64_t n);

  // For a flush: the cached slots marked dirty into `dirty`, and those with
  // uses (since the last ResetUses) into `used`, both in slot order.
  // Changes nothing.
  void FlushEntries(std::vector<Eviction>* dirty, std::vector<Eviction>* used) const;

  // Sets the use counter of the id in `slot` (occupied).
  void SetUses(int32_t slot, uint32_t uses) { slots_[slot].uses = uses; }

  // Forgets `id` (its row is dropped, not written back): its slot becomes
  // empty, for a later miss to take. Returns the slot, or -1 if `id` was not
  // cached. Not during a Commit whose slots are still to be used (a
  // prepared lookahead plan holding the id must be dropped by the caller).
  int32_t Remove(int64_t id);

  // Forgets every id (the rows are assumed to be flushed already).
  void Clear();

  // Frees every array (the store's owner is gone; no op may use this
  // directory again, which the store's released flag enforces).
  void Release();
  // Bytes of the directory's arrays.
  size_t AllocatedBytes() const;

  static constexpr int kFreqLevels = 256;  // use counter values 0..255
  // Hint distances 1..kHintLevels; larger ones count as kHintLevels.
  static constexpr int kHintLevels = 16;

 private:
  int64_t FindEntry(int64_t id) const;  // index into map_ or -1
  void MapInsert(int64_t id, int32_t slot);
  void MapErase(int64_t id);
  // The next slot the clock hand gives this Commit (empty, or a victim the
  // caller evicts), marked in use.
  int32_t ChooseSlot();
  // Eviction order: counter values 0..255, then hinted slots, furthest use
  // first (levels 256.. up to 256 + kHintLevels - 1).
  int Level(const Slot& s) const {
    return s.hint == 0 ? s.freq : kFreqLevels + kHintLevels - s.hint;
  }
  // Marks the cached ids of `hints` that the step does not use; returns the
  // marked slots and counts them per counter value and per distance.
  // `found` (hints.n entries) and `marked` (capacity for hints.n) are
  // allocated by the caller.
  void MarkHints(const EvictionHints& hints, std::vector<int32_t>* found,
                 std::vector<int32_t>* marked,
                 int64_t* hinted_per_freq, int64_t* hinted_per_distance);
  // Sets evict_max_level_ and budget_at_max_ for a step that must evict
  // `needed` slots, given how many slots of each counter value the step uses
  // or keeps for a hint, and how many hinted slots there are per distance.
  void SetEvictionThreshold(int64_t needed, const int64_t* kept_per_freq,
                            const int64_t* hinted_per_distance);
  void HalveCounters();

  int64_t capacity_;
  int64_t size_ = 0;
  uint64_t step_ = 0;
  int64_t hand_ = 0;
  int64_t never_used_ = 0;     // slots [never_used_, capacity) never filled
  int64_t freq_count_[kFreqLevels] = {};  // occupied slots per counter value
  int evict_max_level_ = 0;    // this step's victims: Level below this, and ...
  int64_t budget_at_max_ = 0;  // ... this many more at it
  uint64_t hits_since_halving_ = 0;
  std::vector<Slot, LargeAllocator<Slot>> slots_;
  // What the clock hand reads, one small key per slot so that its sweep
  // stays in the core's cache: 0 for an empty slot, Level + 1 for an
  // occupied one, kInUse while the current Commit uses the slot (a hit or
  // a slot it chose). Outside Commit no slot is kInUse. All keys fit in 15
  // bits (the sweep compares them as signed 16-bit numbers).
  static constexpr uint16_t kInUse = 0x7fff;
  uint16_t ScanKey(const Slot& s) const {
    return s.occupied ? static_cast<uint16_t>(Level(s) + 1) : 0;
  }
  std::vector<uint16_t> scan_keys_;
  // One byte per slot (MarkDirty): 1 MiB per million slots, so a step's
  // marks stay in the core's caches, apart from the 32-byte slots.
  std::vector<uint8_t> dirty_;
  // Open-addressing id -> slot map with backward-shift deletion; slot -1
  // marks an empty entry. Id and slot share an entry (one cache line visit
  // per probe).
  struct MapEntry {
    int64_t id;
    int32_t slot;
  };
  std::vector<MapEntry, LargeAllocator<MapEntry>> map_;
  uint64_t map_mask_;
  CacheStats stats_;
};

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_CACHE_DIRECTORY_H_
