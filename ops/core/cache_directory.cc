#include "cache_directory.h"

#include <algorithm>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "mix.h"

namespace sfctr {
namespace {
constexpr uint8_t kMaxFreq = CacheDirectory::kFreqLevels - 1;
// Counters are halved once hits since the last halving exceed this many
// times the capacity: old popularity fades, recent popularity counts.
constexpr uint64_t kHalvingPeriod = 16;
constexpr uint64_t kDirSalt = 0x2545f4914f6cdd1dULL;
inline uint64_t DirHash(int64_t id) {
  return Mix64(static_cast<uint64_t>(id) ^ kDirSalt);
}

// The first k in [begin, end) with keys[k] < below, or end. The keys are at
// most 0x7fff, so signed 16-bit compares order them; with SSE2, eight at a
// time (most slots the hand passes are kept).
int64_t FindKeyBelow(const uint16_t* keys, int64_t begin, int64_t end, int below) {
  int64_t k = begin;
#if defined(__SSE2__)
  const __m128i bound = _mm_set1_epi16(static_cast<int16_t>(below));
  for (; k + 8 <= end; k += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + k));
    const int mask = _mm_movemask_epi8(_mm_cmplt_epi16(v, bound));
    if (mask != 0) return k + (__builtin_ctz(static_cast<unsigned>(mask)) >> 1);
  }
#endif
  for (; k < end; ++k) {
    if (keys[k] < below) return k;
  }
  return end;
}
}  // namespace

CacheDirectory::CacheDirectory(int64_t capacity) : capacity_(capacity) {
  slots_.resize(capacity);
  scan_keys_.assign(capacity, 0);
  dirty_.assign(capacity, 0);
  uint64_t size = 16;
  while (size < static_cast<uint64_t>(capacity) * 2) size <<= 1;
  map_.assign(size, MapEntry{0, -1});
  map_mask_ = size - 1;
}

int64_t CacheDirectory::FindEntry(int64_t id) const {
  for (uint64_t pos = DirHash(id) & map_mask_;; pos = (pos + 1) & map_mask_) {
    const MapEntry& e = map_[pos];
    if (e.slot < 0) return -1;
    if (e.id == id) return static_cast<int64_t>(pos);
  }
}

void CacheDirectory::MapInsert(int64_t id, int32_t slot) {
  uint64_t pos = DirHash(id) & map_mask_;
  while (map_[pos].slot >= 0) pos = (pos + 1) & map_mask_;
  map_[pos] = MapEntry{id, slot};
}

void CacheDirectory::MapErase(int64_t id) {
  int64_t found = FindEntry(id);
  if (found < 0) return;
  uint64_t hole = static_cast<uint64_t>(found);
  // Backward-shift deletion keeps probe chains intact without tombstones.
  for (uint64_t pos = (hole + 1) & map_mask_; map_[pos].slot >= 0;
       pos = (pos + 1) & map_mask_) {
    const uint64_t home = DirHash(map_[pos].id) & map_mask_;
    // Move the entry into the hole if its home is not in (hole, pos].
    const bool between = hole <= pos ? (home > hole && home <= pos)
                                     : (home > hole || home <= pos);
    if (!between) {
      map_[hole] = map_[pos];
      hole = pos;
    }
  }
  map_[hole].slot = -1;
}

int32_t CacheDirectory::Probe(int64_t id) const {
  const int64_t e = FindEntry(id);
  return e < 0 ? -1 : map_[e].slot;
}

void CacheDirectory::ProbeMany(const int64_t* ids, int64_t n, int32_t* slots) const {
  constexpr int64_t kAhead = 32;  // as in Classify
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      __builtin_prefetch(&map_[DirHash(ids[i + kAhead]) & map_mask_]);
    }
    slots[i] = Probe(ids[i]);
  }
}

CoreStatus CacheDirectory::Classify(const int64_t* ids, int64_t n,
                                    int32_t* slots, int64_t* num_misses) const {
  if (n > capacity_) {
    return CoreStatus::InvalidArgument(
        "this step uses " + std::to_string(n) +
        " distinct ids but cache_capacity is " + std::to_string(capacity_) +
        "; every distinct id of a step must fit in the device cache: raise "
        "cache_capacity to at least " + std::to_string(n) +
        " or use smaller batches. Nothing was changed.");
  }
  int64_t misses = 0;
  // Map entries in flight: 32 took the lookups of a 32k-id batch 17% less time
  // than 8 in `make bench-core` (docs/design.md, "Prefetch distances").
  constexpr int64_t kAhead = 32;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      __builtin_prefetch(&map_[DirHash(ids[i + kAhead]) & map_mask_]);
    }
    slots[i] = Probe(ids[i]);
    if (slots[i] < 0) ++misses;
  }
  *num_misses = misses;
  return CoreStatus::Ok();
}

int32_t CacheDirectory::ChooseSlot() {
  if (never_used_ < capacity_) {
    scan_keys_[never_used_] = kInUse;
    return static_cast<int32_t>(never_used_++);
  }
  // Commit set evict_max_level_ and budget_at_max_ so that the slots the step
  // does not use below that level, plus budget_at_max_ of those at it, are
  // exactly the victims it needs: every victim is of a lower level than any
  // slot kept, and one turn of the hand finds each. The hand reads only
  // scan_keys_ (slots in use this step are kInUse, above any level).
  int64_t passed = 0;
  for (;;) {
    const int at_max = evict_max_level_ + 1;  // scan key of a slot at the max level
    // Take keys below this; empty slots (key 0) always.
    const int below = std::max(1, at_max + (budget_at_max_ > 0 ? 1 : 0));
    // One turn of the hand at most, in straight runs up to the array's end.
    const int64_t end = std::min(capacity_, hand_ + (capacity_ - passed));
    const int64_t k = FindKeyBelow(scan_keys_.data(), hand_, end, below);
    passed += k - hand_;
    if (k == end) {
      hand_ = k == capacity_ ? 0 : k;
      if (passed >= capacity_) {
        // Only if the level counts disagreed with the slots (a bug): take
        // any slot the step does not use rather than turn forever.
        evict_max_level_ = kFreqLevels + kHintLevels;
        budget_at_max_ = capacity_;
        passed = 0;
      }
      continue;
    }
    hand_ = k + 1 == capacity_ ? 0 : k + 1;
    if (scan_keys_[k] == at_max && at_max > 0) --budget_at_max_;
    scan_keys_[k] = kInUse;  // chosen: not again in this Commit
    return static_cast<int32_t>(k);  // empty (key 0) or a victim
  }
}

void CacheDirectory::MarkHints(const EvictionHints& hints,
                               std::vector<int32_t>* found_scratch,
                               std::vector<int32_t>* marked,
                               int64_t* hinted_per_freq,
                               int64_t* hinted_per_distance) {
  // Two passes so that each pass's random reads can be prefetched: the map
  // entries of the hinted ids, then the slots they point to.
  constexpr int64_t kAhead = 8;
  std::vector<int32_t>& found = *found_scratch;
  for (int64_t i = 0; i < hints.n; ++i) {
    if (i + kAhead < hints.n) {
      __builtin_prefetch(&map_[DirHash(hints.ids[i + kAhead]) & map_mask_]);
    }
    found[i] = Probe(hints.ids[i]);
  }
  for (int64_t i = 0; i < hints.n; ++i) {
    if (i + kAhead < hints.n && found[i + kAhead] >= 0) {
      __builtin_prefetch(&slots_[found[i + kAhead]]);
    }
    if (found[i] < 0) continue;
    Slot& s = slots_[found[i]];
    if (s.step == step_) continue;  // the step uses it: kept anyway
    const int32_t steps = hints.steps[i];
    const uint8_t d = static_cast<uint8_t>(
        steps < 1 ? 1 : (steps > kHintLevels ? kHintLevels : steps));
    if (s.hint == 0) {
      s.hint = d;
      scan_keys_[found[i]] = ScanKey(s);
      marked->push_back(found[i]);
      ++hinted_per_freq[s.freq];
      ++hinted_per_distance[d];
    } else if (d < s.hint) {
      --hinted_per_distance[s.hint];
      s.hint = d;
      scan_keys_[found[i]] = ScanKey(s);
      ++hinted_per_distance[d];
    }
  }
}

void CacheDirectory::SetEvictionThreshold(int64_t needed,
                                          const int64_t* kept_per_freq,
                                          const int64_t* hinted_per_distance) {
  // The lowest level such that at least `needed` slots the step does not use
  // are at or below it (unhinted slots by counter value, then hinted slots,
  // the furthest use first), and how many of those at that level must go.
  int64_t candidates = 0;
  auto reached = [&](int level, int64_t at_level) {
    if (candidates + at_level < needed) {
      candidates += at_level;
      return false;
    }
    evict_max_level_ = level;
    budget_at_max_ = needed - candidates;
    return true;
  };
  for (int f = 0; f < kFreqLevels; ++f) {
    if (reached(f, freq_count_[f] - kept_per_freq[f])) return;
  }
  for (int d = kHintLevels; d >= 1; --d) {
    if (reached(kFreqLevels + kHintLevels - d, hinted_per_distance[d])) return;
  }
  // Not enough candidates (cannot happen: Classify bounds a step by the
  // capacity); any slot the step does not use may go.
  evict_max_level_ = kFreqLevels + kHintLevels;
  budget_at_max_ = capacity_;
}

void CacheDirectory::HalveCounters() {
  std::fill(freq_count_, freq_count_ + kFreqLevels, 0);
  for (int64_t k = 0; k < capacity_; ++k) {
    Slot& s = slots_[k];
    s.freq >>= 1;
    if (s.occupied) ++freq_count_[s.freq];
    scan_keys_[k] = ScanKey(s);  // no hints or uses outside Commit
  }
  hits_since_halving_ = 0;
}

void CacheDirectory::Commit(const int64_t* ids, int64_t n, int32_t* slots,
                            std::vector<int64_t>* miss_positions,
                            std::vector<Eviction>* evicted,
                            const EvictionHints& hints, CommitUndo* undo) {
  int64_t num_misses = 0;
  for (int64_t i = 0; i < n; ++i) num_misses += slots[i] < 0 ? 1 : 0;
  // Every allocation first (std::bad_alloc leaves the directory as it was);
  // from the first change on, nothing below allocates.
  // The scan key each used slot gets back at the end of this Commit.
  std::vector<uint16_t> keys_after(n);
  std::vector<int32_t> hint_found, hinted;
  if (hints.n > 0 && num_misses > capacity_ - never_used_) {
    hint_found.resize(hints.n);
    hinted.reserve(hints.n);
  }
  std::vector<int64_t> misses;
  std::vector<int32_t> chosen;
  misses.reserve(num_misses);
  chosen.reserve(num_misses);
  evicted->reserve(evicted->size() + num_misses);
  miss_positions->reserve(miss_positions->size() + num_misses);
  if (undo != nullptr) {
    undo->replaced.clear();
    undo->replaced.reserve(num_misses);
    undo->hand = hand_;
    undo->never_used = never_used_;
    undo->stats = stats_;
    undo->first_eviction = evicted->size();
    undo->first_miss_position = miss_positions->size();
  }
  ++step_;
  if (hits_since_halving_ > kHalvingPeriod * static_cast<uint64_t>(capacity_)) {
    HalveCounters();
  }
  // After halving (which stays: it only ages the counters).
  if (undo != nullptr) undo->hits_since_halving = hits_since_halving_;
  // Mark hits first so no miss can evict a row this step uses.
  constexpr int64_t kAhead = 8;  // prefetch distance (entries in flight)
  int64_t in_use_per_freq[kFreqLevels] = {};
  num_misses = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && slots[i + kAhead] >= 0) {
      __builtin_prefetch(&slots_[slots[i + kAhead]]);
    }
    if (slots[i] < 0) {
      ++num_misses;
      continue;
    }
    Slot& s = slots_[slots[i]];
    if (s.step == step_) {  // a repeated id (callers should pass distinct ids)
      ++s.uses;
      ++stats_.hits;
      keys_after[i] = ScanKey(s);
      continue;
    }
    s.step = step_;
    ++s.uses;
    if (s.freq < kMaxFreq) {
      --freq_count_[s.freq];
      ++s.freq;
      ++freq_count_[s.freq];
    }
    keys_after[i] = ScanKey(s);
    scan_keys_[slots[i]] = kInUse;
    ++in_use_per_freq[s.freq];
    ++stats_.hits;
    ++hits_since_halving_;
  }
  // Empty slots: never used, or freed (Remove, a repeated id). The hand
  // takes every empty slot it passes; victims only make up the rest.
  const int64_t empty = capacity_ - size_;
  if (num_misses <= empty) {
    evict_max_level_ = -1;
    budget_at_max_ = 0;
  } else {
    // in_use_per_freq becomes "kept per counter value": used or hinted.
    int64_t hinted_per_distance[kHintLevels + 1] = {};
    if (hints.n > 0) {
      MarkHints(hints, &hint_found, &hinted, in_use_per_freq, hinted_per_distance);
    }
    SetEvictionThreshold(num_misses - empty, in_use_per_freq, hinted_per_distance);
  }
  // Passes over the misses, so that the random accesses of each can be
  // prefetched: choose a slot for each (the clock reads only scan_keys_),
  // evict and fill those slots, remove the victims from the map, insert the
  // new ids.
  const size_t first_eviction = evicted->size();
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) continue;
    misses.push_back(i);
    chosen.push_back(ChooseSlot());
  }
  // The chosen slots are scattered over the slot array: prefetched ahead.
  for (size_t j = 0; j < misses.size(); ++j) {
    if (j + kAhead < misses.size()) __builtin_prefetch(&slots_[chosen[j + kAhead]]);
    const int64_t i = misses[j];
    const int32_t slot = chosen[j];
    Slot& s = slots_[slot];
    if (undo != nullptr) {
      undo->replaced.push_back(s);  // reserved above
      undo->replaced.back().hint = 0;  // hints last one Commit
    }
    if (s.occupied) {  // the caller removes the id from the map
      evicted->push_back(Eviction{s.id, slot, s.uses, s.handle, dirty_[slot] != 0});
      dirty_[slot] = 0;  // the new id's row comes from the host
      --freq_count_[s.freq];
      --size_;
      ++stats_.evictions;
    }
    s.id = ids[i];
    s.step = step_;
    s.uses = 1;
    s.freq = 0;
    s.hint = 0;
    s.occupied = true;
    s.handle = 0;  // until the fetch tells where its host row is
    keys_after[i] = ScanKey(s);
    ++freq_count_[0];
    ++size_;
    slots[i] = slot;
  }
  for (int32_t slot : hinted) {  // hints last one Commit
    slots_[slot].hint = 0;
    // A hinted slot that was evicted and refilled is in use.
    if (scan_keys_[slot] != kInUse) scan_keys_[slot] = ScanKey(slots_[slot]);
  }
  const size_t num_evicted = evicted->size() - first_eviction;
  for (size_t j = 0; j < num_evicted; ++j) {
    if (j + kAhead < num_evicted) {
      const int64_t ahead = (*evicted)[first_eviction + j + kAhead].id;
      __builtin_prefetch(&map_[DirHash(ahead) & map_mask_]);
    }
    MapErase((*evicted)[first_eviction + j].id);
  }
  for (size_t j = 0; j < misses.size(); ++j) {
    if (j + kAhead < misses.size()) {
      __builtin_prefetch(&map_[DirHash(ids[misses[j + kAhead]]) & map_mask_]);
    }
    const int64_t i = misses[j];
    // A repeated id (callers should pass distinct ids) takes the slot of its
    // first occurrence; the slot taken for it stays empty.
    const int32_t again = Probe(ids[i]);
    if (again >= 0) {
      Slot& unused = slots_[slots[i]];
      unused.occupied = false;
      unused.uses = 0;
      scan_keys_[slots[i]] = 0;
      --freq_count_[unused.freq];
      --size_;
      slots[i] = again;
      continue;
    }
    MapInsert(ids[i], slots[i]);
    ++stats_.misses;
    miss_positions->push_back(i);
  }
  // The step's slots are no longer "in use" for the next Commit's hand.
  for (int64_t i = 0; i < n; ++i) scan_keys_[slots[i]] = keys_after[i];
  if (undo != nullptr) {
    undo->misses.swap(misses);
    undo->chosen.swap(chosen);
  }
}

void CacheDirectory::Rollback(const int64_t* ids, int64_t n, const int32_t* slots,
                              const std::vector<int64_t>& miss_positions,
                              const std::vector<Eviction>& evicted,
                              const CommitUndo& undo) {
  // The map first: the ids placed leave it, the evicted ones come back.
  for (size_t j = undo.first_miss_position; j < miss_positions.size(); ++j) {
    MapErase(ids[miss_positions[j]]);
  }
  for (size_t j = undo.first_eviction; j < evicted.size(); ++j) {
    MapInsert(evicted[j].id, evicted[j].slot);
    dirty_[evicted[j].slot] = evicted[j].dirty ? 1 : 0;  // its row stays there
  }
  // The slots given to misses get their old contents back (latest first).
  for (size_t j = undo.replaced.size(); j-- > 0;) {
    const int32_t k = undo.chosen[j];
    Slot& s = slots_[k];
    if (s.occupied) {
      --freq_count_[s.freq];
      --size_;
    }
    s = undo.replaced[j];
    if (s.occupied) {
      ++freq_count_[s.freq];
      ++size_;
    }
    scan_keys_[k] = ScanKey(s);
  }
  // The hits give back the use this step counted (once per occurrence).
  size_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (m < undo.misses.size() && undo.misses[m] == i) {
      ++m;
      continue;
    }
    Slot& s = slots_[slots[i]];
    if (s.uses > 0) --s.uses;
  }
  hand_ = undo.hand;
  never_used_ = undo.never_used;
  stats_ = undo.stats;
  hits_since_halving_ = undo.hits_since_halving;
}

void CacheDirectory::SeedFrequency(int32_t slot, uint32_t past_uses) {
  Slot& s = slots_[slot];
  if (s.occupied) --freq_count_[s.freq];
  s.freq = static_cast<uint8_t>(past_uses < kMaxFreq ? past_uses : kMaxFreq);
  if (s.occupied) ++freq_count_[s.freq];
  scan_keys_[slot] = ScanKey(s);
}

void CacheDirectory::ClearHandles() {
  for (Slot& s : slots_) s.handle = 0;
}

void CacheDirectory::Entries(std::vector<Eviction>* out, bool reset_uses) {
  out->clear();
  out->reserve(size_);
  for (int64_t k = 0; k < capacity_; ++k) {
    const Slot& s = slots_[k];
    if (!s.occupied) continue;
    out->push_back(Eviction{s.id, static_cast<int32_t>(k), s.uses, s.handle});
  }
  if (reset_uses) ResetUses();
}

void CacheDirectory::ResetUses() {
  for (Slot& s : slots_) s.uses = 0;
}

void CacheDirectory::FlushEntries(std::vector<Eviction>* dirty,
                                  std::vector<Eviction>* used) const {
  dirty->clear();
  used->clear();
  dirty->reserve(size_);
  used->reserve(size_);
  for (int64_t k = 0; k < capacity_; ++k) {
    const Slot& s = slots_[k];
    if (!s.occupied) continue;
    const Eviction e{s.id, static_cast<int32_t>(k), s.uses, s.handle};
    if (dirty_[k]) dirty->push_back(e);
    if (s.uses > 0) used->push_back(e);
  }
}

void CacheDirectory::MarkDirty(const int32_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0 && slots[i] < capacity_) dirty_[slots[i]] = 1;
  }
}

void CacheDirectory::MarkClean(const int32_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0 && slots[i] < capacity_) dirty_[slots[i]] = 0;
  }
}

int32_t CacheDirectory::Remove(int64_t id) {
  const int32_t slot = Probe(id);
  if (slot < 0) return -1;
  MapErase(id);
  Slot& s = slots_[slot];
  --freq_count_[s.freq];
  --size_;
  s = Slot();
  dirty_[slot] = 0;  // its row is dropped, not written back
  // Key 0: the hand takes an empty slot before any victim.
  scan_keys_[slot] = 0;
  return slot;
}

void CacheDirectory::Clear() {
  for (Slot& s : slots_) s = Slot();
  std::fill(dirty_.begin(), dirty_.end(), 0);
  std::fill(scan_keys_.begin(), scan_keys_.end(), 0);
  for (MapEntry& e : map_) e.slot = -1;
  size_ = 0;
  hand_ = 0;
  never_used_ = 0;
  std::fill(freq_count_, freq_count_ + kFreqLevels, 0);
  hits_since_halving_ = 0;
}

void CacheDirectory::Release() {
  // (swap: clear() keeps a vector's memory.)
  decltype(slots_)().swap(slots_);
  std::vector<uint16_t>().swap(scan_keys_);
  std::vector<uint8_t>().swap(dirty_);
  decltype(map_)().swap(map_);
  capacity_ = 0;
  size_ = 0;
  hand_ = 0;
  never_used_ = 0;
  std::fill(freq_count_, freq_count_ + kFreqLevels, 0);
}

size_t CacheDirectory::AllocatedBytes() const {
  return slots_.capacity() * sizeof(Slot) + scan_keys_.capacity() * sizeof(uint16_t) +
         dirty_.capacity() * sizeof(uint8_t) + map_.capacity() * sizeof(MapEntry);
}

}  // namespace sfctr
