#include "embedding_store.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "mix.h"

namespace sfctr {

EmbeddingStore::EmbeddingStore(const StoreOptions& options)
    : table_(options.table), directory_(options.cache_capacity) {}

CoreStatus EmbeddingStore::Prepare(const int64_t* ids, int64_t n,
                                   PrepareResult* r, const Scheduler* schedule,
                                   const EvictionHints& hints, bool require_distinct) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    return PrepareLocked(ids, n, r, schedule, hints, require_distinct);
  } catch (const std::bad_alloc&) {
    // From an allocation before anything changed (PrepareLocked allocates
    // everything before the directory and the host table change).
    return table_.OutOfMemory("The step's cache plan did not fit in memory; nothing was "
                              "changed.");
  }
}

CoreStatus EmbeddingStore::PrepareLocked(const int64_t* ids, int64_t n, PrepareResult* r,
                                         const Scheduler* schedule,
                                         const EvictionHints& hints,
                                         bool require_distinct) {
  r->slots.resize(n);
  CoreStatus st;
  if (require_distinct && n > directory_.capacity()) {
    // More ids than the cache holds may be copies of fewer: name the repeat
    // (Classify would ask for a larger cache for them).
    std::fill(r->slots.begin(), r->slots.end(), -1);
    st = CheckDistinct(ids, n, r->slots.data(), std::vector<int64_t>(ids, ids + n));
    if (!st.ok()) return st;
  }
  int64_t num_misses = 0;
  st = directory_.Classify(ids, n, r->slots.data(), &num_misses);
  if (!st.ok()) return st;

  // Ids not in the cache, in input order. Callers pass distinct ids; if one
  // repeats (and !require_distinct), Commit places it once and the extra
  // fetched row is dropped below.
  std::vector<int64_t> miss_ids;
  std::vector<int64_t> classified_misses;
  miss_ids.reserve(num_misses);
  classified_misses.reserve(num_misses);
  for (int64_t i = 0; i < n; ++i) {
    if (r->slots[i] < 0) {
      miss_ids.push_back(ids[i]);
      classified_misses.push_back(i);
    }
  }
  if (require_distinct) {
    st = CheckDistinct(ids, n, r->slots.data(), miss_ids);
    if (!st.ok()) return st;
  }
  const int64_t new_ids = table_.max_rows() > 0 && !miss_ids.empty()
                              ? table_.CountMissing(miss_ids.data(), miss_ids.size())
                              : static_cast<int64_t>(miss_ids.size());

  // Everything the step's results need is allocated before the directory or
  // the host table changes: out of memory (std::bad_alloc) here, nothing
  // has, and Prepare says so.
  const int width = table_.width();
  std::vector<float> fetched(miss_ids.size() * width);
  std::vector<uint32_t> past_uses(miss_ids.size());
  std::vector<uint64_t> handles(miss_ids.size());
  std::vector<int64_t> miss_positions;
  std::vector<CacheDirectory::Eviction> evicted;
  miss_positions.reserve(num_misses);
  evicted.reserve(num_misses);
  r->miss_slots.clear();
  r->miss_slots.reserve(num_misses);
  r->evict_ids.clear();
  r->evict_slots.clear();
  r->evict_uses.clear();
  r->evict_ids.reserve(num_misses);
  r->evict_slots.reserve(num_misses);
  r->evict_uses.reserve(num_misses);
  pending_ids_.reserve(num_misses);
  pending_handles_.reserve(num_misses);
  CacheDirectory::CommitUndo& undo = commit_undo_;  // its buffers are reused

  // Reserve host rows for ids never seen before, so that a full table fails
  // here, before the directory changes (without a limit it cannot fail).
  st = table_.Reserve(new_ids);
  if (!st.ok()) return st;

  // The host fetch needs only the miss ids and the table; the directory
  // commit needs only the directory. With a scheduler they can run at once
  // (RunShards: a pool thread takes one if it is free). Neither lets an
  // exception out (on a pool thread that would end the process).
  CoreStatus fetch_st, commit_st;
  bool committed = false, fetch_ran = false;
  try {
    RunShards(schedule, miss_ids.empty() ? 1 : 2, 1, [&](int64_t part) {
      if (part == 0) {
        try {
          directory_.Commit(ids, n, r->slots.data(), &miss_positions, &evicted, hints, &undo);
          committed = true;
        } catch (const std::bad_alloc&) {  // before it changed anything
          commit_st = table_.OutOfMemory("The step's cache plan did not fit in memory.");
        }
      } else {
        fetch_ran = true;  // the fetch releases what it does not use of the reservation
        fetch_st = table_.FindOrInsertReserved(miss_ids.data(), miss_ids.size(),
                                               fetched.data(), new_ids, past_uses.data(),
                                               handles.data());
      }
    });
  } catch (const std::bad_alloc&) {  // RunShards' own bookkeeping, before a part ran
    commit_st = table_.OutOfMemory("The step's cache plan did not fit in memory.");
  }
  if (!fetch_ran) table_.Release(new_ids);
  if (!fetch_st.ok() || !commit_st.ok()) {
    // The cache goes back to what it held: the step is not taken. New ids
    // the fetch gave host rows keep them (their initial rows, as a retry
    // would create them).
    if (committed) {
      directory_.Rollback(ids, n, r->slots.data(), miss_positions, evicted, undo);
    }
    return CoreStatus::ResourceExhausted(
        (fetch_st.ok() ? commit_st : fetch_st).message() +
        " The training step's cache was left as it was (no id placed, none evicted).");
  }

  // miss_positions is a subsequence of classified_misses (equal unless an id
  // repeated): keep the fetched rows of the positions Commit placed,
  // compacted in place (a row only moves forward).
  size_t k = 0;
  for (size_t m = 0; m < miss_positions.size(); ++m) {
    while (classified_misses[k] != miss_positions[m]) ++k;
    const int32_t slot = r->slots[miss_positions[m]];
    r->miss_slots.push_back(slot);
    if (k != m) {
      std::copy(fetched.begin() + k * width, fetched.begin() + (k + 1) * width,
                fetched.begin() + m * width);
    }
    directory_.SeedFrequency(slot, past_uses[k]);
    directory_.SetHandle(slot, handles[k]);
  }
  fetched.resize(miss_positions.size() * width);  // shrinks: no allocation
  r->miss_rows.swap(fetched);

  pending_ids_.clear();
  pending_handles_.clear();
  for (const auto& e : evicted) {
    // A row an update changed after the flush that credited its uses
    // (a training call's gradient taken after a flush, or a delta): its
    // write-back carries no use to flag it changed, so it is flagged here
    // (before the write-back, which comes before any later read).
    if (e.dirty && e.uses == 0) table_.MarkChanged(e.id);
    r->evict_ids.push_back(e.id);
    r->evict_slots.push_back(e.slot);
    r->evict_uses.push_back(e.uses);
    pending_ids_.push_back(e.id);
    pending_handles_.push_back(e.handle);
  }
  return CoreStatus::Ok();
}

CoreStatus EmbeddingStore::CheckDistinct(const int64_t* ids, int64_t n,
                                         const int32_t* slots,
                                         const std::vector<int64_t>& miss_ids) {
  auto repeated = [&](int64_t id) {
    int64_t first = 0;
    while (ids[first] != id) ++first;
    int64_t second = first + 1;
    while (ids[second] != id) ++second;
    return CoreStatus::InvalidArgument(
        "id " + std::to_string(id) + " appears twice among the step's distinct "
        "ids (positions " + std::to_string(first) + " and " + std::to_string(second) +
        "): the unique ids of a de-duplicated feature must be distinct, as "
        "tf_sfctr.data.with_unique_ids and deduplicate give them (a repeated id would "
        "be updated once per copy). Nothing was changed.");
  };
  // Cached ids: a repeated one has the same slot twice. One bit per slot
  // (small enough to stay in cache).
  slot_bits_.assign((directory_.capacity() + 63) / 64, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    const uint64_t bit = uint64_t{1} << (slots[i] & 63);
    uint64_t& word = slot_bits_[slots[i] >> 6];
    if (word & bit) return repeated(ids[i]);
    word |= bit;
  }
  // Missed ids: open addressing over their indexes in miss_ids (-1: empty).
  size_t size = 16;
  while (size < 2 * miss_ids.size()) size <<= 1;
  std::vector<int32_t> set(size, -1);
  const size_t mask = size - 1;
  for (size_t k = 0; k < miss_ids.size(); ++k) {
    size_t h = Mix64(static_cast<uint64_t>(miss_ids[k])) & mask;
    for (; set[h] >= 0; h = (h + 1) & mask) {
      if (miss_ids[set[h]] == miss_ids[k]) return repeated(miss_ids[k]);
    }
    set[h] = static_cast<int32_t>(k);
  }
  return CoreStatus::Ok();
}

CoreStatus EmbeddingStore::WriteBack(const int64_t* ids, int64_t n, const float* rows,
                                     const uint32_t* counts, bool mark_changed) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    return WriteBackLocked(ids, n, rows, counts, mark_changed);
  } catch (const std::bad_alloc&) {  // WriteRows' scratch, before any row changed
    return table_.OutOfMemory("Nothing was written back.");
  }
}

CoreStatus EmbeddingStore::WriteBackLocked(const int64_t* ids, int64_t n, const float* rows,
                                           const uint32_t* counts, bool mark_changed) {
  // A handle is valid until the host table is cleared (ClearHost forgets
  // them), and it belongs to the id it was recorded with: matching the ids
  // one by one is what makes the shortcut safe.
  bool known = mark_changed && n > 0 && static_cast<size_t>(n) == pending_ids_.size() &&
               std::equal(ids, ids + n, pending_ids_.begin());
  for (int64_t i = 0; known && i < n; ++i) known = pending_handles_[i] != 0;
  if (known) {
    table_.WriteRows(pending_handles_.data(), n, rows, counts);
    ++write_backs_by_handle_;
    pending_ids_.clear();
    pending_handles_.clear();
    return CoreStatus::Ok();
  }
  return table_.Write(ids, n, rows, counts, mark_changed);
}

void EmbeddingStore::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  table_.Release();
  directory_.Release();
  pending_ids_.clear();
  pending_handles_.clear();
}

void EmbeddingStore::ClearHost() {
  std::lock_guard<std::mutex> lock(mu_);
  table_.Clear();
  directory_.ClearHandles();
  pending_ids_.clear();
  pending_handles_.clear();
}

std::unordered_set<int64_t> EmbeddingStore::PruneKeepLocked() {
  // Cached ids: their host rows are stale copies the cache will write back
  // (and their counts there lack the cached uses). Pending evictions: their
  // write-back goes by handle into these rows.
  std::unordered_set<int64_t> keep(pending_ids_.begin(), pending_ids_.end());
  std::vector<CacheDirectory::Eviction> cached;
  directory_.Entries(&cached, /*reset_uses=*/false);
  for (const auto& e : cached) keep.insert(e.id);
  return keep;
}

int64_t EmbeddingStore::PruneHost(uint32_t min_count, double decay) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.Prune(min_count, PruneKeepLocked(), decay);
}

int64_t EmbeddingStore::PruneHostToSize(int64_t max_rows, uint32_t* min_count, double decay) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.PruneToSize(max_rows, PruneKeepLocked(), min_count, decay);
}

std::vector<int64_t> EmbeddingStore::HostUseCountHistogram(int64_t* held) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.UseCountHistogram(PruneKeepLocked(), held);
}

std::vector<int64_t> EmbeddingStore::HostTiedIds(uint32_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.TiedIds(count, PruneKeepLocked());
}

int64_t EmbeddingStore::PruneHostBelow(uint32_t below, bool has_last, int64_t last,
                                       double decay) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.PruneBelow(below, has_last, last, PruneKeepLocked(), decay);
}

int64_t EmbeddingStore::Remove(const int64_t* ids, int64_t n, int64_t* cached) {
  std::lock_guard<std::mutex> lock(mu_);
  // Every cached id has a host row (admitting an id inserts it), so the host
  // table's count is the count of distinct ids removed. The host rows go
  // first: out of memory (std::bad_alloc) that removes nothing, and the
  // directory's part below allocates nothing.
  const int64_t removed = table_.Remove(ids, n);
  *cached = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (directory_.Remove(ids[i]) >= 0) ++*cached;
  }
  // Handles of removed rows are invalid now (the free list hands the rows to
  // new ids): the next write-back goes by id.
  pending_ids_.clear();
  pending_handles_.clear();
  return removed;
}

void EmbeddingStore::Probe(const int64_t* ids, int64_t n,
                           int32_t* slots) const {
  std::lock_guard<std::mutex> lock(mu_);
  directory_.ProbeMany(ids, n, slots);
}

void EmbeddingStore::LookupValues(const int64_t* ids, int64_t n, const float* cache_rows,
                                  float* out, const Scheduler* schedule, int threads) const {
  const int dim = table_.dim();
  std::vector<int32_t> slots(n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    directory_.ProbeMany(ids, n, slots.data());
  }
  // Cached rows first, the rows of the ids ahead prefetched (the cache is
  // larger than a core's caches; as SfctrGatherRows does). Reading the host
  // rows on a pool thread beside these copies was no faster
  // (bench/inference.py, docs/design.md).
  std::vector<int64_t> miss_ids, miss_at;
  constexpr int64_t kAhead = 32;
  const size_t bytes = sizeof(float) * dim;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && slots[i + kAhead] >= 0) {
      __builtin_prefetch(cache_rows + static_cast<int64_t>(slots[i + kAhead]) * dim);
    }
    if (slots[i] >= 0) {
      std::memcpy(out + i * dim, cache_rows + static_cast<int64_t>(slots[i]) * dim, bytes);
    } else {
      miss_ids.push_back(ids[i]);
      miss_at.push_back(i);
    }
  }
  if (miss_ids.empty()) return;
  std::vector<float> host(miss_ids.size() * dim);
  table_.Find(miss_ids.data(), static_cast<int64_t>(miss_ids.size()), host.data(),
              /*values_only=*/true, schedule, threads);
  for (size_t k = 0; k < miss_at.size(); ++k) {
    std::memcpy(out + miss_at[k] * dim, host.data() + k * dim, bytes);
  }
}

void EmbeddingStore::CachedEntries(std::vector<int64_t>* ids,
                                   std::vector<int32_t>* slots, const int64_t* hold,
                                   int64_t n_hold) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> held(n_hold);
  directory_.ProbeMany(hold, n_hold, held.data());
  // An id named twice keeps one use, not two (SetUses below keeps one).
  std::sort(held.begin(), held.end());
  held.erase(std::unique(held.begin(), held.end()), held.end());
  // The cached uses move to the host table: reset in the cache only once
  // they are there (out of memory, std::bad_alloc, no count is lost).
  std::vector<CacheDirectory::Eviction> dirty, used;
  directory_.FlushEntries(&dirty, &used);
  ids->clear();
  slots->clear();
  ids->reserve(dirty.size());
  slots->reserve(dirty.size());
  for (const auto& e : dirty) {
    ids->push_back(e.id);
    slots->push_back(e.slot);
  }
  std::vector<int64_t> used_ids;
  std::vector<uint32_t> uses;
  used_ids.reserve(used.size());
  uses.reserve(used.size());
  for (const auto& e : used) {
    used_ids.push_back(e.id);
    uses.push_back(e.uses);
  }
  // The held slots whose count stays cached (entries come in slot order).
  std::vector<int32_t> kept;
  kept.reserve(n_hold);
  for (int32_t slot : held) {
    if (slot < 0) continue;
    const auto at = std::lower_bound(
        used.begin(), used.end(), slot,
        [](const CacheDirectory::Eviction& e, int32_t s) { return e.slot < s; });
    if (at != used.end() && at->slot == slot) {
      --uses[static_cast<size_t>(at - used.begin())];
      kept.push_back(slot);
    }
  }
  // Rows used since the last flush are flagged changed here; the caller's
  // write-back of the dirty rows flags none (HostTable::Write): an updated
  // row was used, and a dirty row no step used since holds what was flagged
  // when it was.
  table_.AddUseCounts(used_ids.data(), static_cast<int64_t>(used_ids.size()), uses.data(),
                      /*mark_changed=*/true);
  directory_.ResetUses();
  for (int32_t slot : kept) directory_.SetUses(slot, 1);
}

void EmbeddingStore::MarkDirty(const int32_t* slots, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  directory_.MarkDirty(slots, n);
}

void EmbeddingStore::MarkClean(const int32_t* slots, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  directory_.MarkClean(slots, n);
}

void EmbeddingStore::ClearCache() {
  std::lock_guard<std::mutex> lock(mu_);
  directory_.Clear();
  pending_ids_.clear();
  pending_handles_.clear();
}

StoreStats EmbeddingStore::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const CacheStats& c = directory_.stats();
  return StoreStats{c.hits,        c.misses,           c.evictions,
                    table_.size(), directory_.capacity(), directory_.size(),
                    write_backs_by_handle_,
                    static_cast<int64_t>(table_.AllocatedBytes()),
                    static_cast<int64_t>(table_.FileBytes())};
}

void EmbeddingStore::SetCounters(int64_t hits, int64_t misses,
                                 int64_t evictions) {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats c;
  c.hits = hits;
  c.misses = misses;
  c.evictions = evictions;
  directory_.set_stats(c);
}

}  // namespace sfctr
