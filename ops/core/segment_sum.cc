#include "segment_sum.h"

#include <algorithm>
#include <cstring>

namespace sfctr {
namespace {

// Prefetch distances, in rows: the output row of the id kPrefetch ahead and,
// for rows read by index, the input row kPrefetchData ahead. The output rows
// of a gradient's sums are visited at random and (at a batch's sizes) do not
// fit in L2: SfctrSegmentSums with squares, 106k rows into 32k segments, one
// intra-op thread: 5.0-5.7 -> 2.4-2.7 ms at dim 16, 10.3-11.8 -> 5.8-6.5 ms at
// dim 64 (docs/design.md). The input rows of a combined lookup's forward
// (SfctrVarSegmentSums) are scattered over the whole cache.
constexpr int64_t kPrefetch = 8;
constexpr int64_t kPrefetchData = 16;

// Always inlined: a function that only prefetches writes no memory, so GCC
// finds it pure and drops its calls (none were left at -O1 and above).
__attribute__((always_inline)) inline void Prefetch(const float* data, const int32_t* data_rows, const int32_t* segment,
                     int64_t n, int64_t dim, int64_t begin, uint64_t span, float* sums,
                     float* squares, int64_t i) {
  if (i + kPrefetch < n) {
    const uint64_t p = static_cast<uint64_t>(segment[i + kPrefetch] - begin);
    if (p < span) {
      const int64_t at = (begin + static_cast<int64_t>(p)) * dim;
      for (int64_t k = 0; k < dim; k += 16) {  // one 64-byte line each
        __builtin_prefetch(sums + at + k, 1);
        if (squares != nullptr) __builtin_prefetch(squares + at + k, 1);
      }
    }
  }
  if (data_rows != nullptr && i + kPrefetchData < n) {
    const uint64_t p = static_cast<uint64_t>(segment[i + kPrefetchData] - begin);
    if (p < span) {
      const float* ahead = data + static_cast<int64_t>(data_rows[i + kPrefetchData]) * dim;
      for (int64_t k = 0; k < dim; k += 16) __builtin_prefetch(ahead + k);
    }
  }
}

// Any width: adds each row into its output row in memory.
void AddRowsAnyWidth(const float* data, const int32_t* data_rows, const int32_t* segment,
                     int64_t n, int64_t dim, int64_t begin, int64_t end, float* sums,
                     float* squares) {
  const uint64_t span = static_cast<uint64_t>(end - begin);
  for (int64_t i = 0; i < n; ++i) {
    Prefetch(data, data_rows, segment, n, dim, begin, span, sums, squares, i);
    const uint64_t s = static_cast<uint64_t>(segment[i] - begin);
    if (s >= span) continue;  // another range's segment (or below begin)
    const float* row = data + (data_rows != nullptr ? data_rows[i] : i) * dim;
    float* out = sums + (begin + static_cast<int64_t>(s)) * dim;
    for (int64_t k = 0; k < dim; ++k) out[k] += row[k];
    if (squares != nullptr) {
      float* sq = squares + (begin + static_cast<int64_t>(s)) * dim;
      for (int64_t k = 0; k < dim; ++k) sq[k] += row[k] * row[k];
    }
  }
}

// A width fixed at compile time (the common ones): the loop is unrolled and
// vectorised, and a run of rows of one segment (a sorted segment, a multi-hot
// row's ids) adds into local accumulators, stored once at the run's end: in
// memory, each row's add waited for the previous one's store of the same
// output row (105k rows into 4096 sorted segments, dim 16, a standalone
// loop: 1.4-1.5 -> 0.5-0.7 ms). The additions are the same, in the same order.
template <int kDim>
void AddRows(const float* data, const int32_t* data_rows, const int32_t* segment, int64_t n,
             int64_t begin, int64_t end, float* sums, float* squares) {
  const uint64_t span = static_cast<uint64_t>(end - begin);
  float acc[kDim];
  float acc_sq[kDim];
  int64_t held = -1;  // the output row in acc (and acc_sq)
  auto store = [&] {
    if (held < 0) return;
    std::memcpy(sums + held * kDim, acc, sizeof(acc));
    if (squares != nullptr) std::memcpy(squares + held * kDim, acc_sq, sizeof(acc_sq));
  };
  for (int64_t i = 0; i < n; ++i) {
    Prefetch(data, data_rows, segment, n, kDim, begin, span, sums, squares, i);
    const uint64_t s = static_cast<uint64_t>(segment[i] - begin);
    if (s >= span) continue;  // another range's segment (or below begin)
    const int64_t at = begin + static_cast<int64_t>(s);
    if (at != held) {
      store();
      held = at;
      std::memcpy(acc, sums + at * kDim, sizeof(acc));
      if (squares != nullptr) std::memcpy(acc_sq, squares + at * kDim, sizeof(acc_sq));
    }
    const float* row = data + (data_rows != nullptr ? data_rows[i] : i) * kDim;
    for (int k = 0; k < kDim; ++k) acc[k] += row[k];
    if (squares != nullptr) {
      for (int k = 0; k < kDim; ++k) acc_sq[k] += row[k] * row[k];
    }
  }
  store();
}

}  // namespace

int64_t FirstBadSegment(const int32_t* segment, int64_t n, int64_t num_segments) {
  for (int64_t i = 0; i < n; ++i) {
    if (segment[i] < 0 || segment[i] >= num_segments) return i;
  }
  return -1;
}

void SegmentSums(const float* data, const int32_t* data_rows, const int32_t* segment,
                 int64_t n, int64_t dim, int64_t begin, int64_t end, float* sums,
                 float* squares) {
  if (end <= begin || dim == 0) return;
  const size_t bytes = static_cast<size_t>(end - begin) * dim * sizeof(float);
  std::memset(sums + begin * dim, 0, bytes);
  if (squares != nullptr) std::memset(squares + begin * dim, 0, bytes);
  switch (dim) {
    case 8: return AddRows<8>(data, data_rows, segment, n, begin, end, sums, squares);
    case 16: return AddRows<16>(data, data_rows, segment, n, begin, end, sums, squares);
    case 32: return AddRows<32>(data, data_rows, segment, n, begin, end, sums, squares);
    case 64: return AddRows<64>(data, data_rows, segment, n, begin, end, sums, squares);
    case 128: return AddRows<128>(data, data_rows, segment, n, begin, end, sums, squares);
    default:
      return AddRowsAnyWidth(data, data_rows, segment, n, dim, begin, end, sums, squares);
  }
}

template <typename Split>
int64_t FirstBadSplit(const Split* splits, int64_t nrows) {
  if (splits[0] != 0) return 0;
  for (int64_t r = 1; r <= nrows; ++r) {
    if (splits[r] < splits[r - 1]) return r;
  }
  return -1;
}

template <typename Split>
void RowIdsFromSplits(const Split* splits, int64_t nrows, int32_t* out) {
  for (int64_t r = 0; r < nrows; ++r) {
    std::fill(out + splits[r], out + splits[r + 1], static_cast<int32_t>(r));
  }
}

template int64_t FirstBadSplit<int32_t>(const int32_t*, int64_t);
template int64_t FirstBadSplit<int64_t>(const int64_t*, int64_t);
template void RowIdsFromSplits<int32_t>(const int32_t*, int64_t, int32_t*);
template void RowIdsFromSplits<int64_t>(const int64_t*, int64_t, int32_t*);

}  // namespace sfctr
