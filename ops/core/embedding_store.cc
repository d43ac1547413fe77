#include "embedding_store.h"

namespace sfctr {

EmbeddingStore::EmbeddingStore(const StoreOptions& options)
    : table_(options.table), directory_(options.cache_capacity) {}

CoreStatus EmbeddingStore::Prepare(const int64_t* ids, int64_t n,
                                   PrepareResult* r) {
  std::lock_guard<std::mutex> lock(mu_);
  r->slots.resize(n);
  int64_t num_misses = 0;
  CoreStatus st = directory_.Classify(ids, n, r->slots.data(), &num_misses);
  if (!st.ok()) return st;

  std::vector<int64_t> miss_ids;
  miss_ids.reserve(num_misses);
  for (int64_t i = 0; i < n; ++i) {
    if (r->slots[i] < 0) miss_ids.push_back(ids[i]);
  }
  // Reserve host rows for ids never seen before, so that a full table fails
  // here, before the directory changes.
  int64_t reserved = 0;
  if (table_.max_rows() > 0 && !miss_ids.empty()) {
    reserved = table_.CountMissing(miss_ids.data(), miss_ids.size());
    st = table_.Reserve(reserved);
    if (!st.ok()) return st;
  } else {
    reserved = static_cast<int64_t>(miss_ids.size());
    table_.Reserve(reserved);  // cannot fail without a limit
  }

  std::vector<int64_t> miss_positions;
  std::vector<CacheDirectory::Eviction> evicted;
  miss_positions.reserve(num_misses);
  directory_.Commit(ids, n, r->slots.data(), &miss_positions, &evicted);

  miss_ids.clear();
  r->miss_slots.clear();
  for (int64_t pos : miss_positions) {
    miss_ids.push_back(ids[pos]);
    r->miss_slots.push_back(r->slots[pos]);
  }
  r->miss_rows.resize(miss_ids.size() * table_.width());
  std::vector<uint32_t> past_uses(miss_ids.size());
  table_.FindOrInsertReserved(miss_ids.data(), miss_ids.size(),
                              r->miss_rows.data(), reserved, past_uses.data());
  for (size_t m = 0; m < past_uses.size(); ++m) {
    directory_.SeedFrequency(r->miss_slots[m], past_uses[m]);
  }

  r->evict_ids.clear();
  r->evict_slots.clear();
  for (const auto& e : evicted) {
    r->evict_ids.push_back(e.id);
    r->evict_slots.push_back(e.slot);
    table_.AddUseCount(e.id, e.uses);
  }
  return CoreStatus::Ok();
}

void EmbeddingStore::Probe(const int64_t* ids, int64_t n,
                           int32_t* slots) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t i = 0; i < n; ++i) slots[i] = directory_.Probe(ids[i]);
}

void EmbeddingStore::CachedEntries(std::vector<int64_t>* ids,
                                   std::vector<int32_t>* slots) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CacheDirectory::Eviction> entries;
  directory_.Entries(&entries, /*reset_uses=*/true);
  ids->clear();
  slots->clear();
  for (const auto& e : entries) {
    ids->push_back(e.id);
    slots->push_back(e.slot);
    table_.AddUseCount(e.id, e.uses);
  }
}

void EmbeddingStore::ClearCache() {
  std::lock_guard<std::mutex> lock(mu_);
  directory_.Clear();
}

StoreStats EmbeddingStore::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const CacheStats& c = directory_.stats();
  return StoreStats{c.hits,       c.misses,           c.evictions,
                    table_.size(), directory_.capacity(), directory_.size()};
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
