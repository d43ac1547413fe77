#include "cache_directory.h"

#include <string>

#include "mix.h"

namespace sfctr {
namespace {
constexpr uint8_t kMaxFreq = 63;
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
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = Probe(ids[i]);
    if (slots[i] < 0) ++misses;
  }
  *num_misses = misses;
  return CoreStatus::Ok();
}

int32_t CacheDirectory::TakeSlot(std::vector<Eviction>* evicted) {
  if (never_used_ < capacity_) return static_cast<int32_t>(never_used_++);
  // Classify guaranteed n <= capacity, so at least one slot is not used by
  // this step; every full turn lowers all counters, so this terminates
  // within kMaxFreq + 1 turns.
  for (;;) {
    Slot& s = slots_[hand_];
    const int32_t slot = static_cast<int32_t>(hand_);
    hand_ = hand_ + 1 == capacity_ ? 0 : hand_ + 1;
    if (s.step == step_) continue;  // used by the current step
    if (!s.occupied) return slot;
    if (s.freq > 0) {
      --s.freq;
      continue;
    }
    evicted->push_back(Eviction{s.id, slot, s.uses});
    MapErase(s.id);
    s.occupied = false;
    --size_;
    ++stats_.evictions;
    return slot;
  }
}

void CacheDirectory::Commit(const int64_t* ids, int64_t n, int32_t* slots,
                            std::vector<int64_t>* miss_positions,
                            std::vector<Eviction>* evicted) {
  ++step_;
  // Mark hits first so no miss can evict a row this step uses.
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    Slot& s = slots_[slots[i]];
    s.step = step_;
    ++s.uses;
    if (s.freq < kMaxFreq) ++s.freq;
    ++stats_.hits;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) continue;
    // A repeated id (callers should pass distinct ids) reuses the slot that
    // its first occurrence just received.
    const int32_t again = Probe(ids[i]);
    if (again >= 0) {
      slots[i] = again;
      continue;
    }
    const int32_t slot = TakeSlot(evicted);
    Slot& s = slots_[slot];
    s.id = ids[i];
    s.step = step_;
    s.uses = 1;
    s.freq = 0;
    s.occupied = true;
    MapInsert(ids[i], slot);
    ++size_;
    ++stats_.misses;
    slots[i] = slot;
    miss_positions->push_back(i);
  }
}

void CacheDirectory::SeedFrequency(int32_t slot, uint32_t past_uses) {
  slots_[slot].freq = static_cast<uint8_t>(
      past_uses < kMaxFreq ? past_uses : kMaxFreq);
}

void CacheDirectory::Entries(std::vector<Eviction>* out, bool reset_uses) {
  out->clear();
  for (int64_t k = 0; k < capacity_; ++k) {
    Slot& s = slots_[k];
    if (!s.occupied) continue;
    out->push_back(Eviction{s.id, static_cast<int32_t>(k), s.uses});
    if (reset_uses) s.uses = 0;
  }
}

void CacheDirectory::Clear() {
  for (Slot& s : slots_) s = Slot();
  for (MapEntry& e : map_) e.slot = -1;
  size_ = 0;
  hand_ = 0;
  never_used_ = 0;
}

}  // namespace sfctr
