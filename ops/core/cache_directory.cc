#include "cache_directory.h"

#include <algorithm>
#include <string>

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
}  // namespace

CacheDirectory::CacheDirectory(int64_t capacity) : capacity_(capacity) {
  slots_.resize(capacity);
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
  constexpr int64_t kAhead = 8;  // ids whose map entry is being prefetched
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

int32_t CacheDirectory::TakeSlot(std::vector<Eviction>* evicted) {
  if (never_used_ < capacity_) return static_cast<int32_t>(never_used_++);
  // Commit set evict_max_level_ and budget_at_max_ so that the slots the step
  // does not use below that level, plus budget_at_max_ of those at it, are
  // exactly the victims it needs: every victim is of a lower level than any
  // slot kept, and one turn of the hand finds each.
  int64_t passed = 0;
  for (;;) {
    Slot& s = slots_[hand_];
    const int32_t slot = static_cast<int32_t>(hand_);
    hand_ = hand_ + 1 == capacity_ ? 0 : hand_ + 1;
    if (++passed > capacity_) {
      // Only if the level counts disagreed with the slots (a bug): take any
      // slot the step does not use rather than turn forever.
      evict_max_level_ = kFreqLevels + kHintLevels;
      budget_at_max_ = capacity_;
    }
    if (s.step == step_) continue;  // used by the current step
    if (!s.occupied) return slot;
    const int level = Level(s);
    if (level > evict_max_level_) continue;
    if (level == evict_max_level_) {
      if (budget_at_max_ == 0) continue;
      --budget_at_max_;
    }
    // The caller removes the id from the map.
    evicted->push_back(Eviction{s.id, slot, s.uses, s.handle});
    --freq_count_[s.freq];
    s.occupied = false;
    --size_;
    ++stats_.evictions;
    return slot;
  }
}

void CacheDirectory::MarkHints(const EvictionHints& hints,
                               std::vector<int32_t>* marked,
                               int64_t* hinted_per_freq,
                               int64_t* hinted_per_distance) {
  // Two passes so that each pass's random reads can be prefetched: the map
  // entries of the hinted ids, then the slots they point to.
  constexpr int64_t kAhead = 8;
  std::vector<int32_t> found(hints.n);
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
      marked->push_back(found[i]);
      ++hinted_per_freq[s.freq];
      ++hinted_per_distance[d];
    } else if (d < s.hint) {
      --hinted_per_distance[s.hint];
      s.hint = d;
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
  for (Slot& s : slots_) {
    s.freq >>= 1;
    if (s.occupied) ++freq_count_[s.freq];
  }
  hits_since_halving_ = 0;
}

void CacheDirectory::Commit(const int64_t* ids, int64_t n, int32_t* slots,
                            std::vector<int64_t>* miss_positions,
                            std::vector<Eviction>* evicted,
                            const EvictionHints& hints) {
  ++step_;
  if (hits_since_halving_ > kHalvingPeriod * static_cast<uint64_t>(capacity_)) {
    HalveCounters();
  }
  // Mark hits first so no miss can evict a row this step uses.
  constexpr int64_t kAhead = 8;  // prefetch distance (entries in flight)
  int64_t in_use_per_freq[kFreqLevels] = {};
  int64_t num_misses = 0;
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
      continue;
    }
    s.step = step_;
    ++s.uses;
    if (s.freq < kMaxFreq) {
      --freq_count_[s.freq];
      ++s.freq;
      ++freq_count_[s.freq];
    }
    ++in_use_per_freq[s.freq];
    ++stats_.hits;
    ++hits_since_halving_;
  }
  const int64_t never_used = capacity_ - never_used_;
  std::vector<int32_t> hinted;
  if (num_misses > never_used) {
    // in_use_per_freq becomes "kept per counter value": used or hinted.
    int64_t hinted_per_distance[kHintLevels + 1] = {};
    if (hints.n > 0) MarkHints(hints, &hinted, in_use_per_freq, hinted_per_distance);
    SetEvictionThreshold(num_misses - never_used, in_use_per_freq, hinted_per_distance);
  }
  // Three passes over the misses, so that the random map accesses of each
  // pass can be prefetched: take a slot for each (the clock only reads the
  // slot array), remove the victims from the map, insert the new ids.
  const size_t first_eviction = evicted->size();
  std::vector<int64_t> misses;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) continue;
    const int32_t slot = TakeSlot(evicted);
    Slot& s = slots_[slot];
    s.id = ids[i];
    s.step = step_;
    s.uses = 1;
    s.freq = 0;
    s.hint = 0;
    s.occupied = true;
    s.handle = 0;  // until the fetch tells where its host row is
    ++freq_count_[0];
    ++size_;
    slots[i] = slot;
    misses.push_back(i);
  }
  for (int32_t slot : hinted) slots_[slot].hint = 0;  // hints last one Commit
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
      --freq_count_[unused.freq];
      --size_;
      slots[i] = again;
      continue;
    }
    MapInsert(ids[i], slots[i]);
    ++stats_.misses;
    miss_positions->push_back(i);
  }
}

void CacheDirectory::SeedFrequency(int32_t slot, uint32_t past_uses) {
  Slot& s = slots_[slot];
  if (s.occupied) --freq_count_[s.freq];
  s.freq = static_cast<uint8_t>(past_uses < kMaxFreq ? past_uses : kMaxFreq);
  if (s.occupied) ++freq_count_[s.freq];
}

void CacheDirectory::ClearHandles() {
  for (Slot& s : slots_) s.handle = 0;
}

void CacheDirectory::Entries(std::vector<Eviction>* out, bool reset_uses) {
  out->clear();
  for (int64_t k = 0; k < capacity_; ++k) {
    Slot& s = slots_[k];
    if (!s.occupied) continue;
    out->push_back(Eviction{s.id, static_cast<int32_t>(k), s.uses, s.handle});
    if (reset_uses) s.uses = 0;
  }
}

void CacheDirectory::Clear() {
  for (Slot& s : slots_) s = Slot();
  for (MapEntry& e : map_) e.slot = -1;
  size_ = 0;
  hand_ = 0;
  never_used_ = 0;
  std::fill(freq_count_, freq_count_ + kFreqLevels, 0);
  hits_since_halving_ = 0;
}

}  // namespace sfctr
