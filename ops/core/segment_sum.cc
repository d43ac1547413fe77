#include "segment_sum.h"

#include <algorithm>
#include <cstring>

namespace sfctr {
namespace {

// kDim > 0 fixes the width at compile time: the common widths get a loop the
// compiler fully unrolls and vectorises. kDim == 0 takes `dim` at run time.
template <int kDim>
void AddRows(const float* data, const int32_t* data_rows, const int32_t* segment, int64_t n,
             int64_t dim_arg, int64_t begin, int64_t end, float* sums, float* squares) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const uint64_t span = static_cast<uint64_t>(end - begin);
  // The output rows are visited at random and (at a batch's sizes) do not
  // fit in L2: prefetching the row kPrefetch ahead keeps several misses in
  // flight. SfctrSegmentSums with squares, 106k rows into 32k segments, one
  // intra-op thread: 5.0-5.7 -> 2.4-2.7 ms at dim 16, 10.3-11.8 -> 5.8-6.5
  // ms at dim 64 (docs/design.md).
  constexpr int64_t kPrefetch = 8;
  for (int64_t i = 0; i < n; ++i) {
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
    case 8: return AddRows<8>(data, data_rows, segment, n, dim, begin, end, sums, squares);
    case 16: return AddRows<16>(data, data_rows, segment, n, dim, begin, end, sums, squares);
    case 32: return AddRows<32>(data, data_rows, segment, n, dim, begin, end, sums, squares);
    case 64: return AddRows<64>(data, data_rows, segment, n, dim, begin, end, sums, squares);
    case 128: return AddRows<128>(data, data_rows, segment, n, dim, begin, end, sums, squares);
    default: return AddRows<0>(data, data_rows, segment, n, dim, begin, end, sums, squares);
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
