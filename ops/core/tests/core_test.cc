// Unit tests of the TF-free core: initializer, host table, cache directory and
// the store that combines them. Built and run by `make test` (see Makefile).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <csignal>
#include <dirent.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include "../adagrad.h"
#include "../cache_directory.h"
#include "../dedup.h"
#include "../finite.h"
#include "../huge_pages.h"
#include "../ftrl.h"
#include "../embedding_store.h"
#include "../host_table.h"
#include "../initializer.h"
#include "../mix.h"
#include "../row_file.h"
#include "../parallel.h"
#include "../segment_sum.h"
#include "check.h"

using namespace sfctr;

// Failure injection for every operator new of this test binary: when
// g_fail_new_at is k >= 0, the allocation k + 1 from then on throws
// std::bad_alloc, once (the count drops to -1). Tests of the out-of-memory
// paths walk k over every allocation of a call. (The tables' own arrays are
// allocated with malloc or mmap, not operator new: AllocationHook in
// huge_pages.h injects failures there.)
static std::atomic<int64_t> g_fail_new_at{-1};

static void* CountedNew(size_t n) {
  if (g_fail_new_at.load(std::memory_order_relaxed) >= 0 &&
      g_fail_new_at.fetch_sub(1, std::memory_order_relaxed) == 0) {
    throw std::bad_alloc();
  }
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void* operator new(size_t n) { return CountedNew(n); }
void* operator new[](size_t n) { return CountedNew(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(n);
  } catch (...) {
    return nullptr;
  }
}
// Not inlined: GCC would otherwise see free() of what operator new returned
// (-Wmismatched-new-delete), which is right here.
__attribute__((noinline)) static void CountedDelete(void* p) noexcept { std::free(p); }

void operator delete(void* p) noexcept { CountedDelete(p); }
void operator delete[](void* p) noexcept { CountedDelete(p); }
void operator delete(void* p, size_t) noexcept { CountedDelete(p); }
void operator delete[](void* p, size_t) noexcept { CountedDelete(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { CountedDelete(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { CountedDelete(p); }

namespace {

HostTableOptions Options(int dim, int num_state, int64_t max_rows = 0) {
  HostTableOptions o;
  o.dim = dim;
  o.num_state = num_state;
  o.state_init.assign(num_state, 0.25f);
  o.init.kind = InitKind::kUniform;
  o.init.a = -0.5f;
  o.init.b = 0.5f;
  o.init.seed = 7;
  o.max_rows = max_rows;
  return o;
}

}  // namespace

TEST_CASE(InitializerIsDeterministicAndInRange) {
  for (auto kind : {InitKind::kUniform, InitKind::kNormal,
                    InitKind::kTruncatedNormal, InitKind::kConstant}) {
    InitializerSpec spec;
    spec.kind = kind;
    spec.a = kind == InitKind::kUniform ? -0.05f : 0.0f;
    spec.b = kind == InitKind::kUniform ? 0.05f : 1.0f;
    spec.seed = 3;
    RowInitializer init(spec);
    std::vector<float> a(64), b(64);
    init.Fill(123456789012345LL, 64, a.data());
    init.Fill(123456789012345LL, 64, b.data());
    CHECK(a == b);
    for (float v : a) {
      CHECK(std::isfinite(v));
      if (kind == InitKind::kUniform) CHECK(v >= -0.05f && v < 0.05f);
      if (kind == InitKind::kTruncatedNormal) CHECK(std::fabs(v) <= 2.0f);
      if (kind == InitKind::kConstant) CHECK_EQ(v, 0.0f);
    }
    if (kind != InitKind::kConstant) {
      init.Fill(123456789012346LL, 64, b.data());
      CHECK(a != b);  // neighbouring ids differ
      InitializerSpec other = spec;
      other.seed = 4;
      RowInitializer init2(other);
      init2.Fill(123456789012345LL, 64, b.data());
      CHECK(a != b);  // seeds differ
    }
  }
  // A uniform range whose a + span * u rounds to b for some u < 1: at
  // 2**24, where floats are 2 apart, about half of a + 2u would be b.
  {
    InitializerSpec coarse;
    coarse.kind = InitKind::kUniform;
    coarse.a = 16777216.0f;
    coarse.b = 16777218.0f;
    coarse.seed = 0;
    RowInitializer init(coarse);
    std::vector<float> row(1024);
    init.Fill(5, 1024, row.data());
    for (float v : row) CHECK(v >= coarse.a && v < coarse.b);
  }
  // Moments of the normal initializer over many ids.
  InitializerSpec spec;
  spec.kind = InitKind::kNormal;
  spec.a = 1.0f;
  spec.b = 2.0f;
  RowInitializer init(spec);
  double sum = 0, sq = 0;
  const int n = 20000;
  std::vector<float> row(4);
  for (int i = 0; i < n; ++i) {
    init.Fill(i, 4, row.data());
    for (float v : row) {
      sum += v;
      sq += v * v;
    }
  }
  const double mean = sum / (4.0 * n);
  const double var = sq / (4.0 * n) - mean * mean;
  CHECK(std::fabs(mean - 1.0) < 0.05);
  CHECK(std::fabs(std::sqrt(var) - 2.0) < 0.05);
}

// The initializer looks the column half of Mix2 up in a table of 512
// counters: rows wider than that, and every kind, give the values of the
// formulas written with Mix2 (a saved table's never-stored rows, and
// inference reads of them, must not change between versions). The uniform
// rows are also pinned by a hash of their bits (integer mixing and IEEE
// float arithmetic only, the same on every platform).
TEST_CASE(InitializerValuesFollowTheirFormulasPastTheCounterTable) {
  const int dim = 600;
  const int64_t ids[] = {0, -7, 123456789012345LL, std::numeric_limits<int64_t>::min()};
  auto normal_pair = [](uint64_t base, uint64_t counter, float* z0, float* z1) {
    const uint64_t stream = Mix2(base, counter);
    for (uint64_t k = 0;; ++k) {
      const uint64_t h = Mix2(stream, k);
      const float v1 = static_cast<float>(static_cast<int32_t>(h >> 32)) * (1.0f / 2147483648.0f);
      const float v2 = static_cast<float>(static_cast<int32_t>(h & 0xffffffffu)) *
                       (1.0f / 2147483648.0f);
      const float q = v1 * v1 + v2 * v2;
      if (q >= 1.0f || q == 0.0f) continue;
      const float f = std::sqrt(-2.0f * std::log(q) / q);
      *z0 = v1 * f;
      *z1 = v2 * f;
      return;
    }
  };
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the uniform rows' bits
  for (uint64_t seed : {0ULL, 42ULL}) {
    InitializerSpec uniform;
    uniform.seed = seed;
    InitializerSpec normal = uniform;
    normal.kind = InitKind::kNormal;
    normal.a = 0.5f;
    normal.b = 0.25f;
    std::vector<float> row(dim);
    for (int64_t id : ids) {
      const uint64_t base = Mix2(seed, static_cast<uint64_t>(id));
      RowInitializer(uniform).Fill(id, dim, row.data());
      const float top = std::nextafter(uniform.b, uniform.a);
      for (int j = 0; j < dim; ++j) {
        const float want = std::min(
            uniform.a + (uniform.b - uniform.a) * UnitFloat(Mix2(base, j)), top);
        CHECK_EQ(row[j], want);
        uint32_t bits;
        std::memcpy(&bits, &row[j], 4);
        hash = (hash ^ bits) * 1099511628211ULL;
      }
      RowInitializer(normal).Fill(id, dim, row.data());
      for (int j = 0; j < dim; j += 2) {
        float z0, z1;
        normal_pair(base, static_cast<uint64_t>(j / 2), &z0, &z1);
        CHECK_EQ(row[j], normal.a + normal.b * z0);
        CHECK_EQ(row[j + 1], normal.a + normal.b * z1);
      }
    }
  }
  CHECK_EQ(hash, 0xa50c0fe1784fe9ffULL);  // computed before the table existed
}

// Each column of a normal (or truncated normal) row follows the standard
// normal CDF, checked at several points over many ids (a two-sided bound of
// 5 binomial standard errors), and the two columns that share a sample
// position are uncorrelated, as are neighbouring pairs. An odd last column
// too.
TEST_CASE(NormalInitializerColumnsAreNormalAndIndependent) {
  const double points[] = {-2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5};
  const auto phi = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  for (auto kind : {InitKind::kNormal, InitKind::kTruncatedNormal}) {
    InitializerSpec spec;
    spec.kind = kind;
    spec.a = 0.0f;
    spec.b = 1.0f;
    spec.seed = 11;
    RowInitializer init(spec);
    const int n = 200000, dim = 5;
    std::vector<float> row(dim);
    std::vector<std::vector<int>> below(dim, std::vector<int>(std::size(points), 0));
    double s01 = 0, s12 = 0, s0 = 0, s1 = 0, q0 = 0, q1 = 0, s2 = 0, q2 = 0;
    for (int i = 0; i < n; ++i) {
      init.Fill(i * 7919 + 13, dim, row.data());
      for (int j = 0; j < dim; ++j) {
        for (size_t p = 0; p < std::size(points); ++p) below[j][p] += row[j] < points[p];
      }
      s0 += row[0], s1 += row[1], s2 += row[2];
      q0 += row[0] * row[0], q1 += row[1] * row[1], q2 += row[2] * row[2];
      s01 += row[0] * row[1], s12 += row[1] * row[2];
    }
    for (int j = 0; j < dim; ++j) {
      for (size_t p = 0; p < std::size(points); ++p) {
        double want = phi(points[p]);
        if (kind == InitKind::kTruncatedNormal) {  // within [-2, 2]
          want = std::clamp((want - phi(-2.0)) / (phi(2.0) - phi(-2.0)), 0.0, 1.0);
        }
        const double got = static_cast<double>(below[j][p]) / n;
        const double se = std::sqrt(std::max(want * (1 - want), 1e-6) / n);
        CHECK(std::fabs(got - want) < 5 * se + 1e-6);
      }
    }
    const auto corr = [n](double sxy, double sx, double sy, double qx, double qy) {
      const double cov = sxy / n - (sx / n) * (sy / n);
      return cov / std::sqrt((qx / n - sx * sx / n / n) * (qy / n - sy * sy / n / n));
    };
    CHECK(std::fabs(corr(s01, s0, s1, q0, q1)) < 0.015);  // one sample position
    CHECK(std::fabs(corr(s12, s1, s2, q1, q2)) < 0.015);  // neighbouring positions
  }
}

TEST_CASE(HostTableFindInsertWriteAssign) {
  HostTable t(Options(4, 2));
  CHECK_EQ(t.width(), 12);
  const int64_t ids[] = {-5, 0, INT64_MAX, INT64_MIN};
  std::vector<float> rows(4 * 12), init(12);
  t.Find(ids, 4, rows.data());
  CHECK_EQ(t.size(), 0);  // Find never inserts
  t.InitialRow(-5, init.data());
  CHECK(std::equal(init.begin(), init.end(), rows.begin()));
  CHECK_EQ(init[4], 0.25f);  // state rows start at state_init
  CHECK(t.Reserve(4).ok());
  t.FindOrInsertReserved(ids, 4, rows.data(), 4);
  CHECK_EQ(t.size(), 4);
  std::vector<float> w(12, 9.0f);
  CHECK(t.Write(&ids[2], 1, w.data()).ok());
  std::vector<float> got(12);
  t.Find(&ids[2], 1, got.data());
  CHECK(got == w);
  const float v[] = {1, 2, 3, 4};
  CHECK(t.AssignValues(&ids[2], 1, v).ok());
  t.Find(&ids[2], 1, got.data());
  CHECK_EQ(got[0], 1.0f);
  CHECK_EQ(got[3], 4.0f);
  CHECK_EQ(got[4], 0.25f);  // state reset
  CHECK_EQ(got[11], 0.25f);
  CHECK_EQ(t.size(), 4);
}

TEST_CASE(HostTableGrowsAndExports) {
  HostTable t(Options(3, 1));
  std::mt19937_64 rng(1);
  std::map<int64_t, float> model;
  std::vector<int64_t> ids;
  for (int i = 0; i < 200000; ++i) ids.push_back(static_cast<int64_t>(rng()));
  std::vector<float> rows(ids.size() * 6);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int j = 0; j < 6; ++j) rows[i * 6 + j] = static_cast<float>(i);
    model[ids[i]] = static_cast<float>(i);
  }
  CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());
  CHECK_EQ(t.size(), static_cast<int64_t>(model.size()));
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> counts;
  t.Export(&out_ids, &out_rows, &counts);
  CHECK_EQ(out_ids.size(), model.size());
  for (size_t i = 0; i < out_ids.size(); ++i) {
    CHECK_EQ(out_rows[i * 6], model[out_ids[i]]);
    CHECK_EQ(out_rows[i * 6 + 5], model[out_ids[i]]);
  }
  // ExportTo: the same rows in the same order, whole or their first columns.
  for (int64_t columns : {-1, 6, 2, 1}) {
    const int64_t cols = columns == -1 ? 6 : columns;
    std::vector<int64_t> to_ids, to_counts;
    std::vector<float> to_rows;
    t.ExportTo([&](int64_t n, int64_t** i, float** r, int64_t** c) {
      to_ids.resize(n);
      to_rows.assign(n * cols, -1.0f);
      to_counts.resize(n);
      *i = to_ids.data();
      *r = to_rows.data();
      *c = to_counts.data();
    }, columns);
    CHECK(to_ids == out_ids);
    for (size_t i = 0; i < out_ids.size(); ++i) {
      for (int64_t j = 0; j < cols; ++j) CHECK_EQ(to_rows[i * cols + j], out_rows[i * 6 + j]);
    }
  }
  // Memory: payload is 8 (id) + 6 * 4 bytes per row. Narrow rows in a
  // mid-sized table are the worst case of the layout (index entries and the
  // geometric arena tail dominate); bench/ measures realistic widths.
  const double per_row = static_cast<double>(t.AllocatedBytes()) / t.size();
  std::printf("  host table bytes/row (dim 3, 1 state): %.1f (payload 32)\n",
              per_row);
  CHECK(per_row < 2.0 * 32);
  t.Clear();
  CHECK_EQ(t.size(), 0);
  t.Find(ids.data(), 1, rows.data());
  std::vector<float> init(6);
  t.InitialRow(ids[0], init.data());
  CHECK(std::equal(init.begin(), init.end(), rows.begin()));
}

TEST_CASE(HostTableGrowsInSmallSteps) {
  // Inserts in small writes, so every shard's index grows entry by entry
  // through both growth regimes (3/2 while small, 5/4 once large); every row
  // stays findable with its own values.
  HostTable t(Options(1, 0));
  std::mt19937_64 rng(3);
  std::vector<int64_t> ids;
  for (int i = 0; i < 600000; ++i) ids.push_back(static_cast<int64_t>(rng()));
  std::vector<float> rows(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) rows[i] = static_cast<float>(i);
  for (size_t start = 0; start < ids.size(); start += 1000) {
    CHECK(t.Write(ids.data() + start, 1000, rows.data() + start).ok());
  }
  CHECK_EQ(t.size(), static_cast<int64_t>(ids.size()));
  std::vector<float> got(ids.size());
  t.Find(ids.data(), ids.size(), got.data());
  CHECK(got == rows);
}

TEST_CASE(HostTableExpectedRowsPresizesIndexes) {
  // With expected_rows, every shard's index is sized for its share at
  // construction and again after Clear(): filling the table to the expected
  // size grows no index, and rows read back as in a table without the hint.
  HostTableOptions o = Options(2, 1);
  o.expected_rows = 200000;
  HostTable t(o);
  HostTable plain(Options(2, 1));
  const std::vector<size_t> presized = t.IndexEntries();
  size_t entries = 0;
  for (size_t e : presized) entries += e;
  CHECK(entries * 13 >= static_cast<size_t>(o.expected_rows) * 16);
  CHECK(entries * 13 < static_cast<size_t>(o.expected_rows) * 16 * 3 / 2);
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids(o.expected_rows);
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  std::vector<float> rows(ids.size() * 4);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 1000);
  for (size_t start = 0; start < ids.size(); start += 1000) {
    CHECK(t.Write(ids.data() + start, 1000, rows.data() + start * 4).ok());
    CHECK(plain.Write(ids.data() + start, 1000, rows.data() + start * 4).ok());
  }
  CHECK(t.IndexEntries() == presized);
  std::vector<int64_t> probe(ids.begin(), ids.begin() + 5000);
  for (int i = 0; i < 5000; ++i) probe.push_back(static_cast<int64_t>(rng()));
  std::vector<float> got(probe.size() * 4), want(probe.size() * 4);
  t.Find(probe.data(), probe.size(), got.data());
  plain.Find(probe.data(), probe.size(), want.data());
  CHECK(got == want);
  t.Clear();
  CHECK(t.IndexEntries() == presized);
  CHECK_EQ(t.size(), 0);
}

namespace {
int64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}
}  // namespace

TEST_CASE(HostTableReserveRowsAllocatesAndTouchesRowMemoryUpFront) {
  // reserve_rows: the row memory of expected_rows is allocated at
  // construction, so filling the table to that size allocates no more of it
  // and takes far fewer page faults than without; rows read back equal.
  HostTableOptions o = Options(16, 1);
  o.expected_rows = 100000;
  HostTableOptions sized = o;
  o.reserve_rows = true;
  HostTable reserved(o);
  HostTable plain(sized);
  const size_t payload = static_cast<size_t>(o.expected_rows) * 32 * sizeof(float);
  const size_t at_start = reserved.AllocatedBytes();
  CHECK(at_start >= payload);
  CHECK(plain.AllocatedBytes() < payload / 4);  // indexes only
  std::mt19937_64 rng(9);
  std::vector<int64_t> ids(o.expected_rows);
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  std::vector<float> rows(ids.size() * 32);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 977);
  int64_t faults[2];
  HostTable* tables[2] = {&reserved, &plain};
  for (int k = 0; k < 2; ++k) {
    const int64_t before = MinorFaults();
    for (size_t start = 0; start < ids.size(); start += 1000) {
      CHECK(tables[k]->Write(ids.data() + start, 1000, rows.data() + start * 32).ok());
    }
    faults[k] = MinorFaults() - before;
  }
  CHECK_EQ(reserved.AllocatedBytes(), at_start);
  // Without the reservation the fill needs ~12.8 MB of fresh rows (~3,100
  // pages; 1,888 faults in this binary, the rest reused freed heap memory);
  // with it only the pages of shards whose share ran past the 4-sigma
  // margin, if any (0 here).
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // A sanitizer's shadow memory takes page faults of its own on every fill.
  CHECK(faults[0] < 100);
  CHECK(faults[0] * 10 < faults[1]);
#else
  (void)faults;
#endif
  std::vector<float> got(ids.size() * 32), want(ids.size() * 32);
  reserved.Find(ids.data(), ids.size(), got.data());
  plain.Find(ids.data(), ids.size(), want.data());
  CHECK(got == want);
  CHECK(got == rows);
  // Clear() keeps the table usable and reserves again.
  reserved.Clear();
  CHECK_EQ(reserved.size(), 0);
  CHECK(reserved.AllocatedBytes() >= payload);
  CHECK(reserved.Write(ids.data(), 10, rows.data()).ok());
  reserved.Find(ids.data(), 10, got.data());
  CHECK(std::equal(got.begin(), got.begin() + 320, rows.begin()));
}

TEST_CASE(HostTableShardsTakeTurnsToGrow) {
  // Ids spread evenly over the shards. If the shards' index sizes followed
  // one grid, all of them would fill up, and rehash every entry of the
  // table, within the same one or two insert calls. They must take turns:
  // from 3M to 4M rows, in calls of 50k ids (each 1.2-1.7% of the table,
  // against the 25% by which an index grows), no call grows more than a
  // quarter of the 64 shards (about 5 do), and every shard grows.
  HostTableOptions o = Options(1, 0);
  o.num_shards = 64;
  HostTable t(o);
  std::mt19937_64 rng(11);
  const int64_t chunk = 50000;
  std::vector<int64_t> ids(chunk);
  std::vector<float> rows(chunk, 1.0f);
  auto write_chunk = [&]() {
    for (auto& id : ids) id = static_cast<int64_t>(rng());
    CHECK(t.Write(ids.data(), chunk, rows.data()).ok());
  };
  for (int c = 0; c < 60; ++c) write_chunk();
  std::vector<size_t> before = t.IndexEntries();
  std::vector<int> grew(before.size(), 0);
  int most = 0;
  for (int c = 60; c < 80; ++c) {
    write_chunk();
    const std::vector<size_t> after = t.IndexEntries();
    int n = 0;
    for (size_t k = 0; k < after.size(); ++k) {
      if (after[k] != before[k]) ++n, ++grew[k];
    }
    most = std::max(most, n);
    before = after;
  }
  std::printf("  most shards grown by one call of 50k ids: %d of 64\n", most);
  CHECK(most <= 16);
  CHECK(*std::min_element(grew.begin(), grew.end()) >= 1);
}

TEST_CASE(HostTableReloadsItsOwnExport) {
  // A checkpoint restore writes ids in the order the table exported them
  // (grouped by shard and index position): the copy must hold every row and
  // use count, with an index no larger than one grown id by id.
  HostTable a(Options(2, 1));
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids(100000);
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  std::vector<float> rows(ids.size() * 4);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 977);
  std::vector<uint32_t> uses(ids.size());
  for (size_t i = 0; i < uses.size(); ++i) uses[i] = static_cast<uint32_t>(i % 7);
  CHECK(a.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> counts;
  a.Export(&out_ids, &out_rows, &counts);
  HostTable b(Options(2, 1));
  CHECK(b.Write(out_ids.data(), out_ids.size(), out_rows.data(), counts.data()).ok());
  CHECK_EQ(b.size(), a.size());
  CHECK(b.AllocatedBytes() <= a.AllocatedBytes());
  std::vector<int64_t> again_ids;
  std::vector<float> again_rows;
  std::vector<uint32_t> again_counts;
  b.Export(&again_ids, &again_rows, &again_counts);
  std::map<int64_t, size_t> at;
  for (size_t i = 0; i < again_ids.size(); ++i) at[again_ids[i]] = i;
  for (size_t i = 0; i < out_ids.size(); ++i) {
    const size_t j = at.at(out_ids[i]);
    CHECK_EQ(again_counts[j], counts[i]);
    CHECK(std::equal(out_rows.begin() + i * 4, out_rows.begin() + (i + 1) * 4,
                     again_rows.begin() + j * 4));
  }
}

// A fresh directory under /tmp (removed by the test when it is empty).
std::string MakeTempDir() {
  char name[] = "/tmp/sfctr_core_test.XXXXXX";
  const char* dir = mkdtemp(name);
  return dir == nullptr ? std::string() : std::string(dir);
}

int EntriesIn(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ++n;
    }
    closedir(d);
  }
  return n;
}

// ExportRange, part by part, gives every row of Export exactly once (with
// its use count), for any part size, after a prune left holes in the arenas,
// and with rows on file; an empty table ends at once.
TEST_CASE(HostTableExportsInParts) {
  const std::string dir = MakeTempDir();
  CHECK(!dir.empty());
  for (bool on_file : {false, true}) {
    HostTableOptions o = Options(32, 1);
    if (on_file) o.rows_dir = dir;
    HostTable t(o);
    constexpr int kWidth = 64;
    {
      uint64_t cursor = 0;
      std::vector<int64_t> ids, counts;
      std::vector<float> rows;
      t.ExportRange(&cursor, 100, &ids, &rows, &counts);
      CHECK(ids.empty());
      CHECK_EQ(cursor, HostTable::kNoMoreRows);
    }
    std::mt19937_64 rng(5);
    std::vector<int64_t> ids(30000);
    for (auto& id : ids) id = static_cast<int64_t>(rng());
    std::vector<float> rows(ids.size() * kWidth);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 977) * 0.5f;
    std::vector<uint32_t> uses(ids.size());
    for (size_t i = 0; i < uses.size(); ++i) uses[i] = static_cast<uint32_t>(i % 5);
    CHECK(t.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
    CHECK(t.Prune(1, {}) > 0);  // every fifth row, scattered over the arenas
    std::vector<int64_t> all_ids;
    std::vector<float> all_rows;
    std::vector<uint32_t> all_counts;
    t.Export(&all_ids, &all_rows, &all_counts);
    std::map<int64_t, std::pair<uint32_t, std::vector<float>>> expected;
    for (size_t i = 0; i < all_ids.size(); ++i) {
      expected[all_ids[i]] = {all_counts[i], std::vector<float>(
          all_rows.begin() + i * kWidth, all_rows.begin() + (i + 1) * kWidth)};
    }
    if (on_file) t.DropFileRowsFromMemory();
    for (int64_t part : {1, 7, 4096, 1 << 20}) {
      uint64_t cursor = 0;
      std::map<int64_t, std::pair<uint32_t, std::vector<float>>> got;
      int64_t calls = 0;
      while (cursor != HostTable::kNoMoreRows) {
        std::vector<int64_t> p_ids, p_counts;
        std::vector<float> p_rows;
        t.ExportRange(&cursor, part, &p_ids, &p_rows, &p_counts);
        CHECK(static_cast<int64_t>(p_ids.size()) <= part);
        CHECK_EQ(p_rows.size(), p_ids.size() * kWidth);
        CHECK_EQ(p_counts.size(), p_ids.size());
        for (size_t i = 0; i < p_ids.size(); ++i) {
          CHECK(got.count(p_ids[i]) == 0);
          got[p_ids[i]] = {static_cast<uint32_t>(p_counts[i]), std::vector<float>(
              p_rows.begin() + i * kWidth, p_rows.begin() + (i + 1) * kWidth)};
        }
        ++calls;
      }
      CHECK(got == expected);
      if (part == 1 << 20) CHECK_EQ(calls, int64_t{1});
    }
  }
  CHECK_EQ(rmdir(dir.c_str()), 0);  // the row file (unnamed) went with its table
}

// ExportRange keeps a shard's row ids between parts; a prune and inserts
// that reuse the freed rows in between (same row and id counts) must not
// label the new ids' rows with the pruned ids.
TEST_CASE(HostTableExportRangeSeesIdsThatChangedBetweenParts) {
  HostTableOptions o = Options(2, 0);
  o.num_shards = 1;
  HostTable t(o);
  std::vector<int64_t> ids(3000);
  std::iota(ids.begin(), ids.end(), 1);
  std::vector<float> rows(ids.size() * 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  std::vector<uint32_t> uses(ids.size(), 5);
  for (size_t i = 1500; i < 1600; ++i) uses[i] = 0;  // pruned below
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
  uint64_t cursor = 0;
  std::vector<int64_t> got_ids, got_counts;
  std::vector<float> got_rows;
  t.ExportRange(&cursor, 100, &got_ids, &got_rows, &got_counts);
  CHECK_EQ(got_ids.size(), size_t{100});
  CHECK_EQ(t.Prune(1, {}), int64_t{100});
  std::vector<int64_t> fresh(100);
  std::iota(fresh.begin(), fresh.end(), 100000);
  std::vector<float> fresh_rows(fresh.size() * 2, -1.0f);
  CHECK(t.Write(fresh.data(), fresh.size(), fresh_rows.data()).ok());
  CHECK_EQ(t.size(), int64_t{3000});
  got_ids.clear();
  got_rows.clear();
  got_counts.clear();
  while (cursor != HostTable::kNoMoreRows) {
    t.ExportRange(&cursor, 100, &got_ids, &got_rows, &got_counts);
  }
  std::vector<float> now(2);
  int fresh_seen = 0;
  for (size_t i = 0; i < got_ids.size(); ++i) {
    t.Find(&got_ids[i], 1, now.data());
    CHECK_EQ(got_rows[2 * i], now[0]);
    fresh_seen += got_ids[i] >= 100000;
  }
  CHECK_EQ(fresh_seen, 100);
}

TEST_CASE(HostTableReleaseFreesIndexesRowsAndTheRowFile) {
  // A released table (its owner deleted, its handle kept by traced
  // functions) holds no memory, no disk space and no descriptor: unlike
  // Clear, which sizes its indexes (and reserved rows) again.
  const std::string dir = MakeTempDir();
  CHECK(!dir.empty());
  const int fds_before = EntriesIn("/proc/self/fd");
  HostTableOptions o = Options(32, 1);
  o.rows_dir = dir;
  o.expected_rows = 100000;
  o.reserve_rows = true;
  HostTable t(o);
  CHECK_EQ(EntriesIn("/proc/self/fd"), fds_before + 1);
  std::vector<int64_t> ids(20000);
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::vector<float> rows(ids.size() * 64, 1.5f);
  CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());
  CHECK(t.AllocatedBytes() > 0);
  CHECK(t.FileBytes() > 0);
  t.Release();
  CHECK_EQ(t.size(), 0);
  CHECK_EQ(t.AllocatedBytes(), size_t{0});
  CHECK_EQ(t.FileBytes(), size_t{0});
  CHECK_EQ(t.RowFileLength(), size_t{0});
  for (size_t e : t.IndexEntries()) CHECK_EQ(e, size_t{0});
  CHECK_EQ(EntriesIn("/proc/self/fd"), fds_before);
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableRowsInAFileMatchRowsInMemory) {
  const std::string dir = MakeTempDir();
  CHECK(!dir.empty());
  // dim 32 + 1 state: 256-byte rows, so a shard's blocks reach the file's
  // 64 KiB minimum after its first 240 rows: most of these rows are on file.
  constexpr int kWidth = 64;
  HostTableOptions in_file = Options(32, 1);
  in_file.rows_dir = dir;
  HostTable a(Options(32, 1)), b(in_file);
  CHECK_EQ(a.FileBytes(), size_t{0});
  std::mt19937_64 rng(11);
  std::vector<int64_t> ids(60000);
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  std::vector<float> rows(ids.size() * kWidth);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 1013) - 7.5f;
  std::vector<uint32_t> uses(ids.size(), 3);
  CHECK(a.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
  CHECK(b.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
  // Large blocks are in the file; it has no name in the directory.
  CHECK(b.FileBytes() > 0);
  CHECK(b.FileBytes() < b.AllocatedBytes());
  CHECK_EQ(EntriesIn(dir), 0);
  // New ids get the same initial rows, and every row reads back the same,
  // also once the kernel had to read it from the disk again.
  std::vector<int64_t> fresh(5000);
  for (auto& id : fresh) id = static_cast<int64_t>(rng());
  std::vector<float> fa(fresh.size() * kWidth), fb(fresh.size() * kWidth);
  CHECK(a.Reserve(fresh.size()).ok());
  CHECK(b.Reserve(fresh.size()).ok());
  a.FindOrInsertReserved(fresh.data(), fresh.size(), fa.data(), fresh.size());
  b.FindOrInsertReserved(fresh.data(), fresh.size(), fb.data(), fresh.size());
  CHECK(fa == fb);
  CHECK(!a.SampledRowsOnDisk(ids.data(), ids.size()));  // no file
  for (int round = 0; round < 2; ++round) {
    std::vector<float> ra(ids.size() * kWidth), rb(ids.size() * kWidth);
    a.Find(ids.data(), ids.size(), ra.data());
    b.Find(ids.data(), ids.size(), rb.data());
    CHECK(ra == rb);
    CHECK(rb == rows);
    // Read once, the rows are in memory; dropped, the sample finds them gone
    // (and the next Find starts their reads together).
    CHECK(!b.SampledRowsOnDisk(ids.data(), ids.size()));
    b.DropFileRowsFromMemory();
    CHECK(b.SampledRowsOnDisk(ids.data(), ids.size()));
  }
  std::vector<int64_t> ea, eb;
  std::vector<float> va, vb;
  std::vector<uint32_t> ca, cb;
  a.Export(&ea, &va, &ca);
  b.Export(&eb, &vb, &cb);
  CHECK(ea == eb);
  CHECK(va == vb);
  CHECK(ca == cb);
  CHECK_EQ(a.Prune(4, {}), b.Prune(4, {}));  // every row used 3 times
  CHECK_EQ(b.size(), 0);
  // A cleared table gives its file space back; the next rows map anew.
  CHECK(b.Write(ids.data(), ids.size(), rows.data()).ok());
  b.Clear();
  CHECK_EQ(b.FileBytes(), size_t{0});
  CHECK(b.Write(ids.data(), 1000, rows.data()).ok());
  std::vector<float> one(kWidth);
  b.Find(&ids[999], 1, one.data());
  CHECK(std::equal(one.begin(), one.end(), rows.begin() + 999 * kWidth));
  CHECK_EQ(EntriesIn(dir), 0);
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableRowsDirMustBeAWritableDirectory) {
  const std::string dir = MakeTempDir();
  CHECK(!dir.empty());
  const std::string file = dir + "/plain_file";
  std::ofstream(file) << "x";
  for (const std::string& bad : {dir + "/missing", file}) {
    HostTableOptions o = Options(4, 0);
    o.rows_dir = bad;
    std::string message;
    try {
      HostTable t(o);
    } catch (const RowFileError& e) {
      message = e.what();
    }
    CHECK(message.find("host_rows_dir '" + bad + "'") != std::string::npos);
  }
  if (geteuid() != 0) {  // root writes anywhere
    CHECK_EQ(chmod(dir.c_str(), 0500), 0);
    HostTableOptions o = Options(4, 0);
    o.rows_dir = dir;
    bool refused = false;
    try {
      HostTable t(o);
    } catch (const RowFileError&) {
      refused = true;
    }
    CHECK(refused);
    chmod(dir.c_str(), 0700);
  }
  std::remove(file.c_str());
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableRowFileSurvivesAForkedChild) {
  const std::string dir = MakeTempDir();
  HostTableOptions o = Options(32, 1);
  o.rows_dir = dir;
  HostTable t(o);
  std::mt19937_64 rng(3);
  std::vector<int64_t> ids(30000);
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  std::vector<float> rows(ids.size() * 64);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 997);
  CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());
  CHECK(t.FileBytes() > 0);
  const pid_t child = fork();
  if (child == 0) {
    // The child drops its copy of the table (every block unmapped, which
    // in the parent empties the file) and exits.
    t.Clear();
    _exit(t.FileBytes() == 0 ? 0 : 3);
  }
  int status = 0;
  CHECK_EQ(waitpid(child, &status, 0), child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  t.DropFileRowsFromMemory();
  std::vector<float> got(rows.size());
  t.Find(ids.data(), ids.size(), got.data());
  CHECK(got == rows);
  t.Clear();
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableRowFileBoundsTheRowsBeingWritten) {
  // New rows are handed to the disk as blocks fill; past a window the
  // writer waits for the oldest, so a restore faster than the disk cannot
  // pile up pages under writeback (which no memory limit can reclaim).
  const std::string dir = MakeTempDir();
  HostTableOptions o = Options(32, 1);
  o.rows_dir = dir;
  HostTable t(o);
  std::vector<int64_t> ids(200000);  // 256 B a row: 51 MB, 3x the window
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::vector<float> rows(ids.size() * 64);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 1009);
  size_t most = 0;
  for (size_t at = 0; at < ids.size(); at += 10000) {
    CHECK(t.Write(ids.data() + at, 10000, rows.data() + at * 64).ok());
    most = std::max(most, t.RowFileWriting());
  }
  CHECK(most > 0);
  CHECK(most <= RowFile::kWritebackWindow);
  // Of the rows handed to the disk (all but each of the 64 shards' last
  // partial 256 KiB, so most), all but the last window were waited for.
  CHECK(t.RowFileWaited() > 0);
  CHECK(t.RowFileWaited() + t.RowFileWriting() >= size_t{200000} * 256 / 2);
  std::vector<float> got(rows.size());
  t.DropFileRowsFromMemory();
  t.Find(ids.data(), ids.size(), got.data());
  CHECK(got == rows);
  // Emptied, the file forgets its ranges: a refill waits for its own only.
  t.Clear();
  CHECK_EQ(t.RowFileWriting(), size_t{0});
  const size_t waited = t.RowFileWaited();
  CHECK(t.Write(ids.data(), 10000, rows.data()).ok());
  CHECK_EQ(t.RowFileWaited(), waited);
  t.Clear();
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableRowFileIsReusedAfterClear) {
  // A restore clears the table and writes it again: with reserve_rows the
  // cleared shards are sized again at once, and the file must not grow.
  const std::string dir = MakeTempDir();
  HostTableOptions o = Options(32, 1);
  o.rows_dir = dir;
  o.expected_rows = 40000;
  o.reserve_rows = true;
  HostTable t(o);
  const size_t length = t.RowFileLength();
  CHECK(length > 0);
  std::vector<int64_t> ids(40000);
  std::iota(ids.begin(), ids.end(), int64_t{-20000});
  std::vector<float> rows(ids.size() * 64, 1.5f);
  for (int round = 0; round < 4; ++round) {
    CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());
    t.Clear();
    CHECK_EQ(t.RowFileLength(), length);
  }
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableSaysWhetherTheDiskOrTheMemoryRanOut) {
  const std::string dir = MakeTempDir();
  HostTableOptions o = Options(32, 1);
  o.rows_dir = dir;
  HostTable t(o);
  std::vector<int64_t> ids(20000);
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::vector<float> rows(ids.size() * 64, 2.0f);
  // A file size limit stands in for a full disk (EFBIG, not SIGXFSZ).
  struct rlimit before;
  CHECK_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = before;
  small.rlim_cur = 1 << 20;
  CHECK_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  CoreStatus st = t.Write(ids.data(), ids.size(), rows.data());
  CHECK_EQ(setrlimit(RLIMIT_FSIZE, &before), 0);
  std::signal(SIGXFSZ, old_handler);
  CHECK(!st.ok());
  CHECK(st.message().find("out of disk space") != std::string::npos);
  CHECK(st.message().find("host_rows_dir '" + dir + "'") != std::string::npos);
  // Later, memory runs out: that is what the error says, whatever the disk
  // did before.
  AllocationHook& hook = TestAllocationHook();
  hook.countdown = 0;
  st = t.Write(ids.data(), ids.size(), rows.data());
  hook.countdown = -1;
  CHECK(!st.ok());
  CHECK(st.message().find("out of host memory") != std::string::npos);
  CHECK(st.message().find("out of disk space") == std::string::npos);
  t.Clear();
  CHECK_EQ(rmdir(dir.c_str()), 0);
}

TEST_CASE(HostTableMaxRowsIsAtomic) {
  HostTable t(Options(2, 0, /*max_rows=*/3));
  const int64_t a[] = {1, 2};
  const float v[] = {1, 1, 2, 2};
  CHECK(t.Write(a, 2, v).ok());
  const int64_t b[] = {2, 3, 4};  // two new ids: would make 4 > 3
  const float w[] = {5, 5, 6, 6, 7, 7};
  CoreStatus st = t.Write(b, 3, w);
  CHECK(!st.ok());
  CHECK(st.message().find("max_rows=3") != std::string::npos);
  CHECK_EQ(t.size(), 2);
  std::vector<float> got(2);
  t.Find(&a[1], 1, got.data());
  CHECK_EQ(got[0], 2.0f);  // row 2 untouched by the failed call
  const int64_t c[] = {2, 3};
  CHECK(t.Write(c, 2, w).ok());  // exactly at the limit is fine
  CHECK_EQ(t.size(), 3);
}

// Kilobytes of address space this process has mapped (Linux).
static long MappedKb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stol(line.substr(7));
  }
  return -1;
}

TEST_CASE(LargeAllocationsGiveBackAllTheirAddressSpace) {
  // Sizes of indexes (12-byte entries), not whole pages: the tail of a huge
  // page mapping used to be trimmed at an unaligned address, which failed and
  // left up to 2 MiB mapped per allocation (~200 MB here).
  const long before = MappedKb();
  CHECK(before > 0);
  for (int i = 0; i < 100; ++i) {
    const size_t bytes = (size_t{3} << 20) + 12 * (7 + i);
    char* p = static_cast<char*>(AllocateLarge(bytes));
    p[0] = 1;
    p[bytes - 1] = 1;
    FreeLarge(p, bytes);
  }
#if defined(SFCTR_OWN_MAPPINGS)
  // (Under ASan the arrays come from malloc, whose quarantine keeps them.)
  CHECK(MappedKb() - before < 16 * 1024);
#endif
}

TEST_CASE(HostTableConcurrentReadersAndWriters) {
  // Writers store rows whose columns all hold the same version number; a
  // reader must never see a row mixing two versions.
  HostTable t(Options(16, 1));
  const int kIds = 2000;
  std::vector<int64_t> ids(kIds);
  for (int i = 0; i < kIds; ++i) ids[i] = i * 7919LL;
  std::atomic<bool> torn{false};
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      std::vector<float> rows(kIds * 32);
      for (int round = 0; round < 30; ++round) {
        std::fill(rows.begin(), rows.end(), static_cast<float>(w * 1000 + round));
        t.Write(ids.data(), kIds, rows.data());
      }
      ++done;
    });
  }
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&] {
      std::vector<float> rows(kIds * 32);
      while (done.load() < 4) {
        t.Find(ids.data(), kIds, rows.data());
        for (int i = 0; i < kIds; ++i) {
          // A row is either still initial (random values) or one version.
          const float* row = rows.data() + i * 32;
          if (row[16] == 0.25f && row[0] != row[1]) continue;  // initial
          for (int j = 1; j < 32; ++j) {
            if (row[j] != row[0]) torn = true;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(!torn.load());
  CHECK_EQ(t.size(), kIds);
}

TEST_CASE(DirectoryReleaseFreesItsArrays) {
  // A released store's directory (its layer deleted, its handle kept by
  // traced functions) holds no memory: Clear keeps the arrays for reuse.
  CacheDirectory d(100000);
  std::vector<int64_t> ids(5000);
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::vector<int32_t> slots(ids.size());
  int64_t misses = 0;
  CHECK(d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok());
  std::vector<int64_t> miss_pos;
  std::vector<CacheDirectory::Eviction> evicted;
  d.Commit(ids.data(), ids.size(), slots.data(), &miss_pos, &evicted);
  const size_t before = d.AllocatedBytes();
  CHECK(before >= size_t{100000} * 16);
  d.Clear();
  CHECK_EQ(d.AllocatedBytes(), before);
  d.Release();
  CHECK_EQ(d.size(), 0);
  CHECK_EQ(d.AllocatedBytes(), size_t{0});
}

TEST_CASE(DirectoryRejectsOversizedStep) {
  CacheDirectory d(4);
  const int64_t ids[] = {1, 2, 3, 4, 5};
  int32_t slots[5];
  int64_t misses = 0;
  CoreStatus st = d.Classify(ids, 5, slots, &misses);
  CHECK(!st.ok());
  CHECK(st.message().find("5 distinct ids") != std::string::npos);
  CHECK(st.message().find("cache_capacity is 4") != std::string::npos);
}

TEST_CASE(DirectoryNeverEvictsCurrentStep) {
  // Random steps against a model: every id of a step ends up cached, slots are
  // distinct, evicted ids are never ones the step uses, and the map agrees
  // with the model after many insertions and deletions.
  const int64_t cap = 64;
  CacheDirectory d(cap);
  std::mt19937_64 rng(5);
  std::unordered_map<int64_t, int32_t> model;
  for (int step = 0; step < 3000; ++step) {
    std::set<int64_t> step_ids;
    const int n = 1 + rng() % cap;
    while (static_cast<int>(step_ids.size()) < n) {
      // Skewed ids: small numbers are hot.
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      step_ids.insert(static_cast<int64_t>(std::pow(400.0, u)) * 1000003LL);
    }
    std::vector<int64_t> ids(step_ids.begin(), step_ids.end());
    std::vector<int32_t> slots(ids.size());
    int64_t misses = 0;
    CHECK(d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok());
    std::vector<int64_t> miss_pos;
    std::vector<CacheDirectory::Eviction> evicted;
    const int64_t empty = cap - d.size();
    d.Commit(ids.data(), ids.size(), slots.data(), &miss_pos, &evicted);
    CHECK_EQ(static_cast<int64_t>(miss_pos.size()), misses);
    // Empty slots (never used, or freed by Remove below) are taken first:
    // only the misses beyond them evict.
    CHECK_EQ(static_cast<int64_t>(evicted.size()), std::max<int64_t>(0, misses - empty));
    for (const auto& e : evicted) {
      CHECK(step_ids.count(e.id) == 0);
      CHECK_EQ(model[e.id], e.slot);
      model.erase(e.id);
    }
    std::set<int32_t> used;
    for (size_t i = 0; i < ids.size(); ++i) {
      CHECK(slots[i] >= 0 && slots[i] < cap);
      CHECK(used.insert(slots[i]).second);
      auto it = model.find(ids[i]);
      if (it != model.end()) CHECK_EQ(it->second, slots[i]);
      model[ids[i]] = slots[i];
    }
    CHECK_EQ(d.size(), static_cast<int64_t>(model.size()));
    if (step % 7 == 3) {  // free a few slots between steps
      for (int k = 0; k < 5 && !model.empty(); ++k) {
        auto it = model.begin();
        std::advance(it, rng() % model.size());
        CHECK_EQ(d.Remove(it->first), it->second);
        CHECK_EQ(d.Probe(it->first), -1);
        model.erase(it);
      }
      CHECK_EQ(d.Remove(-1), -1);  // never cached
      CHECK_EQ(d.size(), static_cast<int64_t>(model.size()));
    }
  }
  for (const auto& kv : model) CHECK_EQ(d.Probe(kv.first), kv.second);
  CHECK(d.stats().evictions > 0);
  // Hot ids stay: the hottest id (1000003) should be cached at the end.
  CHECK(d.Probe(1000003LL) >= 0);
}

TEST_CASE(DirectoryToleratesRepeatedIds) {
  CacheDirectory d(4);
  const int64_t ids[] = {9, 9, 8};
  int32_t slots[3];
  int64_t misses = 0;
  CHECK(d.Classify(ids, 3, slots, &misses).ok());
  std::vector<int64_t> pos;
  std::vector<CacheDirectory::Eviction> ev;
  d.Commit(ids, 3, slots, &pos, &ev);
  CHECK_EQ(slots[0], slots[1]);
  CHECK(slots[2] != slots[0]);
  CHECK_EQ(pos.size(), 2u);
  CHECK_EQ(d.size(), 2);
}

// One step of a directory: the ids evicted (sorted). `hints`: (id, batches
// ahead) pairs.
std::vector<int64_t> Step(CacheDirectory& d, std::vector<int64_t> ids,
                          std::vector<std::pair<int64_t, int32_t>> hints = {}) {
  std::vector<int32_t> slots(ids.size());
  int64_t misses = 0;
  if (!d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok()) return {-1};
  std::vector<int64_t> pos;
  std::vector<CacheDirectory::Eviction> ev;
  std::vector<int64_t> hint_ids;
  std::vector<int32_t> hint_steps;
  for (const auto& h : hints) {
    hint_ids.push_back(h.first);
    hint_steps.push_back(h.second);
  }
  EvictionHints eh;
  eh.ids = hint_ids.data();
  eh.steps = hint_steps.data();
  eh.n = static_cast<int64_t>(hints.size());
  d.Commit(ids.data(), ids.size(), slots.data(), &pos, &ev, eh);
  std::vector<int64_t> out;
  for (const auto& e : ev) out.push_back(e.id);
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// The eviction policy written plainly, slot by slot: a step's victims are
// the slots it does not use with the lowest levels (use counter, or a hint
// level above every counter), ties broken in clock order from the hand, and
// the hand stops after the last victim. CacheDirectory finds the same
// victims with level counts and a sweep over packed keys.
class DirectoryModel {
 public:
  explicit DirectoryModel(int64_t cap) : cap_(cap), slots_(cap) {}

  void Commit(const std::vector<int64_t>& ids, const std::vector<int64_t>& hint_ids,
              const std::vector<int32_t>& hint_steps, std::vector<int32_t>* out_slots,
              std::vector<std::pair<int64_t, int32_t>>* evicted) {
    if (hits_since_halving_ > 16 * static_cast<uint64_t>(cap_)) {
      for (Slot& s : slots_) s.freq >>= 1;
      hits_since_halving_ = 0;
    }
    ++step_;
    out_slots->assign(ids.size(), -1);
    int64_t misses = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = where_.find(ids[i]);
      if (it == where_.end()) {
        ++misses;
        continue;
      }
      Slot& s = slots_[it->second];
      s.step = step_;
      if (s.freq < 255) ++s.freq;
      ++hits_since_halving_;
      (*out_slots)[i] = it->second;
    }
    for (Slot& s : slots_) s.hint = 0;
    for (size_t j = 0; j < hint_ids.size(); ++j) {
      auto it = where_.find(hint_ids[j]);
      if (it == where_.end() || slots_[it->second].step == step_) continue;
      const int d = std::min(16, std::max(1, hint_steps[j]));
      Slot& s = slots_[it->second];
      if (s.hint == 0 || d < s.hint) s.hint = d;
    }
    std::vector<int32_t> taken;
    for (; never_used_ < cap_ && static_cast<int64_t>(taken.size()) < misses; ++never_used_) {
      taken.push_back(static_cast<int32_t>(never_used_));
      slots_[never_used_].step = step_;  // not a candidate below
    }
    const int64_t needed = misses - static_cast<int64_t>(taken.size());
    if (needed > 0) {
      // Candidates in clock order from the hand; the needed lowest levels,
      // earliest first among equal levels.
      std::vector<std::pair<int, int64_t>> order;  // (level, clock position)
      for (int64_t p = 0; p < cap_; ++p) {
        const int64_t k = (hand_ + p) % cap_;
        const Slot& s = slots_[k];
        if (s.step == step_) continue;
        order.push_back({s.hint ? 256 + 16 - s.hint : s.freq, p});
      }
      std::stable_sort(order.begin(), order.end());
      std::vector<int64_t> positions;
      for (int64_t v = 0; v < needed; ++v) positions.push_back(order[v].second);
      std::sort(positions.begin(), positions.end());  // taken in clock order
      for (int64_t p : positions) {
        const int32_t k = static_cast<int32_t>((hand_ + p) % cap_);
        evicted->push_back({slots_[k].id, k});
        where_.erase(slots_[k].id);
        taken.push_back(k);
      }
      hand_ = (hand_ + positions.back() + 1) % cap_;
    }
    size_t t = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if ((*out_slots)[i] >= 0) continue;
      const int32_t k = taken[t++];
      slots_[k] = Slot{ids[i], step_, 0, 0};
      where_[ids[i]] = k;
      (*out_slots)[i] = k;
    }
  }

 private:
  struct Slot {
    int64_t id = 0;
    uint64_t step = 0;
    int freq = 0;
    int hint = 0;
  };
  int64_t cap_;
  std::vector<Slot> slots_;
  std::unordered_map<int64_t, int32_t> where_;
  uint64_t step_ = 0;
  int64_t hand_ = 0;
  int64_t never_used_ = 0;
  uint64_t hits_since_halving_ = 0;
};

}  // namespace

TEST_CASE(DirectoryMatchesAPlainModelOfItsPolicy) {
  // Capacities around the sweep's 8-key blocks, skewed ids, hints on most
  // steps, long enough for the counters to be halved several times.
  for (int64_t cap : {5, 8, 61, 203}) {
    CacheDirectory d(cap);
    DirectoryModel model(cap);
    std::mt19937_64 rng(static_cast<uint64_t>(cap));
    std::vector<int64_t> next;
    for (int step = 0; step < 4000; ++step) {
      std::set<int64_t> step_ids;
      const int64_t n = 1 + static_cast<int64_t>(rng() % cap);
      while (static_cast<int64_t>(step_ids.size()) < n) {
        const double u = std::uniform_real_distribution<double>(0, 1)(rng);
        step_ids.insert(static_cast<int64_t>(std::pow(8.0 * cap, u)) * 7919LL);
      }
      std::vector<int64_t> ids(step_ids.begin(), step_ids.end());
      std::shuffle(ids.begin(), ids.end(), rng);
      // Hints: some ids of a random later "batch", at distances 1..20.
      std::vector<int64_t> hint_ids;
      std::vector<int32_t> hint_steps;
      if (step % 4 != 0) {
        for (int j = 0; j < cap / 2; ++j) {
          const double u = std::uniform_real_distribution<double>(0, 1)(rng);
          hint_ids.push_back(static_cast<int64_t>(std::pow(8.0 * cap, u)) * 7919LL);
          hint_steps.push_back(1 + static_cast<int32_t>(rng() % 20));
        }
      }
      std::vector<int32_t> slots(ids.size()), want_slots;
      int64_t misses = 0;
      CHECK(d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok());
      std::vector<int64_t> miss_pos;
      std::vector<CacheDirectory::Eviction> evicted;
      EvictionHints hints;
      hints.ids = hint_ids.data();
      hints.steps = hint_steps.data();
      hints.n = static_cast<int64_t>(hint_ids.size());
      d.Commit(ids.data(), ids.size(), slots.data(), &miss_pos, &evicted, hints);
      std::vector<std::pair<int64_t, int32_t>> want_evicted;
      model.Commit(ids, hint_ids, hint_steps, &want_slots, &want_evicted);
      CHECK(slots == want_slots);
      CHECK_EQ(evicted.size(), want_evicted.size());
      for (size_t j = 0; j < evicted.size() && j < want_evicted.size(); ++j) {
        CHECK_EQ(evicted[j].id, want_evicted[j].first);
        CHECK_EQ(evicted[j].slot, want_evicted[j].second);
      }
    }
    CHECK(d.stats().evictions > 0);
  }
}

TEST_CASE(DirectoryEvictsTheLeastUsedIds) {
  // Ids 1..6 used 1..6 times (id k in steps with every id >= k), then
  // admitted ids 7, 8, 9 in one step: the victims are the three least used
  // ids, 1, 2 and 3, wherever the clock hand stands.
  CacheDirectory d(6);
  for (int64_t k = 1; k <= 6; ++k) {
    std::vector<int64_t> ids;
    for (int64_t id = 7 - k; id <= 6; ++id) ids.push_back(id);
    CHECK(Step(d, ids).empty());
  }
  CHECK(Step(d, {7, 8, 9}) == (std::vector<int64_t>{1, 2, 3}));
  // A history seed counts like past uses: id 1 comes back with 5 past uses
  // and outlives 7, 8 and 9 (used once each) and 4 (used 4 times).
  std::vector<int64_t> ev = Step(d, {1});
  CHECK(ev.size() == 1u && ev[0] >= 7);  // one of the ids used once leaves
  d.SeedFrequency(d.Probe(1), 5);         // as the store does with the host's count
  ev = Step(d, {10, 11, 12});
  CHECK(std::find(ev.begin(), ev.end(), 1) == ev.end());
  CHECK(std::find(ev.begin(), ev.end(), 6) == ev.end());
}

TEST_CASE(DirectoryKeepsHintedIds) {
  // Ids 1..6 used 1..6 times, as above. Hints for 1 and 2 keep them: the
  // three least used unhinted ids go instead.
  CacheDirectory d(6);
  for (int64_t k = 1; k <= 6; ++k) {
    std::vector<int64_t> ids;
    for (int64_t id = 7 - k; id <= 6; ++id) ids.push_back(id);
    CHECK(Step(d, ids).empty());
  }
  CHECK(Step(d, {7, 8, 9}, {{1, 1}, {2, 3}, {7, 1}, {1000, 2}}) ==
        (std::vector<int64_t>{3, 4, 5}));
  // Cached now: 1, 2, 6, 7, 8, 9. Every slot the step does not use is
  // hinted: the furthest uses leave first (2 at 20 batches counts as 16, the
  // window's end); a repeated hint keeps its nearest distance (9: 1, not 5).
  CHECK(Step(d, {10, 11}, {{1, 2}, {2, 20}, {6, 4}, {7, 1}, {8, 3}, {9, 5}, {9, 1}}) ==
        (std::vector<int64_t>{2, 6}));
  // Hints last one step: without them the least used go. Cached: 1 (2 uses),
  // 7, 8, 9, 10, 11 (1 use each since admitted); 1 stays.
  std::vector<int64_t> ev = Step(d, {12});
  CHECK(ev.size() == 1u && ev[0] != 1);
}

TEST_CASE(DirectoryEvictsUnhintedIdsBeforeAnyHintedOne) {
  // More slots are eligible at the threshold level than must go: only as
  // many as needed leave, wherever the clock hand stands, so an unhinted id
  // never outlives a hinted one and a nearer use never leaves before a
  // further one.
  for (int64_t rotate = 0; rotate < 6; ++rotate) {
    CacheDirectory d(6);
    std::vector<int64_t> fill;
    for (int64_t i = 0; i < 6; ++i) fill.push_back(1 + (i + rotate) % 6);
    CHECK(Step(d, fill).empty());  // 1..6, one use each, slots rotated
    // 1..4 hinted (distance 1), 5 and 6 not: 3 misses take 5, 6 and one of 1..4.
    std::vector<int64_t> ev = Step(d, {7, 8, 9}, {{1, 1}, {2, 1}, {3, 1}, {4, 1}});
    CHECK(ev.size() == 3u && ev[1] == 5 && ev[2] == 6 && ev[0] >= 1 && ev[0] <= 4);
  }
  for (int64_t rotate = 0; rotate < 6; ++rotate) {
    CacheDirectory d(6);
    std::vector<int64_t> fill;
    for (int64_t i = 0; i < 6; ++i) fill.push_back(1 + (i + rotate) % 6);
    CHECK(Step(d, fill).empty());
    // 1, 2 at distance 1, 3, 4 at distance 2, 5, 6 unhinted; 4 misses: 5, 6,
    // then 3 and 4 (the further use), never 1 or 2.
    CHECK(Step(d, {7, 8, 9, 10}, {{1, 1}, {2, 1}, {3, 2}, {4, 2}}) ==
          (std::vector<int64_t>{3, 4, 5, 6}));
  }
}

TEST_CASE(DirectoryLetsPastPopularityFade) {
  // Counters halve every 16 x capacity hits. Id 1 used in 100 steps, then
  // id 2 in 45: without halving 1 (99 hits) would outrank 2 (44 hits);
  // with it, the recent id stays and the stale one leaves.
  CacheDirectory d(3);
  for (int i = 0; i < 100; ++i) CHECK(Step(d, {1}).empty());
  for (int i = 0; i < 45; ++i) CHECK(Step(d, {2}).empty());
  CHECK(Step(d, {3}).empty());  // the third slot was free
  CHECK(Step(d, {4}) == (std::vector<int64_t>{3}));  // 3: used once
  CHECK(Step(d, {5, 6}) == (std::vector<int64_t>{1, 4}));
  CHECK(d.Probe(2) >= 0);
}

// Simulates the device side: a cache array, write-back of evicted rows (with
// their use counts) and a fetch of missed rows, plus an "update" that adds 1
// to the value and 10 to the state of every row used. Compares with a map
// model of every id's row and use count. With `schedule`, Prepare fetches
// host rows on another thread.
void RunStoreAgainstModel(const Scheduler* schedule) {
  StoreOptions o;
  o.table = Options(2, 1);
  o.cache_capacity = 32;
  EmbeddingStore store(o);
  const int w = store.table().width();
  std::vector<float> cache(o.cache_capacity * w, -1.0f);
  std::map<int64_t, std::vector<float>> model;
  std::map<int64_t, uint32_t> uses;
  std::mt19937_64 rng(11);
  for (int step = 0; step < 2000; ++step) {
    std::set<int64_t> uniq;
    const int n = 1 + rng() % 32;
    while (static_cast<int>(uniq.size()) < n) uniq.insert(rng() % 300 - 150);
    std::vector<int64_t> ids(uniq.begin(), uniq.end());
    PrepareResult r;
    CHECK(store.Prepare(ids.data(), ids.size(), &r, schedule).ok());
    CHECK_EQ(r.evict_uses.size(), r.evict_ids.size());
    // Write back, then fetch (the order the TF graph uses).
    std::vector<float> back;
    for (int32_t s : r.evict_slots) {
      back.insert(back.end(), cache.begin() + s * w, cache.begin() + (s + 1) * w);
    }
    CHECK(store.WriteBack(r.evict_ids.data(), r.evict_ids.size(), back.data(),
                          r.evict_uses.data())
              .ok());
    for (size_t m = 0; m < r.miss_slots.size(); ++m) {
      std::copy(r.miss_rows.begin() + m * w, r.miss_rows.begin() + (m + 1) * w,
                cache.begin() + r.miss_slots[m] * w);
    }
    // A flush writes back the rows updates marked dirty since their last
    // write-back, and then the host table holds every cached row as the
    // cache does. Here a flush comes between some steps' prepare and their
    // update (a traced call whose gradient an eager tape takes later), and
    // some flushes "fail" to write (not marked clean): both are written by
    // the next flush.
    auto flush = [&](bool write_fails) {
      std::vector<int64_t> f_ids, again_ids;
      std::vector<int32_t> f_slots, again_slots;
      store.CachedEntries(&f_ids, &f_slots);
      if (write_fails) {
        store.CachedEntries(&again_ids, &again_slots);
        CHECK(again_ids == f_ids);
        return;
      }
      for (size_t i = 0; i < f_ids.size(); ++i) {
        CHECK(store.table().Write(&f_ids[i], 1, cache.data() + f_slots[i] * w).ok());
      }
      store.MarkClean(f_slots.data(), static_cast<int64_t>(f_slots.size()));
      for (const auto& kv : model) {
        int32_t slot;
        store.Probe(&kv.first, 1, &slot);
        if (slot < 0) continue;
        std::vector<float> host(w);
        store.table().Find(&kv.first, 1, host.data());
        CHECK(std::equal(host.begin(), host.end(), cache.begin() + slot * w));
      }
      store.CachedEntries(&again_ids, &again_slots);
      CHECK(again_ids.empty());
    };
    if (step % 17 == 5) flush(/*write_fails=*/step % 3 == 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!model.count(ids[i])) {
        std::vector<float> init(w);
        store.table().InitialRow(ids[i], init.data());
        model[ids[i]] = init;
      }
      ++uses[ids[i]];
      std::vector<float>& want = model[ids[i]];
      float* row = cache.data() + r.slots[i] * w;
      for (int j = 0; j < w; ++j) CHECK_EQ(row[j], want[j]);
      for (int j = 0; j < 2; ++j) row[j] += 1.0f;
      for (int j = 2; j < 4; ++j) row[j] += 10.0f;
      std::copy(row, row + w, want.begin());
    }
    store.MarkDirty(r.slots.data(), static_cast<int64_t>(r.slots.size()));
    if (step % 23 == 7) flush(/*write_fails=*/false);
    if (step % 13 == 6) {
      // Between steps, remove a few ids, cached or not, held or never seen
      // (and one twice): each comes back later from its initial row, with
      // its uses counted from 0, and the slots of the cached ones are
      // filled again by later misses.
      std::vector<int64_t> gone;
      for (int k = 0; k < 6; ++k) gone.push_back(static_cast<int64_t>(rng() % 320) - 160);
      gone.push_back(gone[0]);
      std::set<int64_t> distinct(gone.begin(), gone.end());
      int64_t held = 0, cached_before = 0;
      for (int64_t id : distinct) {
        held += model.count(id);
        int32_t slot;
        store.Probe(&id, 1, &slot);
        cached_before += slot >= 0;
      }
      int64_t cached = -1;
      const int64_t cached_rows = store.Stats().cached_rows;
      CHECK_EQ(store.Remove(gone.data(), gone.size(), &cached), held);
      CHECK_EQ(cached, cached_before);
      for (int64_t id : distinct) {
        model.erase(id);
        uses.erase(id);
        int32_t slot;
        store.Probe(&id, 1, &slot);
        CHECK_EQ(slot, -1);
      }
      CHECK_EQ(store.Stats().cached_rows, cached_rows - cached);
    }
    if (step % 97 == 0) {
      // A read outside training: cached values from the cache, the others
      // from the host table, initial values for ids never seen.
      std::vector<float> values(o.cache_capacity * 2);
      for (int64_t s = 0; s < o.cache_capacity; ++s) {
        std::copy(cache.begin() + s * w, cache.begin() + s * w + 2, values.begin() + s * 2);
      }
      std::vector<int64_t> probe;
      for (int64_t id = -152; id < 152; ++id) probe.push_back(id);
      for (int64_t k = 0; k < 40; ++k) probe.push_back((int64_t{1} << 40) + k);  // never seen
      std::vector<float> got(probe.size() * 2, -7.0f);
      store.LookupValues(probe.data(), probe.size(), values.data(), got.data());
      for (size_t i = 0; i < probe.size(); ++i) {
        std::vector<float> want(w);
        if (model.count(probe[i])) {
          want = model[probe[i]];
        } else {
          store.table().InitialRow(probe[i], want.data());
        }
        CHECK_EQ(got[i * 2], want[0]);
        CHECK_EQ(got[i * 2 + 1], want[1]);
      }
      // Nothing was inserted.
      CHECK(store.table().size() <= static_cast<int64_t>(model.size()));
      std::vector<float> full(w), value(2);
      const int64_t unseen = int64_t{1} << 40;
      store.table().Find(&unseen, 1, full.data());
      store.table().Find(&unseen, 1, value.data(), /*values_only=*/true);
      CHECK(value[0] == full[0] && value[1] == full[1]);
    }
  }
  // Flush and compare every row.
  std::vector<int64_t> cached_ids;
  std::vector<int32_t> cached_slots;
  store.CachedEntries(&cached_ids, &cached_slots);
  for (size_t i = 0; i < cached_ids.size(); ++i) {
    store.table().Write(&cached_ids[i], 1, cache.data() + cached_slots[i] * w);
  }
  CHECK_EQ(store.table().size(), static_cast<int64_t>(model.size()));
  for (const auto& kv : model) {
    std::vector<float> got(w);
    store.table().Find(&kv.first, 1, got.data());
    CHECK(got == kv.second);
  }
  // Every step that used an id is counted once, whether it was cached then
  // (handed back at eviction or flush) or not.
  std::vector<int64_t> all_ids;
  std::vector<float> all_rows;
  std::vector<uint32_t> counts;
  store.table().Export(&all_ids, &all_rows, &counts);
  for (size_t i = 0; i < all_ids.size(); ++i) CHECK_EQ(counts[i], uses[all_ids[i]]);
  StoreStats st = store.Stats();
  CHECK(st.hits > 0 && st.misses > 0 && st.evictions > 0);
  // The write-backs went to the rows the cache remembered.
  CHECK(store.write_backs_by_handle() > 0);
}

TEST_CASE(StoreKeepsRowsAndStateThroughEvictions) { RunStoreAgainstModel(nullptr); }

TEST_CASE(StoreWithFetchOnAnotherThread) {
  // A new thread per task: Prepare must wait for the fetch it scheduled.
  const Scheduler schedule = [](std::function<void()> task) {
    std::thread(std::move(task)).detach();
  };
  RunStoreAgainstModel(&schedule);
}

// A large read on several threads gives what one thread gives: stored rows,
// initial rows of unseen ids (full width and values only), repeats; and so
// does LookupValues over a cache.
TEST_CASE(FindOnSeveralThreadsEqualsOneThread) {
  HostTable t(Options(3, 1));
  const int w = t.width();
  std::mt19937_64 rng(41);
  std::vector<int64_t> stored(5000);
  for (auto& id : stored) id = static_cast<int64_t>(rng());
  std::vector<float> rows(stored.size() * w);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 977) * 0.5f;
  CHECK(t.Write(stored.data(), stored.size(), rows.data()).ok());
  std::vector<int64_t> ids;
  for (int i = 0; i < 30000; ++i) {
    ids.push_back(i % 3 == 0 ? stored[rng() % stored.size()] : static_cast<int64_t>(rng()));
  }
  ids.push_back(ids[7]);  // a repeat
  const int64_t n = static_cast<int64_t>(ids.size());
  CHECK(n >= HostTable::kParallelFindIds);
  std::atomic<int> tasks{0};
  const Scheduler spawn = [&tasks](std::function<void()> task) {
    ++tasks;
    std::thread(std::move(task)).detach();
  };
  for (bool values_only : {false, true}) {
    const int cols = values_only ? t.dim() : w;
    std::vector<float> one(n * cols), many(n * cols, -1.0f);
    t.Find(ids.data(), n, one.data(), values_only);
    tasks = 0;
    t.Find(ids.data(), n, many.data(), values_only, &spawn, 4);
    CHECK_EQ(tasks.load(), 3);
    CHECK(one == many);
    // A small read stays on the calling thread.
    tasks = 0;
    t.Find(ids.data(), 100, many.data(), values_only, &spawn, 4);
    CHECK_EQ(tasks.load(), 0);
  }
  StoreOptions o;
  o.table = Options(3, 1);
  o.cache_capacity = 64;
  EmbeddingStore store(o);
  CHECK(store.WriteBack(stored.data(), 5000, rows.data(), nullptr).ok());
  PrepareResult r;
  CHECK(store.Prepare(stored.data(), 40, &r).ok());  // some cached ids
  std::vector<float> cache(64 * 3, 0.25f), one(n * 3), many(n * 3);
  store.LookupValues(ids.data(), n, cache.data(), one.data());
  store.LookupValues(ids.data(), n, cache.data(), many.data(), &spawn, 2);
  CHECK(one == many);
}

TEST_CASE(StorePrepareToleratesRepeatedIds) {
  StoreOptions o;
  o.table = Options(2, 1);
  o.cache_capacity = 4;
  EmbeddingStore store(o);
  const Scheduler schedule = [](std::function<void()> task) {
    std::thread(std::move(task)).detach();
  };
  const int64_t ids[] = {5, 6, 5};
  PrepareResult r;
  CHECK(store.Prepare(ids, 3, &r, &schedule).ok());
  CHECK_EQ(r.slots[0], r.slots[2]);
  CHECK_EQ(r.miss_slots.size(), 2u);  // one row per distinct id
  CHECK_EQ(r.miss_rows.size(), 2u * store.table().width());
  std::vector<float> want(store.table().width());
  store.table().InitialRow(6, want.data());
  CHECK(std::equal(want.begin(), want.end(),
                   r.miss_rows.begin() + store.table().width()));
  CHECK_EQ(store.Stats().cached_rows, 2);
}


TEST_CASE(StoreMaxRowsLeavesCacheUntouched) {
  StoreOptions o;
  o.table = Options(2, 0, /*max_rows=*/3);
  o.cache_capacity = 8;
  EmbeddingStore store(o);
  const int64_t a[] = {1, 2, 3};
  PrepareResult r;
  CHECK(store.Prepare(a, 3, &r).ok());
  const int64_t b[] = {1, 4};
  CoreStatus st = store.Prepare(b, 2, &r);
  CHECK(!st.ok());
  CHECK_EQ(store.Stats().cached_rows, 3);
  CHECK_EQ(store.Stats().host_rows, 3);
  int32_t slot = 0;
  const int64_t four = 4;
  store.Probe(&four, 1, &slot);
  CHECK_EQ(slot, -1);
}

TEST_CASE(StoreRequireDistinctRefusesRepeatsUnchanged) {
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 4;
  EmbeddingStore store(o);
  PrepareResult r;
  const int64_t first[] = {1, 2, 3};
  CHECK(store.Prepare(first, 3, &r, nullptr, EvictionHints(), true).ok());
  const StoreStats before = store.Stats();
  // A repeated cached id (2), then a repeated new id (9): each refused, and
  // the store is as before (no slot, no host row, no counter moved).
  const int64_t cached_twice[] = {2, 5, 2};
  const int64_t new_twice[] = {9, 1, 9};
  for (const int64_t* ids : {cached_twice, new_twice}) {
    CoreStatus st = store.Prepare(ids, 3, &r, nullptr, EvictionHints(), true);
    CHECK(!st.ok());
    CHECK(st.message().find("appears twice") != std::string::npos);
    CHECK(st.message().find("positions 0 and 2") != std::string::npos);
    const StoreStats after = store.Stats();
    CHECK_EQ(after.hits, before.hits);
    CHECK_EQ(after.misses, before.misses);
    CHECK_EQ(after.host_rows, before.host_rows);
    CHECK_EQ(after.cached_rows, before.cached_rows);
  }
  int32_t slots[2];
  const int64_t probe[] = {5, 9};
  store.Probe(probe, 2, slots);
  CHECK_EQ(slots[0], -1);
  CHECK_EQ(slots[1], -1);
  // Distinct ids still pass, many times over (the marks are reused).
  for (int k = 0; k < 100; ++k) {
    const int64_t ids[] = {1, 2, 3, 100 + k};
    CHECK(store.Prepare(ids, 4, &r, nullptr, EvictionHints(), true).ok());
  }
  // More ids than the cache holds, two of them distinct: the repeat is
  // named, not the capacity.
  const int64_t copies[] = {7, 7, 7, 7, 7, 8};
  CoreStatus st = store.Prepare(copies, 6, &r, nullptr, EvictionHints(), true);
  CHECK(!st.ok());
  CHECK(st.message().find("id 7 appears twice") != std::string::npos);
  CHECK(st.message().find("positions 0 and 1") != std::string::npos);
  // Distinct ids past the capacity: the capacity.
  const int64_t many[] = {10, 11, 12, 13, 14};
  st = store.Prepare(many, 5, &r, nullptr, EvictionHints(), true);
  CHECK(!st.ok());
  CHECK(st.message().find("5 distinct ids but cache_capacity is 4") != std::string::npos);
}

// Reference de-duplication: first-occurrence order, then a stable grouping by
// owner; the inverse follows the ids.
void ReferenceDedup(const std::vector<int64_t>& ids, int32_t groups,
                    std::vector<int64_t>* unique, std::vector<int32_t>* inverse,
                    std::vector<int32_t>* sizes) {
  std::vector<int64_t> first;
  std::unordered_map<int64_t, int32_t> index;
  std::vector<int32_t> first_inverse;
  for (int64_t id : ids) {
    auto it = index.emplace(id, static_cast<int32_t>(first.size())).first;
    if (it->second == static_cast<int32_t>(first.size())) first.push_back(id);
    first_inverse.push_back(it->second);
  }
  sizes->assign(groups, 0);
  std::vector<int32_t> to(first.size());
  unique->clear();
  for (int32_t g = 0; g < groups; ++g) {
    for (size_t k = 0; k < first.size(); ++k) {
      if (static_cast<int32_t>(Mix64(static_cast<uint64_t>(first[k])) % groups) != g) continue;
      to[k] = static_cast<int32_t>(unique->size());
      unique->push_back(first[k]);
      ++(*sizes)[g];
    }
  }
  inverse->clear();
  for (int32_t k : first_inverse) inverse->push_back(to[k]);
}

TEST_CASE(FirstBadInverseFindsTheFirstMismatch) {
  // A de-duplication's own output passes; each kind of damage is found at
  // its position, in either index type.
  std::mt19937_64 rng(3);
  std::vector<int64_t> ids(3000);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % 500) - 250;
  Deduplicator dedup;
  std::vector<int64_t> unique;
  std::vector<int32_t> inverse(ids.size());
  dedup.Run(ids.data(), ids.size(), 1, &unique, inverse.data(), nullptr);
  const int64_t n = static_cast<int64_t>(ids.size()), u = static_cast<int64_t>(unique.size());
  CHECK_EQ(FirstBadInverse(ids.data(), unique.data(), u, inverse.data(), n), int64_t{-1});
  std::vector<int64_t> wide(inverse.begin(), inverse.end());
  CHECK_EQ(FirstBadInverse(ids.data(), unique.data(), u, wide.data(), n), int64_t{-1});
  CHECK_EQ(FirstBadInverse(ids.data(), unique.data(), u, inverse.data(), int64_t{0}),
           int64_t{-1});
  for (int64_t at : {int64_t{0}, int64_t{1234}, n - 1}) {
    for (int64_t bad : {int64_t{-1}, u, int64_t{1} << 32, (inverse[at] + 1) % u}) {
      std::vector<int64_t> damaged = wide;
      damaged[at] = bad;
      CHECK_EQ(FirstBadInverse(ids.data(), unique.data(), u, damaged.data(), n), at);
    }
    std::vector<int64_t> other = ids;
    other[at] += 1;
    CHECK_EQ(FirstBadInverse(other.data(), unique.data(), u, inverse.data(), n), at);
  }
}

TEST_CASE(DedupMatchesReference) {
  std::mt19937_64 rng(11);
  Deduplicator dedup;  // one instance: later batches reuse its table
  // Sizes cover the empty batch, all-distinct batches (the table doubles)
  // and repeated ids; the id ranges include negatives and extremes.
  const int64_t sizes[] = {0, 1, 7, 100, 5000, 40000, 3, 70000, 20};
  for (int round = 0; round < 2; ++round) {
    for (int64_t n : sizes) {
      for (int32_t groups : {1, 2, 3, 8}) {
        std::vector<int64_t> ids(n);
        const uint64_t range = (n % 2 == 0) ? 1 + n / 4 : ~uint64_t{0};
        for (auto& id : ids) {
          const uint64_t r = rng() % range;
          id = static_cast<int64_t>(range == ~uint64_t{0} ? rng() : r * 0x9e3779b97f4a7c15ULL);
        }
        if (n > 2) {
          ids[1] = INT64_MIN;
          ids[2] = INT64_MAX;
        }
        std::vector<int64_t> want_u;
        std::vector<int32_t> want_inv, want_sizes;
        ReferenceDedup(ids, groups, &want_u, &want_inv, &want_sizes);
        std::vector<int64_t> got_u;
        std::vector<int32_t> got_inv(n, -1), got_sizes(groups, -1);
        dedup.Run(ids.data(), n, groups, &got_u, got_inv.data(), got_sizes.data());
        CHECK(got_u == want_u);
        CHECK(got_inv == want_inv);
        CHECK(got_sizes == want_sizes);
      }
    }
    dedup.Trim(0);  // the second round starts from an empty table
    CHECK_EQ(dedup.ScratchBytes(), size_t{0});
  }
}

// Any split of the segments into ranges gives the bits of one sequential
// pass, for the unrolled widths and the generic one; FirstBadSegment finds
// the first id out of range.
TEST_CASE(AdagradRowsMatchesScalarFormula) {
  // Every lane, including the tail of a width that is not a multiple of 4,
  // gets a += s; w -= (lr * g) / (sqrt(a) + eps) with float roundings; rows
  // that are not indexed stay as they were; a repeated index updates twice.
  for (int dim : {1, 5, 16, 19}) {
    for (bool with_sq : {false, true}) {
      std::mt19937 rng(dim);
      std::uniform_real_distribution<float> u(0.1f, 2.0f);
      const int rows = 50;
      std::vector<float> w(rows * dim), a(rows * dim);
      for (auto& x : w) x = u(rng) - 1.0f;
      for (auto& x : a) x = u(rng);
      const std::vector<int32_t> idx = {7, 3, 41, 7, 0, 49, 12, 33, 8, 21, 30};
      const int n = static_cast<int>(idx.size());
      std::vector<float> g(n * dim), s(n * dim);
      for (auto& x : g) x = u(rng) - 1.0f;
      for (auto& x : s) x = u(rng);
      std::vector<float> ref_w = w, ref_a = a;
      for (int i = 0; i < n; ++i) {
        for (int d = 0; d < dim; ++d) {
          float& aa = ref_a[idx[i] * dim + d];
          float& ww = ref_w[idx[i] * dim + d];
          const float gg = g[i * dim + d];
          aa += with_sq ? s[i * dim + d] : gg * gg;
          ww -= (0.05f * gg) / (std::sqrt(aa) + 1e-3f);
        }
      }
      AdagradRows(w.data(), a.data(), dim, g.data(), with_sq ? s.data() : nullptr,
                  idx.data(), n, 0.05f, 1e-3f);
      CHECK(w == ref_w);
      CHECK(a == ref_a);
    }
  }
}

TEST_CASE(AllFiniteFindsEveryNonFiniteValue) {
  // Huge finite values are finite (no overflow from summing them); a NaN or
  // an infinity anywhere, in the vector part or the tail, is found.
  for (int n : {0, 1, 7, 8, 9, 37}) {
    std::vector<float> x(n, 3.0e38f);
    for (int i = 0; i < n; i += 2) x[i] = -3.0e38f;
    CHECK(AllFinite(x.data(), n));
    for (int i = 0; i < n; ++i) {
      for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
        const float keep = x[i];
        x[i] = bad;
        CHECK(!AllFinite(x.data(), n));
        CHECK(!AllFinite(x.data(), n, /*squares=*/true));
        x[i] = keep;
      }
    }
  }
}

TEST_CASE(AllFiniteWithSquaresFindsValuesWhoseSquareOverflows) {
  // |x| up to 2**63 squares to a finite float; 2**64 (and 3e38) do not.
  for (int n : {1, 7, 8, 9, 37}) {
    std::vector<float> x(n, 9.2e18f);
    for (int i = 0; i < n; i += 2) x[i] = -9.2e18f;
    CHECK(AllFinite(x.data(), n, /*squares=*/true));
    for (int i = 0; i < n; ++i) {
      for (float big : {1.8446744e19f, -1.8446744e19f, 3.0e38f}) {
        const float keep = x[i];
        x[i] = big;
        CHECK(AllFinite(x.data(), n));
        CHECK(!AllFinite(x.data(), n, /*squares=*/true));
        x[i] = keep;
      }
    }
  }
}

TEST_CASE(FtrlMatchesTheFormulaAndColumnSplitsKeepEveryBit) {
  // Against a double-precision reference of the documented formula, for the
  // sqrt power and a general one, with and without sums of squares; a split
  // into column ranges gives the same bits; rows not indexed stay put.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const int64_t rows = 50, dim = 37, n = 30;
  std::vector<int32_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int32_t>((i * 7) % rows);
  idx[n - 1] = idx[0];  // a repeated index is updated twice, in turn
  std::vector<float> grad(n * dim), sq(n * dim);
  for (int64_t i = 0; i < n * dim; ++i) {
    grad[i] = normal(rng);
    sq[i] = grad[i] * grad[i] * 1.5f;
  }
  for (float power : {-0.5f, -0.3f}) {
    for (bool with_sq : {false, true}) {
      const FtrlParams p{0.2f, 0.3f, 0.05f, 0.01f, power};
      std::vector<float> w(rows * dim), a(rows * dim), z(rows * dim);
      for (int64_t k = 0; k < rows * dim; ++k) {
        w[k] = normal(rng);
        a[k] = 0.1f + std::fabs(normal(rng));
        z[k] = normal(rng);
      }
      std::vector<double> rw(w.begin(), w.end()), ra(a.begin(), a.end()),
          rz(z.begin(), z.end());
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t d = 0; d < dim; ++d) {
          const int64_t k = idx[i] * dim + d;
          const double g = grad[i * dim + d];
          const double nn = ra[k] + (with_sq ? sq[i * dim + d] : g * g);
          const double pn = std::pow(nn, -power), po = std::pow(ra[k], -power);
          rz[k] += g + 2 * p.l2_shrinkage * rw[k] - (pn - po) / p.lr * rw[k];
          rw[k] = (std::min(std::max(rz[k], -double(p.l1)), double(p.l1)) - rz[k]) /
                  (pn / p.lr + 2 * p.l2);
          ra[k] = nn;
        }
      }
      std::vector<float> w2 = w, a2 = a, z2 = z;
      const float* s = with_sq ? sq.data() : nullptr;
      FtrlColumns(w.data(), a.data(), z.data(), dim, grad.data(), s, idx.data(), n, p, 0, dim);
      for (int64_t begin : {0, 16, 32}) {
        FtrlColumns(w2.data(), a2.data(), z2.data(), dim, grad.data(), s, idx.data(), n, p,
                    begin, std::min<int64_t>(dim, begin + 16));
      }
      CHECK(w == w2);
      CHECK(a == a2);
      CHECK(z == z2);
      for (int64_t k = 0; k < rows * dim; ++k) {
        CHECK(std::fabs(w[k] - rw[k]) <= 1e-4 * (1 + std::fabs(rw[k])));
        CHECK(std::fabs(z[k] - rz[k]) <= 1e-4 * (1 + std::fabs(rz[k])));
        CHECK(std::fabs(a[k] - ra[k]) <= 1e-5 * (1 + std::fabs(ra[k])));
      }
    }
  }
}

// Every width the kernel unrolls (8, 16, 32, 64, 128: runs of one segment add
// into local accumulators) and others, with segments at random and sorted (a
// ragged batch's rows): the bits of a plain loop over the rows in order.
TEST_CASE(SegmentSumsSplitInvariant) {
  std::mt19937_64 rng(7);
  for (int64_t dim : {1, 5, 8, 16, 32, 64, 128})
  for (bool sorted : {false, true}) {
    const int64_t n = 2000, segments = 300;
    std::vector<float> data(n * dim);
    std::vector<int32_t> seg(n);
    std::normal_distribution<float> normal;
    for (float& x : data) x = normal(rng);
    for (int32_t& s : seg) s = static_cast<int32_t>(rng() % (rng() % 2 ? 10 : segments));
    if (sorted) std::sort(seg.begin(), seg.end());
    std::vector<float> want(segments * dim, 0.0f), want_sq(segments * dim, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < dim; ++k) {
        want[seg[i] * dim + k] += data[i * dim + k];
        want_sq[seg[i] * dim + k] += data[i * dim + k] * data[i * dim + k];
      }
    }
    for (int64_t parts : {1, 2, 7, 300}) {
      std::vector<float> sums(segments * dim, -1.0f), sq(segments * dim, -1.0f);
      const int64_t per = (segments + parts - 1) / parts;
      for (int64_t b = 0; b < segments; b += per) {
        sfctr::SegmentSums(data.data(), nullptr, seg.data(), n, dim, b,
                           std::min(segments, b + per), sums.data(), sq.data());
      }
      CHECK(std::memcmp(sums.data(), want.data(), want.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(sq.data(), want_sq.data(), want_sq.size() * sizeof(float)) == 0);
    }
    std::vector<float> only(segments * dim, -1.0f);
    sfctr::SegmentSums(data.data(), nullptr, seg.data(), n, dim, 0, segments, only.data(),
                       nullptr);
    CHECK(only == want);
  }
  const std::vector<int32_t> ids = {0, 2, 3, -1};
  CHECK_EQ(sfctr::FirstBadSegment(ids.data(), 4, 4), int64_t{3});
  CHECK_EQ(sfctr::FirstBadSegment(ids.data(), 4, 3), int64_t{2});
  CHECK_EQ(sfctr::FirstBadSegment(ids.data(), 3, 4), int64_t{-1});
}

// With data_rows, each summed row is read from data by index: the same bits
// as summing the gathered rows, under any split into segment ranges.
TEST_CASE(SegmentSumsOfIndexedRowsEqualGatheredRows) {
  std::mt19937_64 rng(11);
  for (int64_t dim : {3, 16, 64}) {
    const int64_t rows = 50, n = 1500, segments = 200;
    std::vector<float> data(rows * dim);
    std::normal_distribution<float> normal;
    for (float& x : data) x = normal(rng);
    std::vector<int32_t> at(n), seg(n);
    for (int64_t i = 0; i < n; ++i) {
      at[i] = static_cast<int32_t>(i * rows / n);  // sorted, as a ragged batch's row ids
      seg[i] = static_cast<int32_t>(rng() % segments);
    }
    std::vector<float> gathered(n * dim);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&gathered[i * dim], &data[at[i] * dim], dim * sizeof(float));
    }
    std::vector<float> want(segments * dim), want_sq(segments * dim);
    sfctr::SegmentSums(gathered.data(), nullptr, seg.data(), n, dim, 0, segments, want.data(),
                       want_sq.data());
    for (int64_t parts : {1, 3, 200}) {
      std::vector<float> sums(segments * dim, -1.0f), sq(segments * dim, -1.0f);
      const int64_t per = (segments + parts - 1) / parts;
      for (int64_t b = 0; b < segments; b += per) {
        sfctr::SegmentSums(data.data(), at.data(), seg.data(), n, dim, b,
                           std::min(segments, b + per), sums.data(), sq.data());
      }
      CHECK(std::memcmp(sums.data(), want.data(), want.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(sq.data(), want_sq.data(), want_sq.size() * sizeof(float)) == 0);
    }
  }
}

// Row ids from row splits: empty rows first, inside and last; both split
// types; FirstBadSplit names a nonzero start or a decrease.
TEST_CASE(RowIdsFromSplitsMatchesRowLengths) {
  const std::vector<int64_t> lengths = {0, 3, 1, 0, 0, 5, 2, 0};
  std::vector<int64_t> splits64 = {0};
  std::vector<int32_t> want;
  for (size_t r = 0; r < lengths.size(); ++r) {
    splits64.push_back(splits64.back() + lengths[r]);
    want.insert(want.end(), lengths[r], static_cast<int32_t>(r));
  }
  const std::vector<int32_t> splits32(splits64.begin(), splits64.end());
  const int64_t nrows = static_cast<int64_t>(lengths.size());
  CHECK_EQ(sfctr::FirstBadSplit(splits64.data(), nrows), int64_t{-1});
  CHECK_EQ(sfctr::FirstBadSplit(splits32.data(), nrows), int64_t{-1});
  std::vector<int32_t> got(want.size(), -1), got32(want.size(), -1);
  sfctr::RowIdsFromSplits(splits64.data(), nrows, got.data());
  sfctr::RowIdsFromSplits(splits32.data(), nrows, got32.data());
  CHECK(got == want);
  CHECK(got32 == want);
  const std::vector<int64_t> none = {0};  // no rows
  CHECK_EQ(sfctr::FirstBadSplit(none.data(), 0), int64_t{-1});
  const std::vector<int64_t> late = {1, 2}, down = {0, 4, 3, 5};
  CHECK_EQ(sfctr::FirstBadSplit(late.data(), 1), int64_t{0});
  CHECK_EQ(sfctr::FirstBadSplit(down.data(), 3), int64_t{2});
}

// Every shard runs exactly once whether helpers start at once, never start
// before the work is done (a busy pool), or run on real threads; a helper
// that starts after RunShards returned finds nothing to do.
TEST_CASE(RunShardsNeverWaitsForABusyPool) {
  std::vector<std::function<void()>> deferred;
  const sfctr::Scheduler busy = [&](std::function<void()> task) {
    deferred.push_back(std::move(task));
  };
  std::vector<int> runs(10, 0);
  sfctr::RunShards(&busy, 10, 3, [&](int64_t s) { ++runs[s]; });
  CHECK(runs == std::vector<int>(10, 1));  // the caller ran them all
  CHECK_EQ(deferred.size(), size_t{3});
  for (auto& task : deferred) task();      // late helpers: no shard left
  CHECK(runs == std::vector<int>(10, 1));

  std::vector<std::thread> threads;
  std::mutex mu;
  const sfctr::Scheduler spawn = [&](std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu);
    threads.emplace_back(std::move(task));
  };
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> counts(64);
    sfctr::RunShards(&spawn, 64, 3, [&](int64_t s) { counts[s].fetch_add(1); });
    for (auto& c : counts) CHECK_EQ(c.load(), 1);
  }
  for (auto& t : threads) t.join();
  int inline_runs = 0;
  sfctr::RunShards(nullptr, 4, 2, [&](int64_t) { ++inline_runs; });
  CHECK_EQ(inline_runs, 4);
}

// A write-back finds its rows by handle only when its ids are the last
// Prepare's evictions and the host table was not cleared since; otherwise
// it takes the by-id path, with the same result.
TEST_CASE(StoreWriteBackByHandleOnlyWhenItIsSafe) {
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 4;
  EmbeddingStore store(o);
  const int w = store.table().width();
  bool prepared = true;
  const auto prepare = [&](std::vector<int64_t> ids) -> PrepareResult {
    PrepareResult r;
    prepared = prepared && store.Prepare(ids.data(), ids.size(), &r).ok();
    return r;
  };
  const auto row_of = [&](int64_t id) {
    std::vector<float> got(w);
    store.table().Find(&id, 1, got.data());
    return got;
  };
  prepare({1, 2, 3, 4});
  PrepareResult r = prepare({5, 6});
  CHECK_EQ(r.evict_ids.size(), size_t{2});
  // Reversed: not the evictions as recorded, so written by id.
  std::vector<int64_t> reversed(r.evict_ids.rbegin(), r.evict_ids.rend());
  std::vector<float> rows = {7, 7, 8, 8};
  CHECK(store.WriteBack(reversed.data(), 2, rows.data(), nullptr).ok());
  CHECK_EQ(store.write_backs_by_handle(), int64_t{0});
  CHECK(row_of(reversed[0]) == std::vector<float>({7, 7}));
  CHECK(row_of(reversed[1]) == std::vector<float>({8, 8}));
  // As recorded: by handle.
  r = prepare({7, 8});
  rows = {1, 2, 3, 4};
  CHECK(store.WriteBack(r.evict_ids.data(), 2, rows.data(), nullptr).ok());
  CHECK_EQ(store.write_backs_by_handle(), int64_t{1});
  CHECK(row_of(r.evict_ids[0]) == std::vector<float>({1, 2}));
  CHECK(row_of(r.evict_ids[1]) == std::vector<float>({3, 4}));
  // The same evictions again: consumed, so by id (same rows, same result).
  rows = {5, 6, 7, 8};
  CHECK(store.WriteBack(r.evict_ids.data(), 2, rows.data(), nullptr).ok());
  CHECK_EQ(store.write_backs_by_handle(), int64_t{1});
  CHECK(row_of(r.evict_ids[1]) == std::vector<float>({7, 8}));
  // A host table cleared between Prepare and write-back: the handles are
  // void, the rows are inserted by id.
  r = prepare({9, 10});
  store.ClearHost();
  rows = {9, 9, 10, 10};
  CHECK(store.WriteBack(r.evict_ids.data(), 2, rows.data(), nullptr).ok());
  CHECK_EQ(store.write_backs_by_handle(), int64_t{1});
  CHECK_EQ(store.table().size(), int64_t{2});
  CHECK(row_of(r.evict_ids[0]) == std::vector<float>({9, 9}));
  CHECK(row_of(r.evict_ids[1]) == std::vector<float>({10, 10}));
  CHECK(prepared);
}

TEST_CASE(HostTablePruneRemovesRarelyUsedRowsAndReusesThem) {
  HostTable t(Options(2, 1, /*max_rows=*/3000));
  const int w = t.width();
  std::vector<int64_t> ids;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i) ids.push_back(static_cast<int64_t>(rng()));
  std::vector<float> rows(ids.size() * w);
  std::vector<uint32_t> counts(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int j = 0; j < w; ++j) rows[i * w + j] = static_cast<float>(i) + 0.5f * j;
    counts[i] = static_cast<uint32_t>(i % 4);  // 0, 1, 2, 3 uses
  }
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), counts.data()).ok());
  // Bytes of the row arena: everything but the index entries (12 bytes each).
  const auto arena_bytes = [&t] {
    size_t entries = 0;
    for (size_t e : t.IndexEntries()) entries += e;
    return t.AllocatedBytes() - 12 * entries;
  };
  const size_t bytes = arena_bytes();
  // Keep ids with >= 2 uses, and ids[1] (1 use) because it is asked to.
  const std::unordered_set<int64_t> keep = {ids[1]};
  CHECK_EQ(t.Prune(2, keep), int64_t{999});
  CHECK_EQ(t.size(), int64_t{1001});
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> out_counts;
  t.Export(&out_ids, &out_rows, &out_counts);
  CHECK_EQ(out_ids.size(), size_t{1001});
  std::map<int64_t, size_t> where;
  for (size_t i = 0; i < ids.size(); ++i) where[ids[i]] = i;
  for (size_t k = 0; k < out_ids.size(); ++k) {
    const size_t i = where[out_ids[k]];
    CHECK(counts[i] >= 2 || i == 1);
    CHECK_EQ(out_counts[k], counts[i]);
    for (int j = 0; j < w; ++j) CHECK_EQ(out_rows[k * w + j], rows[i * w + j]);
  }
  // A pruned id reads as its initial row again; so does Find of every
  // survivor after the index rebuild.
  std::vector<float> got(w), init(w);
  t.Find(&ids[0], 1, got.data());
  t.InitialRow(ids[0], init.data());
  CHECK(got == init);
  for (size_t i = 0; i < ids.size(); i += 7) {
    if (counts[i] < 2 && i != 1) continue;
    t.Find(&ids[i], 1, got.data());
    CHECK_EQ(got[0], rows[i * w]);
  }
  // New rows reuse the freed ones: as many new ids as were pruned take no
  // more row memory.
  std::vector<int64_t> fresh;
  for (int i = 0; i < 1999; ++i) fresh.push_back(static_cast<int64_t>(rng()));
  std::vector<float> fresh_rows(fresh.size() * w, 3.0f);
  CHECK(t.Write(fresh.data(), 999, fresh_rows.data()).ok());
  CHECK_EQ(arena_bytes(), bytes);
  // And the room under max_rows came back.
  CHECK(t.Write(fresh.data() + 999, 1000, fresh_rows.data()).ok());
  CHECK_EQ(t.size(), int64_t{3000});
  CHECK(!t.Write(&ids[0], 1, fresh_rows.data()).ok());  // pruned, so new: over max_rows
  t.Find(&fresh[5], 1, got.data());
  CHECK_EQ(got[0], 3.0f);
  t.Find(&fresh[1500], 1, got.data());
  CHECK_EQ(got[0], 3.0f);
  t.Find(&ids[3], 1, got.data());  // 3 uses: kept, and not overwritten
  CHECK_EQ(got[0], rows[3 * w]);
  CHECK_EQ(t.Prune(0, {}), int64_t{0});  // nothing is below 0 uses
}

TEST_CASE(HostTablePruneToSizeRemovesTheLeastUsedAndBreaksTiesById) {
  HostTable t(Options(2, 0));
  std::vector<int64_t> ids;
  std::vector<uint32_t> counts;
  std::mt19937_64 rng(9);
  for (int i = 0; i < 3000; ++i) {
    ids.push_back(static_cast<int64_t>(rng()));
    counts.push_back(i < 100 ? 70000 : static_cast<uint32_t>(i % 5));  // 0..4; some saturate
  }
  std::vector<float> rows(ids.size() * 2, 1.0f);
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), counts.data()).ok());
  uint32_t min_count = 99;
  CHECK_EQ(t.PruneToSize(5000, {}, &min_count), int64_t{0});  // already below
  CHECK_EQ(min_count, uint32_t{0});
  // 2900 ids have 0..4 uses, 580 each; keep 1500 rows: all with 0 or 1
  // use go (1159: one 0-use id is kept), and of the 2-use ones the 341 with
  // the smallest ids.
  const int64_t kept_id = ids[100];  // 0 uses, but asked to be kept
  CHECK_EQ(t.PruneToSize(1500, {kept_id}, &min_count), int64_t{1500});
  CHECK_EQ(min_count, uint32_t{3});
  CHECK_EQ(t.size(), int64_t{1500});
  std::vector<int64_t> out_ids, two_uses;
  std::vector<float> out_rows;
  std::vector<uint32_t> out_counts;
  t.Export(&out_ids, &out_rows, &out_counts);
  std::set<int64_t> left(out_ids.begin(), out_ids.end());
  CHECK(left.count(kept_id) == 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t c = counts[i];
    if (ids[i] == kept_id || c >= 3) CHECK(left.count(ids[i]) == 1);
    if (c < 2 && ids[i] != kept_id) CHECK(left.count(ids[i]) == 0);
    if (c == 2) two_uses.push_back(ids[i]);
  }
  std::sort(two_uses.begin(), two_uses.end());
  for (size_t k = 0; k < two_uses.size(); ++k) {
    CHECK_EQ(left.count(two_uses[k]), size_t{k >= 341});  // the smallest ids went
  }
  // To 0 rows: everything not kept goes, saturated counts too.
  CHECK_EQ(t.PruneToSize(0, {kept_id}, &min_count), int64_t{1499});
  CHECK_EQ(min_count, uint32_t{0x10000});
  CHECK_EQ(t.size(), int64_t{1});
  CHECK_EQ(t.PruneToSize(0, {kept_id}, &min_count), int64_t{0});  // only the kept id is left
  CHECK_EQ(min_count, uint32_t{0});
  // Gaps between counts: the most used id that went had 5 uses, not 6-1.
  HostTable g(Options(2, 0));
  std::vector<int64_t> gids = {1, 2, 3, 4};
  std::vector<uint32_t> gcounts = {0, 5, 9, 9};
  std::vector<float> grows(8, 1.0f);
  CHECK(g.Write(gids.data(), 4, grows.data(), gcounts.data()).ok());
  CHECK_EQ(g.PruneToSize(2, {}, &min_count), int64_t{2});
  CHECK_EQ(min_count, uint32_t{6});
}

TEST_CASE(HostTablePruneInPartsOverShardsMatchesPruneToSizeOfTheWhole) {
  // One table, and the same ids split over two tables (a sharded table's
  // processes): the histogram, tied ids and PruneBelow over both remove what
  // PruneToSize removes from the one.
  HostTable whole(Options(2, 0)), part0(Options(2, 0)), part1(Options(2, 0));
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids[2];
  std::vector<uint32_t> counts[2];
  for (int i = 0; i < 2000; ++i) {
    const int64_t id = static_cast<int64_t>(rng());
    const uint32_t c = static_cast<uint32_t>(rng() % 4) + (i % 97 == 0 ? 70000 : 0);
    const int k = i % 3 == 0 ? 1 : 0;  // uneven shards, 2:1
    ids[k].push_back(id);
    counts[k].push_back(c);
  }
  std::vector<float> rows(4000, 1.0f);
  for (int k = 0; k < 2; ++k) {
    CHECK(whole.Write(ids[k].data(), ids[k].size(), rows.data(), counts[k].data()).ok());
    HostTable& part = k == 0 ? part0 : part1;
    CHECK(part.Write(ids[k].data(), ids[k].size(), rows.data(), counts[k].data()).ok());
  }
  const std::unordered_set<int64_t> keep0 = {ids[0][3], ids[0][4]}, keep1 = {ids[1][7]};
  std::unordered_set<int64_t> keep = keep0;
  keep.insert(keep1.begin(), keep1.end());
  for (int64_t max_rows : {int64_t{1400}, int64_t{1000}, int64_t{0}}) {
    int64_t held0 = 0, held1 = 0;
    const std::vector<int64_t> h0 = part0.UseCountHistogram(keep0, &held0);
    const std::vector<int64_t> h1 = part1.UseCountHistogram(keep1, &held1);
    CHECK_EQ(h0.size(), size_t{65536});
    int64_t excess = held0 + held1 - max_rows;
    uint32_t below = 0;
    while (excess > 0 && below <= 65535 && h0[below] + h1[below] <= excess) {
      excess -= h0[below] + h1[below];
      ++below;
    }
    bool has_last = false;
    int64_t last = 0;
    if (excess > 0 && below <= 65535) {
      std::vector<int64_t> tied = part0.TiedIds(below, keep0);
      CHECK(std::is_sorted(tied.begin(), tied.end()));
      const std::vector<int64_t> t1 = part1.TiedIds(below, keep1);
      CHECK_EQ(static_cast<int64_t>(tied.size() + t1.size()), h0[below] + h1[below]);
      tied.insert(tied.end(), t1.begin(), t1.end());
      std::sort(tied.begin(), tied.end());
      has_last = true;
      last = tied[static_cast<size_t>(excess) - 1];
    }
    const int64_t removed = part0.PruneBelow(below, has_last, last, keep0) +
                            part1.PruneBelow(below, has_last, last, keep1);
    uint32_t min_count = 0;
    CHECK_EQ(removed, whole.PruneToSize(max_rows, keep, &min_count));
    std::vector<int64_t> left, left0, left1;
    std::vector<float> unused_rows;
    std::vector<uint32_t> unused_counts;
    whole.Export(&left, &unused_rows, &unused_counts);
    part0.Export(&left0, &unused_rows, &unused_counts);
    part1.Export(&left1, &unused_rows, &unused_counts);
    left0.insert(left0.end(), left1.begin(), left1.end());
    std::sort(left.begin(), left.end());
    std::sort(left0.begin(), left0.end());
    CHECK(left == left0);
    CHECK_EQ(static_cast<int64_t>(left.size()), std::max<int64_t>(max_rows, 3));
  }
  // Decay without removal: every count is halved, nothing goes.
  std::vector<int64_t> before_ids, after_ids;
  std::vector<float> unused_rows;
  std::vector<uint32_t> before, after;
  part0.Export(&before_ids, &unused_rows, &before);
  CHECK_EQ(part0.PruneBelow(0, false, 0, {}, 0.5), int64_t{0});
  part0.Export(&after_ids, &unused_rows, &after);
  CHECK(before_ids == after_ids && before_ids.size() == 2);
  for (size_t i = 0; i < 2; ++i) CHECK_EQ(after[i], before[i] / 2);
}

TEST_CASE(HostTableRemoveDeletesInPlaceAndReusesRows) {
  // Many ids in few shards, so that probe runs are long and the backward
  // shift of later entries is exercised; checked against a map model.
  HostTableOptions o = Options(3, 1);
  o.num_shards = 2;
  HostTable t(o);
  std::mt19937_64 rng(21);
  std::map<int64_t, float> model;  // id -> first value
  std::vector<int64_t> ids;
  for (int i = 0; i < 20000; ++i) ids.push_back(static_cast<int64_t>(rng() % 60000) - 30000);
  std::vector<float> rows(ids.size() * 6);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i / 6);
  std::vector<uint32_t> counts(ids.size(), 3);
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), counts.data()).ok());
  for (size_t i = 0; i < ids.size(); ++i) model[ids[i]] = static_cast<float>(i);  // last wins
  const size_t bytes = t.AllocatedBytes();
  for (int round = 0; round < 4; ++round) {
    // Held ids, absent ones and repeats.
    std::vector<int64_t> gone;
    for (int k = 0; k < 3000; ++k) gone.push_back(static_cast<int64_t>(rng() % 64000) - 32000);
    gone.insert(gone.end(), gone.begin(), gone.begin() + 100);
    int64_t held = 0;
    for (int64_t id : std::set<int64_t>(gone.begin(), gone.end())) held += model.count(id);
    CHECK_EQ(t.Remove(gone.data(), gone.size()), held);
    for (int64_t id : gone) model.erase(id);
    CHECK_EQ(t.size(), static_cast<int64_t>(model.size()));
    std::vector<int64_t> all;
    for (int64_t id = -32000; id < 32000; ++id) all.push_back(id);
    std::vector<float> got(all.size() * 6);
    t.Find(all.data(), all.size(), got.data());
    for (size_t i = 0; i < all.size(); ++i) {
      auto it = model.find(all[i]);
      if (it != model.end()) {
        CHECK_EQ(got[i * 6], it->second);
      } else {
        std::vector<float> init(6);
        t.InitialRow(all[i], init.data());
        CHECK_EQ(got[i * 6], init[0]);
      }
    }
    CHECK_EQ(t.CountMissing(all.data(), all.size()),
             static_cast<int64_t>(all.size() - model.size()));
    // Removed ids come back from their initial row with no uses, in the
    // rows the removal freed (no new memory).
    std::vector<int64_t> back(gone.begin(), gone.begin() + 500);
    std::sort(back.begin(), back.end());
    back.erase(std::unique(back.begin(), back.end()), back.end());
    std::vector<float> fresh(back.size() * 6);
    CHECK(t.Reserve(back.size()).ok());
    std::vector<uint32_t> uses(back.size(), 99);
    CHECK(t.FindOrInsertReserved(back.data(), back.size(), fresh.data(), back.size(),
                                 uses.data()).ok());
    for (size_t i = 0; i < back.size(); ++i) {
      std::vector<float> init(6);
      t.InitialRow(back[i], init.data());
      CHECK_EQ(fresh[i * 6], init[0]);
      CHECK_EQ(uses[i], uint32_t{0});
      model[back[i]] = init[0];
    }
    CHECK_EQ(t.size(), static_cast<int64_t>(model.size()));
    CHECK_EQ(t.AllocatedBytes(), bytes);
  }
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> out_counts;
  t.Export(&out_ids, &out_rows, &out_counts);
  CHECK_EQ(out_ids.size(), model.size());
  for (size_t i = 0; i < out_ids.size(); ++i) CHECK_EQ(out_rows[i * 6], model[out_ids[i]]);
  CHECK_EQ(t.Remove(nullptr, 0), int64_t{0});
}

namespace {
// The ids a changed_only export returns (all parts), sorted.
std::vector<int64_t> ChangedIds(const HostTable& t, int64_t part_rows = 3) {
  std::vector<int64_t> ids, counts;
  std::vector<float> rows;
  uint64_t cursor = 0;
  while (cursor != HostTable::kNoMoreRows) {
    t.ExportRange(&cursor, part_rows, &ids, &rows, &counts, /*changed_only=*/true);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}
}  // namespace

TEST_CASE(HostTablePruneDecayScalesTheCountsThatStay) {
  // Counts 0..9 and saturated ones; a map model of what each prune leaves.
  HostTable t(Options(2, 0));
  std::vector<int64_t> ids;
  std::vector<uint32_t> counts;
  std::mt19937_64 rng(31);
  for (int i = 0; i < 4000; ++i) {
    ids.push_back(static_cast<int64_t>(rng()));
    counts.push_back(i < 50 ? 0xffffu : static_cast<uint32_t>(i % 10));
  }
  std::vector<float> rows(ids.size() * 2, 1.0f);
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), counts.data()).ok());
  std::map<int64_t, uint32_t> model;
  for (size_t i = 0; i < ids.size(); ++i) model[ids[i]] = counts[i];
  CHECK_EQ(ChangedIds(t, 1 << 20).size(), ids.size());  // (unflags the writes)
  const auto check_model = [&] {
    std::vector<int64_t> out_ids;
    std::vector<float> out_rows;
    std::vector<uint32_t> out_counts;
    t.Export(&out_ids, &out_rows, &out_counts);
    CHECK_EQ(out_ids.size(), model.size());
    for (size_t k = 0; k < out_ids.size(); ++k) {
      CHECK(model.count(out_ids[k]) == 1);
      CHECK_EQ(out_counts[k], model[out_ids[k]]);
    }
  };
  // The removal goes by the counts before the decay; a kept id decays too.
  const int64_t kept_id = ids[50];  // 0 uses
  model[ids[57]] = 7;
  int64_t expect = 0;
  for (auto it = model.begin(); it != model.end();) {
    if (it->second < 2 && it->first != kept_id) {
      it = model.erase(it);
      ++expect;
    } else {
      it->second = it->second / 2;  // floor(c * 0.5)
      ++it;
    }
  }
  CHECK_EQ(t.Prune(2, {kept_id, ids[57]}, 0.5), expect);
  check_model();
  CHECK(model[ids[0]] == 32767 && model[ids[57]] == 3);
  // A decay of 1 changes nothing; 0.9 takes every count down by at least
  // one, so that an id no step uses again reaches 0.
  CHECK_EQ(t.Prune(0, {}, 1.0), int64_t{0});
  check_model();
  CHECK_EQ(t.Prune(0, {}, 0.9), int64_t{0});
  for (auto& [id, c] : model) c = static_cast<uint32_t>(std::floor(c * 0.9));
  check_model();
  CHECK(model[ids[57]] == 2);  // 3 * 0.9 = 2.7
  // PruneToSize decays even when nothing has to go, and after a removal
  // the survivors only.
  uint32_t min_count = 0;
  CHECK_EQ(t.PruneToSize(1 << 20, {}, &min_count, 0.5), int64_t{0});
  for (auto& [id, c] : model) c /= 2;
  check_model();
  const int64_t before = t.size();
  CHECK_EQ(t.PruneToSize(100, {}, &min_count, 0.0), before - 100);
  CHECK_EQ(t.size(), int64_t{100});
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> out_counts;
  t.Export(&out_ids, &out_rows, &out_counts);
  for (size_t k = 0; k < out_ids.size(); ++k) {
    CHECK_EQ(out_counts[k], uint32_t{0});
    CHECK(model[out_ids[k]] >= min_count - 1);  // the most used stayed
  }
  // A decayed row is not flagged changed (deltas follow values only).
  CHECK(ChangedIds(t, 1 << 20).empty());
}

TEST_CASE(HostTableFlagsChangedRowsUntilAChangedOnlyExport) {
  HostTable t(Options(2, 1));
  const int w = t.width();
  std::vector<int64_t> ids = {5, 6, 7, 8};
  std::vector<float> rows(4 * w, 1.0f);
  CHECK(t.Write(ids.data(), 4, rows.data()).ok());
  CHECK(ChangedIds(t) == ids);  // new rows
  CHECK(ChangedIds(t).empty());  // flags cleared
  // Written with no uses (an evicted row no step used since it was last
  // written back) or without flagging (a flush): not changed.
  std::vector<uint32_t> zero(4, 0), some = {0, 2, 0, 1};
  CHECK(t.Write(ids.data(), 4, rows.data(), zero.data()).ok());
  CHECK(t.Write(ids.data(), 4, rows.data(), nullptr, /*mark_changed=*/false).ok());
  t.AddUseCounts(ids.data(), 4, some.data());  // counts alone flag nothing
  CHECK(ChangedIds(t).empty());
  CHECK(t.Write(ids.data(), 4, rows.data(), some.data()).ok());
  CHECK((ChangedIds(t) == std::vector<int64_t>{6, 8}));
  t.AddUseCounts(ids.data(), 4, some.data(), /*mark_changed=*/true);  // a flush's credit
  CHECK((ChangedIds(t) == std::vector<int64_t>{6, 8}));
  CHECK(t.AssignValues(&ids[0], 1, rows.data()).ok());
  // By handle (write-backs of evictions), and new ids of a fetch.
  std::vector<int64_t> fetch = {7, 9};
  std::vector<float> out(2 * w);
  std::vector<uint64_t> handles(2);
  CHECK(t.Reserve(2).ok());
  CHECK(t.FindOrInsertReserved(fetch.data(), 2, out.data(), 2, nullptr, handles.data()).ok());
  CHECK((ChangedIds(t) == std::vector<int64_t>{5, 9}));
  std::vector<uint32_t> uses = {3, 0};
  t.WriteRows(handles.data(), 2, out.data(), uses.data());
  CHECK((ChangedIds(t) == std::vector<int64_t>{7}));
  // Every row of a part is read with its count; plain exports clear nothing.
  CHECK(t.Write(ids.data(), 4, rows.data()).ok());
  std::vector<int64_t> all_ids;
  std::vector<float> all_rows;
  std::vector<uint32_t> all_counts;
  t.Export(&all_ids, &all_rows, &all_counts);
  CHECK(ChangedIds(t, 1) == ids);
}

TEST_CASE(HostTableTakeRemovedLetsAFollowerMatchTheTable) {
  // A follower applies, each round, the removals TakeRemoved reports and
  // then a changed_only export; it must hold what the table holds. When
  // the list is incomplete (first call, after a Clear) the export after it
  // is the whole table and the follower rebuilds from it.
  HostTableOptions o = Options(2, 1);
  o.num_shards = 4;
  HostTable t(o);
  const int w = t.width();
  std::mt19937_64 rng(5);
  std::map<int64_t, float> follower;
  std::vector<int64_t> removed;
  bool incomplete_seen = false;
  // Deltas taken before anyone followed removals: the first list is
  // incomplete, and the export after it must still be the whole table.
  std::vector<int64_t> first = {1, 2, 3};
  std::vector<float> first_rows(first.size() * w, 0.5f);
  std::vector<uint32_t> first_uses(first.size(), 50);  // (kept by the prunes)
  CHECK(t.Write(first.data(), first.size(), first_rows.data(), first_uses.data()).ok());
  CHECK(ChangedIds(t) == first);
  for (int round = 0; round < 40; ++round) {
    // Writes of new and old ids (with uses: flagged), then removals of all
    // three kinds, some of them of ids written again right after.
    std::vector<int64_t> ids;
    for (int k = 0; k < 300; ++k) ids.push_back(10 + static_cast<int64_t>(rng() % 2000));
    std::vector<float> rows(ids.size() * w);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(round * 10000 + i / w);
    std::vector<uint32_t> uses(ids.size());
    for (auto& u : uses) u = 1 + static_cast<uint32_t>(rng() % 3);  // (0: unchanged)
    CHECK(t.Write(ids.data(), ids.size(), rows.data(), uses.data()).ok());
    std::vector<int64_t> gone;
    for (int k = 0; k < 60; ++k) gone.push_back(10 + static_cast<int64_t>(rng() % 2000));
    t.Remove(gone.data(), gone.size());
    if (round % 3 == 0) t.Prune(1 + round % 2, {});
    if (round % 5 == 1) {
      uint32_t min_count = 0;
      t.PruneToSize(t.size() * 3 / 4, {}, &min_count);
    }
    std::vector<int64_t> again(gone.begin(), gone.begin() + 10);
    std::vector<float> again_rows(again.size() * w, -1.0f);
    CHECK(t.Write(again.data(), again.size(), again_rows.data()).ok());
    if (round == 20) t.Clear();  // a restore: the follower must rebuild
    std::vector<int64_t> refused;
    const bool refused_complete = round % 7 == 3 &&
        t.TakeRemoved(&refused, [](const std::vector<int64_t>&) { return false; });
    const bool complete = t.TakeRemoved(&removed);
    if (refused_complete) CHECK(refused == removed);  // kept for this call
    if (!complete) {
      incomplete_seen = true;
      CHECK(removed.empty());
      follower.clear();
    }
    CHECK(std::is_sorted(removed.begin(), removed.end()));
    for (int64_t id : removed) follower.erase(id);  // (maybe new since the last round)
    std::vector<int64_t> ch_ids, ch_counts;
    std::vector<float> ch_rows;
    uint64_t cursor = 0;
    while (cursor != HostTable::kNoMoreRows) {
      t.ExportRange(&cursor, 97, &ch_ids, &ch_rows, &ch_counts, /*changed_only=*/true);
    }
    for (size_t i = 0; i < ch_ids.size(); ++i) follower[ch_ids[i]] = ch_rows[i * w];
    std::vector<int64_t> all_ids;
    std::vector<float> all_rows;
    std::vector<uint32_t> all_counts;
    t.Export(&all_ids, &all_rows, &all_counts);
    std::map<int64_t, float> table;
    for (size_t i = 0; i < all_ids.size(); ++i) table[all_ids[i]] = all_rows[i * w];
    CHECK(follower == table);
  }
  CHECK(incomplete_seen);
}

TEST_CASE(StoreFlushKeepsAHeldCountCached) {
  // A lookahead plan's ids were counted when they were prepared: a flush
  // before their step credits the other uses and keeps that one cached;
  // the flush after the step credits it and flags the row.
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 8;
  EmbeddingStore store(o);
  std::vector<int64_t> step1 = {1, 2, 3}, plan = {3, 4};
  PrepareResult r;
  CHECK(store.Prepare(step1.data(), 3, &r).ok());
  CHECK(store.Prepare(plan.data(), 2, &r).ok());  // counted ahead
  std::vector<int64_t> ids;
  std::vector<int32_t> slots;
  const std::vector<int64_t> plan_twice = {3, 4, 3};  // a repeat holds one use, not two
  store.CachedEntries(&ids, &slots, plan_twice.data(), 3);
  CHECK(ids.empty());  // no update marked a row dirty: none to write
  std::vector<int64_t> all_ids;
  std::vector<float> rows;
  std::vector<uint32_t> counts;
  store.table().Export(&all_ids, &rows, &counts);
  std::map<int64_t, uint32_t> got;
  for (size_t i = 0; i < all_ids.size(); ++i) got[all_ids[i]] = counts[i];
  CHECK((got == std::map<int64_t, uint32_t>{{1, 1}, {2, 1}, {3, 1}, {4, 0}}));
  (void)ChangedIds(store.table());  // a delta now
  store.CachedEntries(&ids, &slots);  // the step trained them; the next flush
  store.table().Export(&all_ids, &rows, &counts);
  for (size_t i = 0; i < all_ids.size(); ++i) got[all_ids[i]] = counts[i];
  CHECK((got == std::map<int64_t, uint32_t>{{1, 1}, {2, 1}, {3, 2}, {4, 1}}));
  CHECK((ChangedIds(store.table()) == std::vector<int64_t>{3, 4}));
}

TEST_CASE(StoreFlushGivesTheRowsMarkedDirty) {
  // A flush gives the rows updates marked dirty since their last write-back
  // (marked clean); a removed row is dropped, not given.
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 8;
  EmbeddingStore store(o);
  auto flush = [&](bool clean = true) {
    std::vector<int64_t> ids;
    std::vector<int32_t> slots;
    store.CachedEntries(&ids, &slots);
    if (clean) store.MarkClean(slots.data(), static_cast<int64_t>(slots.size()));
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  PrepareResult r;
  std::vector<int64_t> step1 = {1, 2, 3}, step2 = {2, 4};
  CHECK(store.Prepare(step1.data(), 3, &r).ok());
  CHECK(flush().empty());  // prepared, not updated: the rows are the host's
  store.MarkDirty(r.slots.data(), 3);
  CHECK((flush(/*clean=*/false) == std::vector<int64_t>{1, 2, 3}));  // a failed write
  CHECK((flush() == std::vector<int64_t>{1, 2, 3}));
  CHECK(flush().empty());
  CHECK(store.Prepare(step2.data(), 2, &r).ok());
  CHECK(flush().empty());
  store.MarkDirty(r.slots.data(), 2);  // the update lands after that flush
  CHECK((flush() == std::vector<int64_t>{2, 4}));
  const std::vector<int32_t> outside = {-1, 8, 1 << 30};
  store.MarkDirty(outside.data(), 3);  // ignored
  CHECK(store.Prepare(step2.data(), 2, &r).ok());
  store.MarkDirty(r.slots.data(), 2);
  std::vector<int64_t> gone = {4};
  int64_t cached = 0;
  CHECK_EQ(store.Remove(gone.data(), 1, &cached), 1);
  CHECK((flush() == std::vector<int64_t>{2}));  // a removed row is not written
}

TEST_CASE(StoreEvictionOfARowChangedAfterItsFlushFlagsIt) {
  // An update that lands after the flush that credited its use (a delta
  // taken between a training call and its gradient) leaves the row dirty
  // with no cached use; evicted before the next flush, its write-back
  // carries no count to flag it, so the eviction flags it (a review: the
  // next delta missed the update for good).
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 4;
  EmbeddingStore store(o);
  PrepareResult r;
  std::vector<int64_t> step = {1, 2}, others = {3, 4, 5, 6};
  CHECK(store.Prepare(step.data(), 2, &r).ok());
  std::vector<int64_t> ids;
  std::vector<int32_t> slots;
  store.CachedEntries(&ids, &slots);  // the delta's flush: uses credited
  CHECK((ChangedIds(store.table(), 1000) == std::vector<int64_t>{1, 2}));  // the delta
  store.MarkDirty(r.slots.data(), 2);  // the update lands now
  CHECK(store.Prepare(others.data(), 4, &r).ok());  // evicts 1 and 2
  CHECK_EQ(r.evict_ids.size(), size_t{2});
  CHECK((r.evict_uses == std::vector<uint32_t>{0, 0}));
  // 1 and 2, and the new rows (a new row is a change).
  CHECK((ChangedIds(store.table(), 1000) == std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  // The new ids' slots came clean from the host: a flush writes nothing.
  store.CachedEntries(&ids, &slots);
  CHECK(ids.empty());
}

TEST_CASE(HostTablePruneDuringWritesKeepsMaxRows) {
  // Write counts missing ids, reserves, then inserts; a prune in between
  // used to let inserts go unreserved, and max_rows drifted upwards.
  HostTable t(Options(1, 0, /*max_rows=*/6000));
  std::vector<int64_t> ids(5000);
  for (int i = 0; i < 5000; ++i) ids[i] = 1000003LL * i + 17;
  std::vector<float> values(ids.size(), 1.0f);
  std::atomic<bool> stop{false};
  std::thread pruner([&] {
    while (!stop.load()) t.Prune(1, {});  // assigned rows have 0 uses
  });
  bool ok = true;
  for (int round = 0; round < 400; ++round) {
    ok = ok && t.AssignValues(ids.data(), ids.size(), values.data()).ok();
  }
  stop = true;
  pruner.join();
  CHECK(ok);
  t.Prune(1, {});
  CHECK_EQ(t.size(), int64_t{0});
  std::vector<int64_t> fresh(6001);
  for (int i = 0; i < 6001; ++i) fresh[i] = -7LL * i - 1;
  std::vector<float> row(6001, 2.0f);
  CHECK(t.Write(fresh.data(), 6000, row.data()).ok());
  CHECK(!t.Write(&fresh[6000], 1, row.data()).ok());  // exactly max_rows fit
  CHECK_EQ(t.size(), int64_t{6000});
}

TEST_CASE(HostTableClearDuringWritesKeepsTheCount) {
  // Clear did not wait for writers: a write that reserved and inserted
  // before the clear counted its rows after it, so the table claimed rows
  // it no longer held and max_rows refused rows it had room for.
  HostTable t(Options(1, 0, /*max_rows=*/30000));
  std::vector<int64_t> ids(20000);
  std::vector<float> values(ids.size(), 1.0f);
  std::vector<int64_t> out_ids;
  std::vector<float> out_rows;
  std::vector<uint32_t> counts;
  for (int round = 0; round < 60; ++round) {
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = 1000003LL * (round * 20000LL + i) + 5;
    std::thread writer([&] { CHECK(t.Write(ids.data(), ids.size(), values.data()).ok()); });
    // Clear at a different moment of the write each round.
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (round % 30)));
    t.Clear();
    writer.join();
    t.Export(&out_ids, &out_rows, &counts);
    CHECK_EQ(t.size(), static_cast<int64_t>(out_ids.size()));
    t.Clear();
  }
  std::vector<int64_t> fresh(30000);
  for (int i = 0; i < 30000; ++i) fresh[i] = -7LL * i - 1;
  std::vector<float> rows(30000, 2.0f);
  CHECK(t.Write(fresh.data(), fresh.size(), rows.data()).ok());  // all of max_rows fits
  CHECK_EQ(t.size(), int64_t{30000});
}

TEST_CASE(StorePruneKeepsCachedAndPendingIds) {
  StoreOptions o;
  o.table = Options(2, 0);
  o.cache_capacity = 4;
  EmbeddingStore store(o);
  PrepareResult r;
  const std::vector<int64_t> first = {1, 2, 3, 4}, second = {5, 6};
  CHECK(store.Prepare(first.data(), 4, &r).ok());
  CHECK(store.Prepare(second.data(), 2, &r).ok());  // evicts two of 1..4, write-back pending
  CHECK_EQ(store.table().size(), int64_t{6});
  // Every host count is 0 (nothing written back yet): only ids neither
  // cached nor pending may go, and there are none.
  CHECK_EQ(store.PruneHost(1), int64_t{0});
  std::vector<float> rows(r.evict_ids.size() * 2, 4.0f);
  std::vector<uint32_t> uses(r.evict_ids.size(), 0);
  CHECK(store.WriteBack(r.evict_ids.data(), r.evict_ids.size(), rows.data(), uses.data()).ok());
  CHECK_EQ(store.write_backs_by_handle(), int64_t{1});
  // Now the two evicted ids (0 uses written back) are neither cached nor pending.
  CHECK_EQ(store.PruneHost(1), int64_t{2});
  CHECK_EQ(store.table().size(), int64_t{4});
  for (int64_t id : r.evict_ids) {
    std::vector<float> got(2), init(2);
    store.table().Find(&id, 1, got.data());
    store.table().InitialRow(id, init.data());
    CHECK(got == init);
  }
}

// Running out of host memory ------------------------------------------------

namespace {

// How allocations fail in the out-of-memory tests: any operator new (only
// the k-th, g_fail_new_at), or the tables' own arrays (AllocationHook: the
// k-th and every later one, until disarmed, as memory that stays exhausted).
enum class Inject { kAnyNew, kTableMemory };

void Arm(Inject mode, int64_t k) {
  if (mode == Inject::kAnyNew) {
    g_fail_new_at.store(k);
  } else {
    TestAllocationHook().refused.store(0);
    TestAllocationHook().countdown.store(k);
  }
}

// Disarms; returns whether an allocation was refused.
bool Disarm(Inject mode) {
  if (mode == Inject::kAnyNew) return g_fail_new_at.exchange(-1) < 0;
  TestAllocationHook().countdown.store(-1);
  return TestAllocationHook().refused.exchange(0) > 0;
}

bool IsOutOfMemory(const CoreStatus& st) {
  return st.code() == CoreStatus::Code::kResourceExhausted &&
         st.message().find("out of host memory") != std::string::npos;
}

// Every stored id's row and use count.
using TableSnapshot = std::map<int64_t, std::pair<std::vector<float>, uint32_t>>;
TableSnapshot Snapshot(const HostTable& t) {
  std::vector<int64_t> ids;
  std::vector<float> rows;
  std::vector<uint32_t> counts;
  t.Export(&ids, &rows, &counts);
  TableSnapshot snap;
  const int w = t.width();
  for (size_t i = 0; i < ids.size(); ++i) {
    snap[ids[i]] = {std::vector<float>(rows.begin() + i * w, rows.begin() + (i + 1) * w),
                    counts[i]};
  }
  return snap;
}

}  // namespace

TEST_CASE(HostTableChangedOnlyExportThatFailsKeepsItsRowsFlagged) {
  // A changed_only part cleared its rows' flags before the caller had them:
  // out of memory half way (or outputs the kernel could not allocate), those
  // rows were missing from every later delta (a review).
  HostTableOptions o = Options(2, 1);
  o.num_shards = 4;
  HostTable t(o);
  const int w = t.width();
  std::vector<int64_t> ids;
  for (int i = 0; i < 300; ++i) ids.push_back(7919LL * i - 1000);
  std::vector<float> rows(ids.size() * w, 1.0f);
  CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());
  std::vector<int64_t> sorted_ids(ids);
  std::sort(sorted_ids.begin(), sorted_ids.end());
  const auto read_part = [&t](uint64_t* cursor, std::vector<int64_t>* got,
                              const std::function<bool()>& deliver) {
    std::vector<int64_t> counts;
    std::vector<float> part_rows;
    t.ExportRange(cursor, 120, got, &part_rows, &counts, /*changed_only=*/true, deliver);
  };
  // Refused by the caller: the cursor stays and every row stays flagged.
  uint64_t cursor = 0;
  std::vector<int64_t> got;
  read_part(&cursor, &got, [] { return false; });
  CHECK_EQ(cursor, uint64_t{0});
  CHECK(!got.empty());
  CHECK(ChangedIds(t) == sorted_ids);
  // Out of memory at each allocation in turn, then a whole delta.
  int failures = 0;
  for (int64_t k = 0;; ++k) {
    CHECK(t.Write(ids.data(), ids.size(), rows.data()).ok());  // every row changed
    std::vector<int64_t> delivered;
    uint64_t at = 0;
    bool threw = false;
    Arm(Inject::kAnyNew, k);
    try {
      while (at != HostTable::kNoMoreRows) read_part(&at, &delivered, nullptr);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    const bool fired = Disarm(Inject::kAnyNew);
    if (!fired) {
      CHECK(!threw);
      break;
    }
    CHECK(threw);
    ++failures;
    // The parts read before the failure were delivered; the rest come in
    // the next delta.
    std::vector<int64_t> rest = ChangedIds(t);
    std::vector<int64_t> all(delivered);
    all.insert(all.end(), rest.begin(), rest.end());
    std::sort(all.begin(), all.end());
    CHECK(std::includes(all.begin(), all.end(), sorted_ids.begin(), sorted_ids.end()));
  }
  CHECK(failures > 0);
}

// A write that runs out of memory part-way: every row is its old or its new
// value, never torn; size() counts exactly the stored ids; max_rows keeps
// its exact room; and once memory is back, the same write completes. Each
// allocation of the call fails in turn.
TEST_CASE(HostTableWriteOutOfMemoryKeepsEveryRow) {
  for (Inject mode : {Inject::kAnyNew, Inject::kTableMemory}) {
    HostTableOptions o = Options(3, 1, /*max_rows=*/2000);
    o.num_shards = 4;
    HostTable t(o);
    const int w = t.width();
    const auto row_of = [w](int64_t id, float version) {
      std::vector<float> r(w);
      for (int j = 0; j < w; ++j) r[j] = static_cast<float>(id % 1000) + 0.25f * j + version;
      return r;
    };
    std::vector<int64_t> old_ids;
    std::vector<float> rows;
    for (int i = 0; i < 300; ++i) {
      old_ids.push_back(1000003LL * i + 5);
      const auto r = row_of(old_ids.back(), 1);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    CHECK(t.Write(old_ids.data(), old_ids.size(), rows.data()).ok());
    // New values for half the stored ids, and 400 new ids, mixed.
    std::vector<int64_t> batch(old_ids.begin(), old_ids.begin() + 150);
    for (int i = 0; i < 400; ++i) batch.push_back(-77LL * i - 3);
    std::shuffle(batch.begin(), batch.end(), std::mt19937_64(3));
    std::vector<float> batch_rows;
    for (int64_t id : batch) {
      const auto r = row_of(id, 2);
      batch_rows.insert(batch_rows.end(), r.begin(), r.end());
    }
    const std::set<int64_t> in_batch(batch.begin(), batch.end());
    const std::set<int64_t> was_stored(old_ids.begin(), old_ids.end());
    int failures = 0;
    for (int64_t k = 0;; ++k) {
      Arm(mode, k);
      const CoreStatus st = t.Write(batch.data(), batch.size(), batch_rows.data());
      const bool fired = Disarm(mode);
      if (!fired) {
        CHECK(st.ok());
        break;
      }
      CHECK(IsOutOfMemory(st));
      ++failures;
      const TableSnapshot snap = Snapshot(t);
      CHECK_EQ(t.size(), static_cast<int64_t>(snap.size()));
      for (int64_t id : old_ids) {
        const auto it = snap.find(id);
        CHECK(it != snap.end());
        CHECK(it->second.first == row_of(id, 1) ||
              (in_batch.count(id) && it->second.first == row_of(id, 2)));
      }
      for (const auto& kv : snap) {
        if (!was_stored.count(kv.first)) CHECK(kv.second.first == row_of(kv.first, 2));
      }
    }
    CHECK(failures > 0);
    const TableSnapshot snap = Snapshot(t);
    CHECK_EQ(t.size(), int64_t{700});
    for (int64_t id : batch) CHECK(snap.at(id).first == row_of(id, 2));
    // The room left under max_rows is exact after the failed calls.
    std::vector<int64_t> fill;
    for (int i = 0; i < 2000 - 700 + 1; ++i) fill.push_back(7777777LL + 13 * i);
    std::vector<float> fill_rows(fill.size() * w, 1.0f);
    CHECK(t.Write(fill.data(), fill.size() - 1, fill_rows.data()).ok());
    const CoreStatus full = t.Write(&fill.back(), 1, fill_rows.data());
    CHECK(!full.ok() && full.message().find("max_rows=2000") != std::string::npos);
  }
  CHECK_EQ(TestAllocationHook().refused.load(), int64_t{0});
}

// A shard whose index cannot grow keeps the index it has (it used to be
// swapped out before the larger one was allocated: every row of the shard
// was lost).
TEST_CASE(HostTableIndexThatCannotGrowKeepsItsRows) {
  HostTableOptions o = Options(2, 0);
  o.num_shards = 1;
  HostTable t(o);
  std::vector<int64_t> ids;
  std::vector<float> rows;
  for (int i = 0; i < 14; ++i) {
    ids.push_back(31LL * i + 1);
    rows.push_back(static_cast<float>(i));
    rows.push_back(-static_cast<float>(i));
  }
  // 13 rows fill an index of 16 entries to its maximum load (13/16).
  CHECK(t.Write(ids.data(), 13, rows.data()).ok());
  CHECK(t.IndexEntries() == std::vector<size_t>{16});
  Arm(Inject::kTableMemory, 0);  // the next table allocation: the larger index
  const CoreStatus st = t.Write(&ids[13], 1, &rows[26]);
  CHECK(Disarm(Inject::kTableMemory));
  CHECK(IsOutOfMemory(st));
  CHECK(st.message().find("stopped after storing 0 of its 1 rows") != std::string::npos);
  CHECK_EQ(t.size(), int64_t{13});
  CHECK(t.IndexEntries() == std::vector<size_t>{16});
  std::vector<float> got(14 * 2);
  t.Find(ids.data(), 14, got.data());
  CHECK(std::equal(got.begin(), got.begin() + 26, rows.begin()));
  std::vector<float> init(2);
  t.InitialRow(ids[13], init.data());
  CHECK(got[26] == init[0] && got[27] == init[1]);
  // With the memory back, the row goes in.
  CHECK(t.Write(&ids[13], 1, &rows[26]).ok());
  CHECK_EQ(t.size(), int64_t{14});
  t.Find(ids.data(), 14, got.data());
  CHECK(got == rows);
}

// The tables' arrays count against a test limit (as under SFCTR_TEST_HOST_
// MEMORY_LIMIT), inserts past it fail cleanly, and the bytes come back
// when a table goes.
TEST_CASE(HostTableMemoryLimitRefusesNewRowsUntilMemoryReturns) {
  AllocationHook& hook = TestAllocationHook();
  const int64_t live_before = hook.live.load();
  {
    HostTable t(Options(16, 1));
    const int64_t empty = hook.live.load();
    hook.limit.store(empty + (int64_t{4} << 20));  // 4 MB more for this table
    std::vector<int64_t> ids(20000);
    for (int i = 0; i < 20000; ++i) ids[i] = 7919LL * i;
    std::vector<float> values(ids.size() * 16, 0.5f);
    int64_t stored = 0;
    CoreStatus st;
    for (size_t b = 0; b < ids.size() && st.ok(); b += 1000) {
      st = t.AssignValues(&ids[b], 1000, &values[b * 16]);
      stored = t.size();
    }
    CHECK(IsOutOfMemory(st));
    CHECK(hook.live.load() <= hook.limit.load());
    CHECK(stored > 1000 && stored < 20000);
    // Stored rows read back; writing them again needs no memory.
    std::vector<float> got(stored * t.width());
    const TableSnapshot snap = Snapshot(t);
    CHECK_EQ(static_cast<int64_t>(snap.size()), stored);
    for (const auto& kv : snap) CHECK_EQ(kv.second.first[0], 0.5f);
    std::vector<int64_t> present;
    for (const auto& kv : snap) present.push_back(kv.first);
    std::vector<float> again(present.size() * 16, 2.0f);
    CHECK(t.AssignValues(present.data(), present.size(), again.data()).ok());
    // Memory back: the rest goes in.
    hook.limit.store(-1);
    CHECK(t.AssignValues(ids.data(), ids.size(), values.data()).ok());
    CHECK_EQ(t.size(), int64_t{20000});
  }
  hook.refused.store(0);
  CHECK_EQ(hook.live.load(), live_before);
}

// A prune that runs out of memory part-way leaves each shard pruned or as it
// was: no row of a kept id is freed (a later insert would overwrite it) and
// size() is right.
TEST_CASE(HostTablePruneOutOfMemoryKeepsEveryKeptRow) {
  HostTableOptions o = Options(2, 0);
  o.num_shards = 4;
  HostTable t(o);
  std::vector<int64_t> ids;
  std::vector<float> rows;
  std::vector<uint32_t> counts;
  for (int i = 0; i < 600; ++i) {
    ids.push_back(1000003LL * i - 11);
    rows.push_back(static_cast<float>(i));
    rows.push_back(0.5f);
    counts.push_back(static_cast<uint32_t>(i % 3));
  }
  CHECK(t.Write(ids.data(), ids.size(), rows.data(), counts.data()).ok());
  const std::unordered_set<int64_t> keep = {ids[0]};
  const auto kept = [&](size_t i) { return counts[i] >= 2 || i == 0; };
  int failures = 0;
  for (int64_t k = 0;; ++k) {
    Arm(Inject::kAnyNew, k);
    int64_t removed = -1;
    try {
      removed = t.Prune(2, keep);
    } catch (const std::bad_alloc&) {
    }
    const bool fired = Disarm(Inject::kAnyNew);
    const TableSnapshot snap = Snapshot(t);
    CHECK_EQ(t.size(), static_cast<int64_t>(snap.size()));
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto it = snap.find(ids[i]);
      if (kept(i)) CHECK(it != snap.end());
      if (it != snap.end()) CHECK(it->second.first[0] == rows[2 * i] && it->second.second == counts[i]);
    }
    if (removed >= 0) break;
    CHECK(fired);
    ++failures;
  }
  CHECK(failures > 0);
  CHECK_EQ(t.size(), int64_t{201});
  // New ids take the freed rows, none of a kept id.
  std::vector<int64_t> fresh(600);
  for (int i = 0; i < 600; ++i) fresh[i] = -5LL * i - 2;
  std::vector<float> fresh_rows(600 * 2);
  for (int i = 0; i < 1200; ++i) fresh_rows[i] = 1000.0f + i;
  CHECK(t.Write(fresh.data(), fresh.size(), fresh_rows.data()).ok());
  const TableSnapshot snap = Snapshot(t);
  CHECK_EQ(snap.size(), size_t{801});
  for (size_t i = 0; i < ids.size(); ++i) {
    if (kept(i)) CHECK(snap.at(ids[i]).first[0] == rows[2 * i]);
  }
  // (A row freed twice would hold two of them.)
  for (int i = 0; i < 600; ++i) CHECK(snap.at(fresh[i]).first[0] == fresh_rows[2 * i]);
}

// A shard that throws, on a pool thread or the caller's, does not end the
// process: every other shard runs, then RunShards rethrows. A scheduler that
// cannot queue a task leaves the shards to the caller.
TEST_CASE(RunShardsRethrowsAShardsExceptionOnceAllRan) {
  std::vector<std::thread> threads;
  std::mutex mu;
  const Scheduler spawn = [&](std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu);
    threads.emplace_back(std::move(task));
  };
  for (const Scheduler* schedule : {&spawn, static_cast<const Scheduler*>(nullptr)}) {
    for (int round = 0; round < 20; ++round) {
      std::vector<std::atomic<int>> runs(16);
      bool caught = false;
      try {
        RunShards(schedule, 16, 3, [&](int64_t s) {
          runs[s].fetch_add(1);
          if (s % 5 == 1) throw std::bad_alloc();
        });
      } catch (const std::bad_alloc&) {
        caught = true;
      }
      CHECK(caught);
      for (auto& r : runs) CHECK_EQ(r.load(), 1);
    }
  }
  for (auto& t : threads) t.join();
  const Scheduler refusing = [](std::function<void()>) { throw std::bad_alloc(); };
  std::vector<int> ran(8, 0);
  RunShards(&refusing, 8, 3, [&](int64_t s) { ++ran[s]; });
  CHECK(ran == std::vector<int>(8, 1));
}

// A Commit whose allocations fail (each in turn) changes nothing.
TEST_CASE(DirectoryCommitOutOfMemoryChangesNothing) {
  CacheDirectory d(8);
  Step(d, {1, 2, 3, 4, 5, 6, 7, 8});
  Step(d, {1, 2, 3});
  const auto state = [&d] {
    std::vector<CacheDirectory::Eviction> e;
    d.Entries(&e, /*reset_uses=*/false);
    std::vector<std::tuple<int64_t, int32_t, uint32_t>> out;
    for (const auto& x : e) out.emplace_back(x.id, x.slot, x.uses);
    out.emplace_back(d.size(), d.stats().hits, d.stats().evictions);
    return out;
  };
  const std::vector<int64_t> ids = {1, 9, 10, 4, 11};
  const std::vector<int64_t> hint_ids = {5, 6};
  const std::vector<int32_t> hint_steps = {1, 1};
  EvictionHints hints;
  hints.ids = hint_ids.data();
  hints.steps = hint_steps.data();
  hints.n = 2;
  int failures = 0;
  for (int64_t k = 0;; ++k) {
    const auto before = state();
    std::vector<int32_t> slots(ids.size());
    int64_t misses = 0;
    CHECK(d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok());
    std::vector<int64_t> pos;
    std::vector<CacheDirectory::Eviction> ev;
    CacheDirectory::CommitUndo undo;
    Arm(Inject::kAnyNew, k);
    bool ok = true;
    try {
      d.Commit(ids.data(), ids.size(), slots.data(), &pos, &ev, hints, &undo);
    } catch (const std::bad_alloc&) {
      ok = false;
    }
    Disarm(Inject::kAnyNew);
    if (ok) {
      CHECK_EQ(ev.size(), size_t{3});
      break;
    }
    ++failures;
    CHECK(state() == before);
  }
  CHECK(failures > 0);
  for (int64_t id : ids) CHECK(d.Probe(id) >= 0);
}

// Rollback after a Commit with hits, repeated ids, evictions and hints: the
// directory holds what it held (ids, slots, uses, host handles, counters).
TEST_CASE(DirectoryRollbackRestoresTheCache) {
  CacheDirectory d(6);
  Step(d, {1, 2, 3, 4, 5, 6});
  Step(d, {1, 2});
  for (int64_t id = 1; id <= 6; ++id) d.SetHandle(d.Probe(id), 100 + id);
  const auto entries = [&d] {
    std::vector<CacheDirectory::Eviction> e;
    d.Entries(&e, /*reset_uses=*/false);
    std::vector<std::tuple<int64_t, int32_t, uint32_t, uint64_t>> out;
    for (const auto& x : e) out.emplace_back(x.id, x.slot, x.uses, x.handle);
    return out;
  };
  const auto before = entries();
  const CacheStats stats = d.stats();
  const int64_t size = d.size();
  std::vector<int64_t> ids = {1, 7, 8, 1, 8, 9};
  std::vector<int32_t> slots(ids.size());
  int64_t misses = 0;
  CHECK(d.Classify(ids.data(), ids.size(), slots.data(), &misses).ok());
  const std::vector<int64_t> hint_ids = {2, 3};
  const std::vector<int32_t> hint_steps = {1, 2};
  EvictionHints hints;
  hints.ids = hint_ids.data();
  hints.steps = hint_steps.data();
  hints.n = 2;
  std::vector<int64_t> pos;
  std::vector<CacheDirectory::Eviction> ev;
  CacheDirectory::CommitUndo undo;
  d.Commit(ids.data(), ids.size(), slots.data(), &pos, &ev, hints, &undo);
  // Four victims: the repeated 8 took a slot too (left empty).
  CHECK_EQ(ev.size(), size_t{4});
  CHECK(d.Probe(7) >= 0 && d.Probe(9) >= 0);
  d.Rollback(ids.data(), ids.size(), slots.data(), pos, ev, undo);
  CHECK(entries() == before);
  CHECK_EQ(d.size(), size);
  CHECK_EQ(d.stats().hits, stats.hits);
  CHECK_EQ(d.stats().misses, stats.misses);
  CHECK_EQ(d.stats().evictions, stats.evictions);
  for (int64_t id = 0; id < 12; ++id) CHECK_EQ(d.Probe(id) >= 0, id >= 1 && id <= 6);
  // And it goes on as usual: the same step evicts three ids it does not use.
  const std::vector<int64_t> out = Step(d, {1, 7, 8, 9});
  CHECK_EQ(out.size(), size_t{3});
  CHECK(std::find(out.begin(), out.end(), 1) == out.end());
  for (int64_t id : {1, 7, 8, 9}) CHECK(d.Probe(id) >= 0);
}

// The store under failing allocations: each Prepare, write-back and flush of
// a model-checked run (as RunStoreAgainstModel, with eviction hints) is
// first tried with each of its allocations failing in turn. A Prepare that
// fails leaves the cache as it was (same ids in the same slots, same
// counters) and the host rows intact (new ids of the step may have their
// initial rows); a write-back or flush that fails changes nothing. The rows
// and use counts come out as without failures.
void RunStoreUnderAllocationFailures(Inject mode, const Scheduler* schedule) {
  StoreOptions o;
  o.table = Options(2, 1);
  o.table.num_shards = 4;
  o.cache_capacity = 32;
  EmbeddingStore store(o);
  const int w = store.table().width();
  std::vector<float> cache(o.cache_capacity * w, -1.0f);
  std::map<int64_t, std::vector<float>> model;
  std::map<int64_t, uint32_t> uses;
  std::vector<int64_t> universe;
  for (int64_t id = -150; id < 150; ++id) universe.push_back(id);
  std::vector<int32_t> probe_before(universe.size()), probe_after(universe.size());
  std::mt19937_64 rng(13);
  int failed_prepares = 0;
  for (int step = 0; step < 100; ++step) {
    std::set<int64_t> uniq;
    const int n = 1 + rng() % 32;
    while (static_cast<int>(uniq.size()) < n) uniq.insert(rng() % 300 - 150);
    std::vector<int64_t> ids(uniq.begin(), uniq.end());
    std::vector<int64_t> hint_ids;
    std::vector<int32_t> hint_steps;
    for (int h = 0; h < 8; ++h) {
      hint_ids.push_back(rng() % 300 - 150);
      hint_steps.push_back(1 + rng() % 3);
    }
    EvictionHints hints;
    hints.ids = hint_ids.data();
    hints.steps = hint_steps.data();
    hints.n = 8;
    PrepareResult r;
    for (int64_t k = 0;; ++k) {
      store.Probe(universe.data(), universe.size(), probe_before.data());
      const StoreStats before = store.Stats();
      const TableSnapshot host_before = Snapshot(store.table());
      Arm(mode, k);
      const CoreStatus st = store.Prepare(ids.data(), ids.size(), &r, schedule, hints);
      const bool fired = Disarm(mode);
      if (st.ok()) break;  // (also when it absorbed a failure: a helper not started)
      CHECK(fired);
      CHECK(IsOutOfMemory(st));
      ++failed_prepares;
      store.Probe(universe.data(), universe.size(), probe_after.data());
      CHECK(probe_after == probe_before);
      const StoreStats after = store.Stats();
      CHECK_EQ(after.hits, before.hits);
      CHECK_EQ(after.misses, before.misses);
      CHECK_EQ(after.evictions, before.evictions);
      CHECK_EQ(after.cached_rows, before.cached_rows);
      const TableSnapshot host_after = Snapshot(store.table());
      CHECK_EQ(store.table().size(), static_cast<int64_t>(host_after.size()));
      for (const auto& kv : host_before) CHECK(host_after.at(kv.first) == kv.second);
      for (const auto& kv : host_after) {
        if (host_before.count(kv.first)) continue;
        CHECK(uniq.count(kv.first));
        std::vector<float> init(w);
        store.table().InitialRow(kv.first, init.data());
        CHECK(kv.second.first == init && kv.second.second == 0);
      }
    }
    std::vector<float> back;
    for (int32_t s : r.evict_slots) {
      back.insert(back.end(), cache.begin() + s * w, cache.begin() + (s + 1) * w);
    }
    for (int64_t k = 0;; ++k) {
      const TableSnapshot host_before = Snapshot(store.table());
      const int64_t by_handle = store.write_backs_by_handle();
      Arm(mode, k);
      const CoreStatus st = store.WriteBack(r.evict_ids.data(), r.evict_ids.size(),
                                            back.data(), r.evict_uses.data());
      const bool fired = Disarm(mode);
      if (st.ok()) break;
      CHECK(fired);
      CHECK(IsOutOfMemory(st));
      CHECK(Snapshot(store.table()) == host_before);
      CHECK_EQ(store.write_backs_by_handle(), by_handle);
    }
    for (size_t m = 0; m < r.miss_slots.size(); ++m) {
      std::copy(r.miss_rows.begin() + m * w, r.miss_rows.begin() + (m + 1) * w,
                cache.begin() + r.miss_slots[m] * w);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!model.count(ids[i])) {
        std::vector<float> init(w);
        store.table().InitialRow(ids[i], init.data());
        model[ids[i]] = init;
      }
      ++uses[ids[i]];
      std::vector<float>& want = model[ids[i]];
      float* row = cache.data() + r.slots[i] * w;
      for (int j = 0; j < w; ++j) CHECK_EQ(row[j], want[j]);
      for (int j = 0; j < 2; ++j) row[j] += 1.0f;
      for (int j = 2; j < 4; ++j) row[j] += 10.0f;
      std::copy(row, row + w, want.begin());
    }
    store.MarkDirty(r.slots.data(), static_cast<int64_t>(r.slots.size()));
  }
  CHECK(failed_prepares > 0);
  // Flush: the cached uses move to the host table once, failure or not.
  std::vector<int64_t> cached_ids;
  std::vector<int32_t> cached_slots;
  for (int64_t k = 0;; ++k) {
    const TableSnapshot host_before = Snapshot(store.table());
    Arm(mode, k);
    bool ok = true;
    try {
      store.CachedEntries(&cached_ids, &cached_slots);
    } catch (const std::bad_alloc&) {
      ok = false;
    }
    const bool fired = Disarm(mode);
    if (ok) break;
    CHECK(fired);
    CHECK(Snapshot(store.table()) == host_before);
  }
  for (size_t i = 0; i < cached_ids.size(); ++i) {
    CHECK(store.table().Write(&cached_ids[i], 1, cache.data() + cached_slots[i] * w).ok());
  }
  const TableSnapshot host = Snapshot(store.table());
  CHECK_EQ(host.size(), model.size());
  CHECK_EQ(store.table().size(), static_cast<int64_t>(model.size()));
  for (const auto& kv : model) {
    CHECK(host.at(kv.first).first == kv.second);
    CHECK_EQ(host.at(kv.first).second, uses[kv.first]);
  }
}

TEST_CASE(StoreOutOfMemoryLeavesTheCacheAsItWas) {
  const Scheduler spawn = [](std::function<void()> task) {
    std::thread(std::move(task)).detach();
  };
  for (Inject mode : {Inject::kAnyNew, Inject::kTableMemory}) {
    RunStoreUnderAllocationFailures(mode, nullptr);
    RunStoreUnderAllocationFailures(mode, &spawn);
  }
}

int main() {
  int failed_cases = 0;
  for (const auto& c : sfctr_test::Registry()) {
    const int before = sfctr_test::Failures();
    c.fn();
    const bool ok = sfctr_test::Failures() == before;
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", c.name);
    if (!ok) ++failed_cases;
  }
  const int total = static_cast<int>(sfctr_test::Registry().size());
  std::printf("%d passed, %d failed\n", total - failed_cases, failed_cases);
  return failed_cases == 0 ? 0 : 1;
}
