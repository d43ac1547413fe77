#include "host_table.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <unordered_set>

#include "mix.h"

namespace sfctr {
namespace {

// Arena blocks: block k holds kBaseRows << min(k, kMaxShift) rows.
constexpr uint32_t kBaseRows = 16;
constexpr int kMaxShift = 12;  // largest block: 65536 rows
constexpr uint64_t kGeometricRows =
    static_cast<uint64_t>(kBaseRows) * ((2ull << kMaxShift) - 1);
constexpr uint64_t kLargeBlockRows = static_cast<uint64_t>(kBaseRows) << kMaxShift;
constexpr size_t kInitialEntries = 16;
// Grow the index when more than 13/16 of the entries are used, by 3/2 while
// small and about 5/4 once large (GrowLocked): the load stays between 54%
// and 81% (a power-of-two index drops to 41%, which
// cost up to 9 more bytes per row at 12 bytes per entry).
constexpr uint64_t kMaxLoadNum = 13, kMaxLoadDen = 16;
constexpr size_t kFineGrowthEntries = 4096;
// Salt so that shard choice and probe position are independent of the
// distributed owner function, which uses Mix64(id) directly.
constexpr uint64_t kTableSalt = 0x5f3759df2545f491ULL;

inline uint64_t HashId(int64_t id) {
  return Mix64(static_cast<uint64_t>(id) ^ kTableSalt);
}

inline void BlockOf(uint64_t row, uint64_t* block, uint64_t* offset) {
  if (row < kGeometricRows) {
    const uint64_t x = row / kBaseRows + 1;
    const uint64_t k = 63 - __builtin_clzll(x);
    *block = k;
    *offset = row - static_cast<uint64_t>(kBaseRows) * ((1ull << k) - 1);
  } else {
    const uint64_t rest = row - kGeometricRows;
    *block = kMaxShift + 1 + rest / kLargeBlockRows;
    *offset = rest % kLargeBlockRows;
  }
}

inline uint64_t BlockRows(uint64_t block) {
  return static_cast<uint64_t>(kBaseRows)
         << std::min<uint64_t>(block, kMaxShift);
}

// Runs `f` when it goes out of scope, also when an exception passes.
template <typename F>
struct OnExit {
  F f;
  ~OnExit() { f(); }
};
template <typename F>
OnExit(F) -> OnExit<F>;

}  // namespace

HostTable::HostTable(const HostTableOptions& options)
    : options_(options),
      row_file_(options.rows_dir.empty() ? nullptr : RowFile::Open(options.rows_dir)),
      initializer_(options.init),
      width_(options.dim * (1 + options.num_state)) {
  int shards = 1;
  while (shards < std::max(1, options_.num_shards)) shards <<= 1;
  options_.num_shards = shards;
  options_.state_init.resize(options_.num_state, 0.0f);
  shards_.reset(new Shard[shards]);
  shard_mask_ = static_cast<uint64_t>(shards - 1);
  for (int k = 0; k < shards; ++k) PresizeLocked(shards_[k]);
}

void HostTable::PresizeLocked(Shard& s) const {
  if (options_.expected_rows <= 0) return;
  // Ids spread over the shards binomially: a shard's share has a standard
  // deviation of about sqrt(share), so 4 of them above the mean (plus a
  // small constant) leaves almost every shard room for its part.
  const double share = static_cast<double>(options_.expected_rows) /
                       static_cast<double>(shard_mask_ + 1);
  const auto want = static_cast<uint64_t>(std::ceil(share + 4.0 * std::sqrt(share) + 16.0));
  GrowLocked(s, want);
  if (options_.reserve_rows) ReserveRowsLocked(s, want);
}

void HostTable::InitialRow(int64_t id, float* out) const {
  const int dim = options_.dim;
  initializer_.Fill(id, dim, out);
  for (int s = 0; s < options_.num_state; ++s) {
    std::fill(out + dim * (s + 1), out + dim * (s + 2), options_.state_init[s]);
  }
}

float* HostTable::RowPtr(const Shard& s, uint32_t row) const {
  uint64_t block, offset;
  BlockOf(row, &block, &offset);
  return s.blocks[block].get() + offset * width_;
}

HostTable::RowMeta& HostTable::MetaOf(const Shard& s, uint32_t row) const {
  uint64_t block, offset;
  BlockOf(row, &block, &offset);
  return s.meta_blocks[block][offset];
}

void HostTable::AddBlockLocked(Shard& s) const {
  // Everything that can throw (std::bad_alloc) comes before the shard
  // changes: blocks and count blocks stay paired.
  const uint64_t block = s.blocks.size();
  const size_t rows = BlockRows(block);
  s.blocks.reserve(block + 1);
  s.meta_blocks.reserve(block + 1);
  const size_t meta_bytes = sizeof(RowMeta) * rows;
  std::unique_ptr<RowMeta[], BlockDeleter> meta(
      static_cast<RowMeta*>(AllocateHeap(meta_bytes)),
      BlockDeleter{meta_bytes, false, nullptr, 0});
  // A shard this large (over 2^17 rows) reads and writes its rows at random
  // over GBs: huge pages save a page-table walk per access. Rows fill a
  // block in order, so at most one huge page per shard is resident but not
  // yet used (smaller blocks stay on normal pages, where that would be a
  // large share of a small table).
  const bool large = rows == kLargeBlockRows;
  const size_t bytes = sizeof(float) * rows * width_;
  std::unique_ptr<float[], BlockDeleter> values;
  if (row_file_ && bytes >= kOwnMapping) {
    // Smaller blocks (a shard's first few hundred rows) stay in memory.
    BlockDeleter in_file{bytes, false, row_file_, 0};
    values = std::unique_ptr<float[], BlockDeleter>(
        static_cast<float*>(row_file_->Map(bytes, &in_file.offset)), in_file);
  } else {
    values = std::unique_ptr<float[], BlockDeleter>(
        static_cast<float*>(large ? AllocateLarge(bytes) : AllocateHeap(bytes)),
        BlockDeleter{bytes, large, nullptr, 0});
  }
  s.blocks.push_back(std::move(values));
  s.meta_blocks.push_back(std::move(meta));
}

float* HostTable::AllocateRowLocked(Shard& s) const {
  uint64_t block, offset;
  BlockOf(s.rows, &block, &offset);
  if (block >= s.blocks.size()) AddBlockLocked(s);
  if (row_file_) {
    // New rows fill a block in order: write each 256 KiB of them out as it
    // fills (and a block's tail when the next block starts), so that a
    // growing table's pages are clean and can leave memory as soon as it is
    // short, instead of staying dirty until the kernel's periodic writeback.
    constexpr uint64_t kWritebackBytes = 256 << 10;
    const uint64_t row_bytes = sizeof(float) * static_cast<uint64_t>(width_);
    const BlockDeleter& d = s.blocks[block].get_deleter();
    const uint64_t end = (offset + 1) * row_bytes;
    if (d.file && end / kWritebackBytes > offset * row_bytes / kWritebackBytes) {
      const uint64_t from = end / kWritebackBytes * kWritebackBytes - kWritebackBytes;
      row_file_->StartWriteback(d.offset + from, kWritebackBytes);
    }
    if (offset == 0 && block > 0) {
      const BlockDeleter& full = s.blocks[block - 1].get_deleter();
      if (full.file) {
        const uint64_t tail = full.bytes / kWritebackBytes * kWritebackBytes;
        if (tail < full.bytes) row_file_->StartWriteback(full.offset + tail, full.bytes - tail);
      }
    }
  }
  ++s.rows;
  return s.blocks[block].get() + offset * width_;
}

void HostTable::ReserveRowsLocked(Shard& s, uint64_t rows) const {
  // The blocks that rows [0, rows) fall in; of the last one only the pages
  // those rows use are touched (the rest faults in when reached, as without
  // a reservation).
  if (rows == 0) return;
  uint64_t last_block, last_offset;
  BlockOf(rows - 1, &last_block, &last_offset);
  while (s.blocks.size() <= last_block) AddBlockLocked(s);
  constexpr size_t kPage = 4096;
  for (uint64_t b = 0; b <= last_block; ++b) {
    // A block in the row file has its disk space already (RowFile::Map):
    // touching it would only make the kernel write zeros to the disk.
    if (s.blocks[b].get_deleter().file) continue;
    const uint64_t used = b < last_block ? BlockRows(b) : last_offset + 1;
    volatile char* p = reinterpret_cast<char*>(s.blocks[b].get());
    const size_t bytes = sizeof(float) * used * width_;
    // A write, not a read: a read would map the shared zero page.
    for (size_t off = 0; off < bytes; off += kPage) p[off] = 0;
    volatile char* c = reinterpret_cast<char*>(s.meta_blocks[b].get());
    for (size_t off = 0; off < sizeof(RowMeta) * used; off += kPage) c[off] = 0;
  }
}

template <typename Fn, typename BeforeShard>
void HostTable::ForEachByShard(const int64_t* ids, int64_t n, Fn fn, BeforeShard before_shard,
                               const Scheduler* schedule, int parts) const {
  if (n <= 0) return;
  const uint64_t num_shards = shard_mask_ + 1;
  std::vector<uint64_t> hashes(n);
  std::vector<uint32_t> start(num_shards + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = HashId(ids[i]);
    ++start[ShardIndex(hashes[i]) + 1];
  }
  for (uint64_t k = 0; k < num_shards; ++k) start[k + 1] += start[k];
  // Counting sort by shard, keeping the input order within a shard (so a
  // repeated id is handled in input order).
  std::vector<uint32_t> order(n);
  {
    std::vector<uint32_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[next[ShardIndex(hashes[i])]++] = i;
  }
  constexpr uint32_t kAhead = 8;
  const auto visit = [&](uint64_t first, uint64_t last) {
    for (uint64_t k = first; k < last; ++k) {
      const uint32_t lo = start[k], hi = start[k + 1];
      if (lo == hi) continue;
      Shard& s = shards_[k];
      std::lock_guard<std::mutex> lock(s.mu);
      before_shard(s, hi - lo);
      for (uint32_t j = lo; j < hi; ++j) {
        if (j + kAhead < hi && !s.entries.empty()) {
          __builtin_prefetch(&s.entries[HomeOf(hashes[order[j + kAhead]], s.entries.size())]);
        }
        const uint32_t i = order[j];
        fn(static_cast<int64_t>(i), s, hashes[i]);
      }
    }
  };
  const uint64_t num_parts = std::min<uint64_t>(std::max(parts, 1), num_shards);
  if (schedule == nullptr || num_parts <= 1) {
    visit(0, num_shards);
    return;
  }
  // Ranges of whole shards (ids spread evenly over the shards).
  RunShards(schedule, static_cast<int64_t>(num_parts), static_cast<int64_t>(num_parts) - 1,
            [&](int64_t part) {
              const uint64_t p = static_cast<uint64_t>(part);
              visit(num_shards * p / num_parts, num_shards * (p + 1) / num_parts);
            });
}

HostTable::Entry* HostTable::Locate(Shard& s, int64_t id, uint64_t hash) const {
  const uint64_t size = s.entries.size();
  if (size == 0) return nullptr;
  for (uint64_t pos = HomeOf(hash, size);; pos = pos + 1 == size ? 0 : pos + 1) {
    Entry& e = s.entries[pos];
    if (e.row == kEmptyRow) return nullptr;
    if (e.id == id) return &e;
  }
}

void HostTable::GrowLocked(Shard& s, uint64_t want) const {
  // Small indexes grow by 3/2, large ones by 5/4: a large index is most of
  // the table's overhead, and right after growing by g its load is only
  // 13/16 / g (54% for 3/2, 65% for 5/4). Rehashing more often costs little
  // next to an insert's cache misses.
  //
  // Large sizes lie on a grid of steps of 5/4 that is offset per shard:
  // shard k's sizes are kFineGrowthEntries * (5/4)^(j + k / num_shards).
  // Ids spread evenly over the shards, so on one common grid every shard
  // filled up during the same insert call and all of them rehashed at once:
  // at 100M rows one call moved all ~100M index entries and the calls
  // around it none. Offset, the shards take turns, and the cost of growing
  // is spread evenly over the inserts (bench/scale.py).
  const double phase = static_cast<double>(&s - shards_.get()) /
                       static_cast<double>(shard_mask_ + 1);
  const auto next = [phase](size_t size) -> size_t {
    if (size < kFineGrowthEntries) return size * 3 / 2;
    // The smallest grid size at least 9/8 of this one: 5/4 of it when it
    // is on the grid (the first large step lands on it from the 3/2 steps).
    const double at_least = static_cast<double>(size) * 1.125;
    const double j = std::ceil(
        std::log(at_least / kFineGrowthEntries) / std::log(1.25) - phase);
    const double grid = kFineGrowthEntries * std::pow(1.25, j + phase);
    return std::max<size_t>(size + 1, static_cast<size_t>(std::ceil(grid)));
  };
  size_t new_size = s.entries.empty() ? kInitialEntries : next(s.entries.size());
  while (want * kMaxLoadDen > new_size * kMaxLoadNum) new_size = next(new_size);
  // The new index is allocated and filled before it replaces the old one:
  // without the memory for it (std::bad_alloc), the shard keeps its index.
  std::vector<Entry, LargeAllocator<Entry>> grown(new_size, Entry{0, kEmptyRow});
  for (const Entry& e : s.entries) {
    if (e.row == kEmptyRow) continue;
    uint64_t pos = HomeOf(HashId(e.id), new_size);
    while (grown[pos].row != kEmptyRow) pos = pos + 1 == new_size ? 0 : pos + 1;
    grown[pos] = e;
  }
  s.entries.swap(grown);
}

HostTable::Entry* HostTable::InsertLocked(Shard& s, int64_t id,
                                          uint64_t hash) const {
  // Both allocations (a larger index, a new row block) leave the shard as it
  // was when they fail: the id is then simply not inserted.
  if ((static_cast<uint64_t>(s.used) + 1) * kMaxLoadDen >
      s.entries.size() * kMaxLoadNum) {
    GrowLocked(s, s.used + 1);
  }
  const uint64_t size = s.entries.size();
  uint64_t pos = HomeOf(hash, size);
  while (s.entries[pos].row != kEmptyRow) pos = pos + 1 == size ? 0 : pos + 1;
  uint32_t row;
  if (!s.free_rows.empty()) {  // a pruned id's row
    row = s.free_rows.back();
    s.free_rows.pop_back();
  } else {
    row = s.rows;
    AllocateRowLocked(s);
  }
  MetaOf(s, row) = RowMeta{0, kChanged};  // a new row is a change
  s.entries[pos] = Entry{id, row};
  ++s.used;
  ++s.generation;
  return &s.entries[pos];
}

// A batch read from memory takes well under a microsecond per row (a few
// cache misses); one from the disk, tens of microseconds or more.
constexpr double kDiskSecondsPerRow = 2e-6;
constexpr int64_t kTimedReadRows = 64;  // smaller reads say too little

void HostTable::AdviseRowLocked(const Shard& s, uint32_t row) const {
  uint64_t block, offset;
  BlockOf(row, &block, &offset);
  const BlockDeleter& d = s.blocks[block].get_deleter();
  if (!d.file) return;  // a small block, in memory
  const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(width_);
  row_file_->WillNeed(d.offset + offset * bytes, bytes);
}

bool HostTable::SampledRowsOnDisk(const int64_t* ids, int64_t n) const {
  if (!row_file_) return false;
  // A few rows spread over the batch: is the page of any of them not in
  // memory? (mincore: one system call each, a few microseconds in all.)
  constexpr int64_t kSamples = 8;
  const int64_t step = std::max<int64_t>(1, n / kSamples);
  for (int64_t i = 0; i < n; i += step) {
    const uint64_t h = HashId(ids[i]);
    Shard& s = shards_[ShardIndex(h)];
    std::lock_guard<std::mutex> lock(s.mu);
    const Entry* e = Locate(s, ids[i], h);
    if (e == nullptr) continue;
    uint64_t block, offset;
    BlockOf(e->row, &block, &offset);
    if (!s.blocks[block].get_deleter().file) continue;
    if (!row_file_->Resident(RowPtr(s, e->row))) return true;
  }
  return false;
}

void HostTable::AdviseReads(const int64_t* ids, int64_t n) const {
  if (!row_file_ || n <= 0) return;
  if (!rows_on_disk_.load(std::memory_order_relaxed) && !SampledRowsOnDisk(ids, n)) return;
  ForEachByShard(ids, n, [&](int64_t i, Shard& s, uint64_t h) {
    if (const Entry* e = Locate(s, ids[i], h)) AdviseRowLocked(s, e->row);
  });
}

void HostTable::NoteReadTime(int64_t n, double seconds) const {
  if (row_file_ && n >= kTimedReadRows) {
    rows_on_disk_.store(seconds > kDiskSecondsPerRow * static_cast<double>(n),
                        std::memory_order_relaxed);
  }
}

namespace {
double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

void HostTable::Find(const int64_t* ids, int64_t n, float* out, bool values_only,
                     const Scheduler* schedule, int threads) const {
  AdviseReads(ids, n);
  const auto t0 = std::chrono::steady_clock::now();
  OnExit timed{[&] { NoteReadTime(n, SecondsSince(t0)); }};
  const int64_t cols = values_only ? options_.dim : width_;
  // Each id's output row is its own: the parts write disjoint memory.
  const int parts = n >= kParallelFindIds ? std::max(threads, 1) : 1;
  ForEachByShard(
      ids, n,
      [&](int64_t i, Shard& s, uint64_t h) {
        float* dst = out + i * cols;
        const Entry* e = Locate(s, ids[i], h);
        if (e != nullptr) {
          std::memcpy(dst, RowPtr(s, e->row), sizeof(float) * cols);
        } else if (values_only) {
          initializer_.Fill(ids[i], options_.dim, dst);
        } else {
          InitialRow(ids[i], dst);
        }
      },
      [](Shard&, uint32_t) {}, schedule, parts);
}

int64_t HostTable::CountMissing(const int64_t* ids, int64_t n) const {
  std::unordered_set<int64_t> missing;
  ForEachByShard(ids, n, [&](int64_t i, Shard& s, uint64_t h) {
    if (Locate(s, ids[i], h) == nullptr) missing.insert(ids[i]);
  });
  return static_cast<int64_t>(missing.size());
}

CoreStatus HostTable::Reserve(int64_t rows) {
  const int64_t limit = options_.max_rows;
  int64_t cur = reserved_.load();
  do {
    if (limit > 0 && cur + rows > limit) {
      return CoreStatus::ResourceExhausted(
          "host table is full: it holds " + std::to_string(size()) +
          " rows, max_rows=" + std::to_string(limit) + ", and this call needs " +
          std::to_string(rows) +
          " new rows; raise max_rows (or leave it None for an unbounded "
          "table), or remove rarely used rows first (layer.prune, or the "
          "tf_sfctr.callbacks.PruneHostTable callback). Nothing was changed.");
    }
  } while (!reserved_.compare_exchange_weak(cur, cur + rows));
  return CoreStatus::Ok();
}

void HostTable::Release(int64_t rows) { reserved_.fetch_sub(rows); }

CoreStatus HostTable::FindOrInsertReserved(const int64_t* ids, int64_t n, float* out,
                                           int64_t reserved, uint32_t* use_counts,
                                           uint64_t* handles) {
  int64_t inserted = 0, done = 0;
  AdviseReads(ids, n);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    OnExit timed{[&] { NoteReadTime(done, SecondsSince(t0)); }};
    // Rows count as they are inserted, and what the call did not use of its
    // reservation (another writer may have inserted some of these ids
    // first) goes back, also when it runs out of memory half-way.
    // (Correctness needs only reserved_ >= size_.)
    OnExit account{[&] {
      size_.fetch_add(inserted);
      if (reserved > inserted) Release(reserved - inserted);
    }};
    ForEachByShard(ids, n, [&](int64_t i, Shard& s, uint64_t h) {
      float* dst = out + i * width_;
      const Entry* e = Locate(s, ids[i], h);
      uint32_t row;
      if (e != nullptr) {
        row = e->row;
        std::memcpy(dst, RowPtr(s, row), sizeof(float) * width_);
        if (use_counts != nullptr) use_counts[i] = CountOf(s, row);
      } else {
        row = InsertLocked(s, ids[i], h)->row;
        float* fresh = RowPtr(s, row);
        InitialRow(ids[i], fresh);
        std::memcpy(dst, fresh, sizeof(float) * width_);
        if (use_counts != nullptr) use_counts[i] = 0;
        ++inserted;
      }
      if (handles != nullptr) handles[i] = MakeHandle(ShardIndex(h), row);
      ++done;
    });
  } catch (const std::bad_alloc&) {
    return OutOfMemory("The fetch stopped after " + std::to_string(done) + " of its " +
                       std::to_string(n) + " ids; " + std::to_string(inserted) +
                       " new ids got host rows (their initial values) before that.");
  }
  return CoreStatus::Ok();
}

CoreStatus HostTable::Write(const int64_t* ids, int64_t n, const float* rows,
                            const uint32_t* add_counts, bool mark_changed) {
  int64_t inserted = 0, stored = 0;
  try {
    std::shared_lock<std::shared_mutex> no_prune(prune_mu_);
    const int64_t need = options_.max_rows > 0 ? CountMissing(ids, n) : n;
    CoreStatus st = Reserve(need);
    if (!st.ok()) return st;
    // Inserted rows count, and the unused reservation goes back, also when
    // the call runs out of memory half-way.
    OnExit account{[&] {
      size_.fetch_add(inserted);
      if (need > inserted) Release(need - inserted);
    }};
    // A batch larger than what a shard holds is mostly new ids (a restore, a
    // bulk load): size the index for it first. Growing step by step while
    // ids arrive in index order (as a checkpoint exports them) would pack
    // them into the front of each smaller index, with long probe runs.
    auto presize = [this](Shard& s, uint32_t count) {
      if (count > s.used && (static_cast<uint64_t>(s.used) + count) * kMaxLoadDen >
                                s.entries.size() * kMaxLoadNum) {
        GrowLocked(s, static_cast<uint64_t>(s.used) + count);
      }
    };
    AdviseReads(ids, n);  // a write to a page on disk reads it first
    ForEachByShard(ids, n, [&](int64_t i, Shard& s, uint64_t h) {
      Entry* e = Locate(s, ids[i], h);
      if (e == nullptr) {
        e = InsertLocked(s, ids[i], h);
        ++inserted;
      }
      std::memcpy(RowPtr(s, e->row), rows + i * width_, sizeof(float) * width_);
      if (add_counts != nullptr) AddSaturating(s, e->row, add_counts[i]);
      if (mark_changed && (add_counts == nullptr || add_counts[i] > 0)) {
        MetaOf(s, e->row).changed = kChanged;
      }
      ++stored;
    }, presize);
  } catch (const std::bad_alloc&) {
    return OutOfMemory(
        "The write stopped after storing " + std::to_string(stored) + " of its " +
        std::to_string(n) + " rows (" + std::to_string(inserted) +
        " of them new ids); those rows are complete and the others unchanged, so the "
        "same call repeated once memory is free stores them all.");
  }
  return CoreStatus::Ok();
}

CoreStatus HostTable::OutOfMemory(const std::string& outcome) const {
  const double mb = static_cast<double>(AllocatedBytes()) / (1 << 20);
  // Called in the handler of the allocation's std::bad_alloc: a DiskFull
  // one came from the row file.
  if (row_file_ && HandlingDiskFull()) {
    const double on_file = static_cast<double>(row_file_->mapped_bytes()) / (1 << 20);
    return CoreStatus::ResourceExhausted(
        "out of disk space: " + Describe() + " (" + std::to_string(size()) + " rows of " +
        std::to_string(width_) + " floats) keeps its rows in a file in host_rows_dir '" +
        options_.rows_dir + "', which holds " +
        std::to_string(static_cast<int64_t>(on_file + 0.5)) +
        " MB of rows, and that disk has no room for more. " + outcome +
        " Every row stored before is intact. Free space on that disk (or give host_rows_dir "
        "a larger one) and retry, or bound the table with max_rows and remove rarely used "
        "ids with prune.");
  }
  const std::string file =
      row_file_ ? " (its row blocks live in a file in host_rows_dir '" + options_.rows_dir +
                      "')"
                : "";
  return CoreStatus::ResourceExhausted(
      "out of host memory: " + Describe() + " (" + std::to_string(size()) + " rows of " +
      std::to_string(width_) + " floats, " + std::to_string(static_cast<int64_t>(mb + 0.5)) +
      " MB of indexes and row blocks) could not get memory for more rows" + file + ". " +
      outcome +
      " Every row stored before is intact. Give the process more memory, or bound the "
      "table with max_rows (new ids past it then fail before memory runs out) and remove "
      "rarely used ids with prune.");
}

void HostTable::WriteRows(const uint64_t* handles, int64_t n, const float* rows,
                          const uint32_t* add_counts) {
  if (n <= 0) return;
  // Grouped by shard (one lock per shard), in input order within a shard.
  const uint64_t num_shards = shard_mask_ + 1;
  std::vector<uint32_t> start(num_shards + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++start[((handles[i] - 1) >> 32) + 1];
  for (uint64_t k = 0; k < num_shards; ++k) start[k + 1] += start[k];
  std::vector<uint32_t> order(n);
  {
    std::vector<uint32_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[next[(handles[i] - 1) >> 32]++] = i;
  }
  for (uint64_t k = 0; k < num_shards; ++k) {
    if (start[k] == start[k + 1]) continue;
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    if (row_file_ && rows_on_disk_.load(std::memory_order_relaxed)) {
      // A write to a page on disk reads it first: start those reads at once.
      for (uint32_t j = start[k]; j < start[k + 1]; ++j) {
        AdviseRowLocked(s, static_cast<uint32_t>(handles[order[j]] - 1));
      }
    }
    constexpr uint32_t kAhead = 8;
    for (uint32_t j = start[k]; j < start[k + 1]; ++j) {
      if (j + kAhead < start[k + 1]) {
        const uint32_t ahead = static_cast<uint32_t>(handles[order[j + kAhead]] - 1);
        const char* p = reinterpret_cast<const char*>(RowPtr(s, ahead));
        for (size_t b = 0; b < sizeof(float) * width_; b += 64) __builtin_prefetch(p + b, 1);
        __builtin_prefetch(p + sizeof(float) * width_ - 1, 1);
        __builtin_prefetch(&CountOf(s, ahead), 1);
      }
      const uint32_t i = order[j];
      const uint32_t row = static_cast<uint32_t>(handles[i] - 1);
      std::memcpy(RowPtr(s, row), rows + static_cast<int64_t>(i) * width_,
                  sizeof(float) * width_);
      if (add_counts != nullptr) {
        AddSaturating(s, row, add_counts[i]);
        if (add_counts[i] > 0) MetaOf(s, row).changed = kChanged;
      } else {
        MetaOf(s, row).changed = kChanged;
      }
    }
  }
}

CoreStatus HostTable::AssignValues(const int64_t* ids, int64_t n,
                                   const float* values) {
  const int dim = options_.dim;
  std::vector<float> rows;
  try {
    rows.resize(static_cast<size_t>(n) * width_);
  } catch (const std::bad_alloc&) {
    return OutOfMemory("Nothing was changed (the " + std::to_string(n) +
                       " rows to assign did not fit).");
  }
  for (int64_t i = 0; i < n; ++i) {
    float* row = rows.data() + i * width_;
    std::memcpy(row, values + i * dim, sizeof(float) * dim);
    for (int s = 0; s < options_.num_state; ++s) {
      std::fill(row + dim * (s + 1), row + dim * (s + 2),
                options_.state_init[s]);
    }
  }
  return Write(ids, n, rows.data());
}

void HostTable::AddSaturating(const Shard& s, uint32_t row, uint32_t count) const {
  uint16_t& c = CountOf(s, row);
  const uint64_t sum = static_cast<uint64_t>(c) + count;
  c = static_cast<uint16_t>(sum > kMaxCount ? kMaxCount : sum);
}

void HostTable::MarkChanged(int64_t id) {
  std::shared_lock<std::shared_mutex> no_prune(prune_mu_);
  const uint64_t h = HashId(id);
  Shard& s = shards_[ShardIndex(h)];
  std::lock_guard<std::mutex> lock(s.mu);
  Entry* e = Locate(s, id, h);
  if (e != nullptr) MetaOf(s, e->row).changed = kChanged;
}

void HostTable::AddUseCounts(const int64_t* ids, int64_t n,
                             const uint32_t* counts, bool mark_changed) {
  ForEachByShard(ids, n, [&](int64_t i, Shard& s, uint64_t h) {
    Entry* e = Locate(s, ids[i], h);
    if (e == nullptr) return;
    AddSaturating(s, e->row, counts[i]);
    if (mark_changed && counts[i] > 0) MetaOf(s, e->row).changed = kChanged;
  });
}

void HostTable::Export(std::vector<int64_t>* ids, std::vector<float>* rows,
                       std::vector<uint32_t>* counts) const {
  ids->clear();
  rows->clear();
  counts->clear();
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    for (const Entry& e : s.entries) {
      if (e.row == kEmptyRow) continue;
      ids->push_back(int64_t{e.id});  // a copy: Entry is packed, e.id may be misaligned
      counts->push_back(CountOf(s, e.row));
      const float* src = RowPtr(s, e.row);
      rows->insert(rows->end(), src, src + width_);
    }
  }
}

void HostTable::SettleExported(const std::vector<uint64_t>& marked, bool delivered) const {
  size_t i = 0;
  while (i < marked.size()) {
    const uint64_t k = marked[i] >> 32;
    const Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    for (; i < marked.size() && (marked[i] >> 32) == k; ++i) {
      RowMeta& meta = MetaOf(s, static_cast<uint32_t>(marked[i]));
      if (meta.changed == kExporting) meta.changed = delivered ? 0 : kChanged;
    }
  }
}

void HostTable::ExportRange(uint64_t* cursor, int64_t max_rows, std::vector<int64_t>* ids,
                            std::vector<float>* rows, std::vector<int64_t>* counts,
                            bool changed_only, const std::function<bool()>& deliver) const {
  // The changed_only rows of this part, marked kExporting (in shard order).
  std::vector<uint64_t> marked;
  bool delivered = false;
  try {
    uint64_t next = *cursor;
    ExportRangeLocked(&next, max_rows, ids, rows, counts, changed_only, &marked);
    delivered = !deliver || deliver();
    if (delivered) *cursor = next;
  } catch (...) {
    SettleExported(marked, /*delivered=*/false);
    throw;
  }
  SettleExported(marked, delivered);
}

void HostTable::ExportRangeLocked(uint64_t* cursor, int64_t max_rows,
                                  std::vector<int64_t>* ids, std::vector<float>* rows,
                                  std::vector<int64_t>* counts, bool changed_only,
                                  std::vector<uint64_t>* marked) const {
  // The cursor is (shard << 40 | arena row): parts follow each shard's arena
  // in row order, which is the order of its blocks in memory and, with a row
  // file, on the disk, so a table on file is read sequentially.
  constexpr int kRowBits = 40;
  constexpr uint64_t kRowMask = (uint64_t{1} << kRowBits) - 1;
  if (*cursor == kNoMoreRows) return;
  uint64_t k = *cursor >> kRowBits;
  uint64_t r0 = *cursor & kRowMask;
  const uint64_t want = static_cast<uint64_t>(std::max<int64_t>(1, max_rows));
  uint64_t got = 0;
  while (k <= shard_mask_ && got < want) {
    const Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    if (r0 >= s.rows) {
      ++k;
      r0 = 0;
      continue;
    }
    const uint64_t r1 = std::min<uint64_t>(s.rows, r0 + (want - got));
    if (row_file_) {
      // Start reading the range's pages from the disk at once, block by
      // block (the mapping reads a page per fault otherwise: MADV_RANDOM).
      const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(width_);
      for (uint64_t r = r0; r < r1;) {
        uint64_t block, offset;
        BlockOf(r, &block, &offset);
        const uint64_t n = std::min<uint64_t>(r1 - r, BlockRows(block) - offset);
        const BlockDeleter& d = s.blocks[block].get_deleter();
        if (d.file) row_file_->WillNeed(d.offset + offset * bytes, n * bytes);
        r += n;
      }
    }
    // Which id holds each row (rows of pruned ids hold none): one scan of
    // the shard's index serves all of its parts.
    std::lock_guard<std::mutex> map_lock(export_mu_);
    ExportMap& m = export_map_;
    if (m.shard != k || r0 == 0 || m.generation != s.generation) {
      m.shard = ~uint64_t{0};  // (not valid until filled: assign may throw)
      m.ids.assign(s.rows, 0);
      m.held.assign(s.rows, 0);
      for (const Entry& e : s.entries) {
        if (e.row == kEmptyRow) continue;
        m.ids[e.row] = e.id;
        m.held[e.row] = 1;
      }
      m.shard = k;
      m.generation = s.generation;
    }
    if (changed_only) marked->reserve(marked->size() + (r1 - r0));  // (marking cannot throw)
    for (uint64_t r = r0; r < r1; ++r) {
      if (!m.held[r]) continue;
      RowMeta& meta = MetaOf(s, static_cast<uint32_t>(r));
      if (changed_only && meta.changed != kChanged) continue;
      ids->push_back(m.ids[r]);
      counts->push_back(meta.count);
      const float* src = RowPtr(s, static_cast<uint32_t>(r));
      rows->insert(rows->end(), src, src + width_);
      if (changed_only) {  // after the copies, which may throw (the shard's lock is held)
        meta.changed = kExporting;
        marked->push_back(k << 32 | r);
      }
    }
    got += r1 - r0;
    r0 = r1;
  }
  *cursor = k > shard_mask_ ? kNoMoreRows : (k << kRowBits | r0);
  if (*cursor == kNoMoreRows) {  // the last part: the map's memory goes back
    std::lock_guard<std::mutex> map_lock(export_mu_);
    export_map_ = ExportMap();
  }
}

int64_t HostTable::Prune(uint32_t min_count, const std::unordered_set<int64_t>& keep,
                         double decay) {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  return PruneLocked([min_count](uint32_t count, int64_t) { return count < min_count; }, keep,
                     decay);
}

int64_t HostTable::PruneToSize(int64_t max_rows, const std::unordered_set<int64_t>& keep,
                               uint32_t* min_count, double decay) {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  *min_count = 0;
  // Rows per use count, of the ids that may go.
  int64_t held = 0;
  const std::vector<int64_t> per_count = UseCountHistogramLocked(keep, &held);
  int64_t excess = held - std::max<int64_t>(max_rows, 0);
  if (excess <= 0) {
    if (decay >= 1.0) return 0;
    return PruneLocked([](uint32_t, int64_t) { return false; }, keep, decay);
  }
  // Every id used fewer than `below` times goes, and `ties` of those used
  // exactly `below` times: the ones with the smallest ids.
  uint32_t below = 0;
  while (below <= kMaxCount && per_count[below] <= excess) {
    excess -= per_count[below];
    ++below;
  }
  // The most used count that goes, plus one (0 if none does).
  const auto most_used_below = [&per_count](uint32_t limit) -> uint32_t {
    for (uint32_t c = limit; c > 0; --c) {
      if (per_count[c - 1] > 0) return c;
    }
    return 0;
  };
  if (below > kMaxCount || excess == 0) {
    *min_count = most_used_below(below);
    return PruneLocked([below](uint32_t count, int64_t) { return count < below; }, keep,
                       decay);
  }
  std::vector<int64_t> tied =
      TiedIdsLocked(below, keep, static_cast<size_t>(per_count[below]));
  // (Counts added meanwhile, by a restore's HostAddCounts, can leave fewer.)
  if (tied.empty()) {
    *min_count = most_used_below(below);
    return PruneLocked([below](uint32_t count, int64_t) { return count < below; }, keep,
                       decay);
  }
  const size_t nth = std::min(tied.size(), static_cast<size_t>(excess)) - 1;
  std::nth_element(tied.begin(), tied.begin() + nth, tied.end());
  const int64_t last = tied[nth];
  *min_count = below + 1;
  return PruneLocked(
      [below, last](uint32_t count, int64_t id) {
        return count < below || (count == below && id <= last);
      },
      keep, decay);
}

std::vector<int64_t> HostTable::UseCountHistogramLocked(
    const std::unordered_set<int64_t>& keep, int64_t* held) const {
  std::vector<int64_t> per_count(size_t{kMaxCount} + 1, 0);
  *held = 0;
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    const Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    for (const Entry& e : s.entries) {
      if (e.row == kEmptyRow) continue;
      ++*held;
      if (keep.count(int64_t{e.id}) == 0) ++per_count[CountOf(s, e.row)];
    }
  }
  return per_count;
}

std::vector<int64_t> HostTable::TiedIdsLocked(uint32_t count,
                                              const std::unordered_set<int64_t>& keep,
                                              size_t expected) const {
  std::vector<int64_t> tied;
  tied.reserve(expected);
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    const Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    for (const Entry& e : s.entries) {
      if (e.row != kEmptyRow && CountOf(s, e.row) == count && keep.count(int64_t{e.id}) == 0)
        tied.push_back(int64_t{e.id});  // a copy: Entry is packed
    }
  }
  return tied;
}

std::vector<int64_t> HostTable::UseCountHistogram(const std::unordered_set<int64_t>& keep,
                                                  int64_t* held) const {
  std::shared_lock<std::shared_mutex> no_prune(prune_mu_);
  return UseCountHistogramLocked(keep, held);
}

std::vector<int64_t> HostTable::TiedIds(uint32_t count,
                                        const std::unordered_set<int64_t>& keep) const {
  std::shared_lock<std::shared_mutex> no_prune(prune_mu_);
  std::vector<int64_t> tied = TiedIdsLocked(count, keep, 0);
  std::sort(tied.begin(), tied.end());
  return tied;
}

int64_t HostTable::PruneBelow(uint32_t below, bool has_last, int64_t last,
                              const std::unordered_set<int64_t>& keep, double decay) {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  if (!has_last) {
    return PruneLocked([below](uint32_t count, int64_t) { return count < below; }, keep,
                       decay);
  }
  return PruneLocked(
      [below, last](uint32_t count, int64_t id) {
        return count < below || (count == below && id <= last);
      },
      keep, decay);
}

bool HostTable::EraseLocked(Shard& s, int64_t id, uint64_t hash) {
  const uint64_t size = s.entries.size();
  if (size == 0) return false;
  const auto next = [size](uint64_t pos) { return pos + 1 == size ? 0 : pos + 1; };
  uint64_t hole = HomeOf(hash, size);
  for (;; hole = next(hole)) {
    const Entry& e = s.entries[hole];
    if (e.row == kEmptyRow) return false;
    if (e.id == id) break;
  }
  const uint32_t row = s.entries[hole].row;
  // An entry after the hole in the same run moves into it unless its home
  // lies cyclically in (hole, j]: it would then be found before the hole.
  for (uint64_t j = next(hole);; j = next(j)) {
    const Entry e = s.entries[j];
    if (e.row == kEmptyRow) break;
    const uint64_t home = HomeOf(HashId(e.id), size);
    const bool reachable = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!reachable) {
      s.entries[hole] = e;
      hole = j;
    }
  }
  s.entries[hole] = Entry{0, kEmptyRow};
  s.free_rows.push_back(row);  // the caller reserved room
  --s.used;
  return true;
}

int64_t HostTable::Remove(const int64_t* ids, int64_t n) {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  int64_t removed = 0;
  // Room on every shard's free list first, for each of its ids: the pass
  // that removes then allocates nothing but ForEachByShard's own scratch,
  // which comes before it visits any shard.
  ForEachByShard(
      ids, n, [](int64_t, Shard&, uint64_t) {},
      [this](Shard& s, uint32_t count) {
        s.free_rows.reserve(s.free_rows.size() + count);
        ReserveRemovalLogLocked(s, count);
      });
  ForEachByShard(
      ids, n,
      [this, ids, &removed](int64_t i, Shard& s, uint64_t hash) {
        if (EraseLocked(s, ids[i], hash)) {
          ++removed;
          ++s.generation;
          if (log_removals_) s.removed.push_back(ids[i]);  // (room reserved above)
        }
      });
  size_.fetch_sub(removed);
  reserved_.fetch_sub(removed);
  return removed;
}

template <typename ShouldGo>
int64_t HostTable::PruneLocked(ShouldGo remove, const std::unordered_set<int64_t>& keep,
                               double decay) {
  int64_t removed = 0;
  std::vector<Entry> kept;
  std::vector<uint32_t> freed;
  std::vector<int64_t> freed_ids;
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    // What can run out of memory (std::bad_alloc) comes before the shard
    // changes: a prune that stops early leaves each shard pruned or as it
    // was, and the counts right.
    kept.clear();
    freed.clear();
    freed_ids.clear();
    kept.reserve(s.used);
    freed.reserve(s.used);
    if (log_removals_) {
      try {
        freed_ids.reserve(s.used);
      } catch (const std::bad_alloc&) {
        StopLoggingRemovalsLocked();  // logging never fails the prune
      }
    }
    for (const Entry& e : s.entries) {
      if (e.row == kEmptyRow) continue;
      if (remove(CountOf(s, e.row), int64_t{e.id}) && keep.count(int64_t{e.id}) == 0) {
        freed.push_back(e.row);
        if (log_removals_) freed_ids.push_back(int64_t{e.id});
      } else {
        kept.push_back(e);
      }
    }
    const size_t gone = freed.size();
    if (gone > 0) s.free_rows.insert(s.free_rows.end(), freed.begin(), freed.end());  // all or nothing
    if (decay < 1.0) {
      // Nothing below can throw: the shard is decayed only if its removals
      // happen too.
      for (const Entry& e : kept) {
        uint16_t& c = CountOf(s, e.row);
        c = static_cast<uint16_t>(std::floor(static_cast<double>(c) * decay));
      }
    }
    if (gone == 0) continue;
    ReserveRemovalLogLocked(s, gone);
    if (log_removals_) s.removed.insert(s.removed.end(), freed_ids.begin(), freed_ids.end());
    // Rebuild the index at its size: deleting from a linear-probing index
    // in place would have to move later entries of each probe run back.
    const uint64_t size = s.entries.size();
    std::fill(s.entries.begin(), s.entries.end(), Entry{0, kEmptyRow});
    for (const Entry& e : kept) {
      uint64_t pos = HomeOf(HashId(e.id), size);
      while (s.entries[pos].row != kEmptyRow) pos = pos + 1 == size ? 0 : pos + 1;
      s.entries[pos] = e;
    }
    s.used = static_cast<uint32_t>(kept.size());
    ++s.generation;
    size_.fetch_sub(static_cast<int64_t>(gone));
    reserved_.fetch_sub(static_cast<int64_t>(gone));
    removed += static_cast<int64_t>(gone);
  }
  return removed;
}

void HostTable::ReserveRemovalLogLocked(Shard& s, size_t n) {
  if (!log_removals_) return;
  try {
    s.removed.reserve(s.removed.size() + n);
  } catch (const std::bad_alloc&) {
    StopLoggingRemovalsLocked();
  }
}

void HostTable::StopLoggingRemovalsLocked() {
  log_removals_ = false;
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    std::vector<int64_t>().swap(shards_[k].removed);
  }
}

bool HostTable::TakeRemoved(std::vector<int64_t>* removed,
                            const std::function<bool(const std::vector<int64_t>&)>& deliver) {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  removed->clear();
  if (!log_removals_) {
    // Removals before now are unknown: the next changed_only export is the
    // whole table instead.
    for (uint64_t k = 0; k <= shard_mask_; ++k) {
      Shard& s = shards_[k];
      std::lock_guard<std::mutex> lock(s.mu);
      for (const Entry& e : s.entries) {
        if (e.row != kEmptyRow) MetaOf(s, e.row).changed = kChanged;
      }
    }
    log_removals_ = true;
    return false;
  }
  size_t total = 0;
  for (uint64_t k = 0; k <= shard_mask_; ++k) total += shards_[k].removed.size();
  removed->reserve(total);  // (out of memory: the logs stay as they are)
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    for (const int64_t id : s.removed) {
      if (Locate(s, id, HashId(id)) == nullptr) removed->push_back(id);  // not back since
    }
  }
  // An id removed, stored again and removed again is logged twice.
  std::sort(removed->begin(), removed->end());
  removed->erase(std::unique(removed->begin(), removed->end()), removed->end());
  if (deliver && !deliver(*removed)) return true;
  for (uint64_t k = 0; k <= shard_mask_; ++k) std::vector<int64_t>().swap(shards_[k].removed);
  return true;
}

void HostTable::DropAllLocked() {
  // The table is replaced (a restore) or released: its removals are not
  // followed.
  StopLoggingRemovalsLocked();
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    decltype(s.entries)().swap(s.entries);
    s.blocks.clear();
    decltype(s.meta_blocks)().swap(s.meta_blocks);
    decltype(s.free_rows)().swap(s.free_rows);
    s.used = 0;
    s.rows = 0;
    ++s.generation;
  }
}

void HostTable::Release() {
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  DropAllLocked();
  reserved_.fetch_sub(size_.exchange(0));
  // The blocks held the other references: the file closes here.
  row_file_.reset();
}

void HostTable::Clear() {
  // A writer between its reservation and its count would add rows this
  // clear dropped back onto size_ (a review: 1M rows counted, 172k held).
  std::unique_lock<std::shared_mutex> no_writes(prune_mu_);
  DropAllLocked();
  // Every shard's memory (and row file space) is free before any is sized
  // again: the row file then starts over instead of growing.
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    // The estimate is only a hint here: without the memory, the index grows
    // as usual instead (a clear must not fail half-way).
    try {
      PresizeLocked(s);
    } catch (const std::bad_alloc&) {
      decltype(s.entries)().swap(s.entries);
      s.blocks.clear();
      s.meta_blocks.clear();
      s.rows = 0;
    }
  }
  reserved_.fetch_sub(size_.exchange(0));
}

void HostTable::SetInitSeed(uint64_t seed) { initializer_.set_seed(seed); }

std::vector<size_t> HostTable::IndexEntries() const {
  std::vector<size_t> sizes(shard_mask_ + 1);
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    std::lock_guard<std::mutex> lock(shards_[k].mu);
    sizes[k] = shards_[k].entries.size();
  }
  return sizes;
}

size_t HostTable::AllocatedBytes() const {
  size_t bytes = 0;
  for (uint64_t k = 0; k <= shard_mask_; ++k) {
    Shard& s = shards_[k];
    std::lock_guard<std::mutex> lock(s.mu);
    bytes += s.entries.capacity() * sizeof(Entry);
    for (size_t b = 0; b < s.blocks.size(); ++b) {
      bytes += BlockRows(b) * (width_ * sizeof(float) + sizeof(RowMeta));
    }
  }
  return bytes;
}

}  // namespace sfctr
