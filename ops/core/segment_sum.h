// Per-distinct-id sums of gradient rows (the backward of a de-duplicated
// lookup). TF-free.
//
// Given rows data[0..n) of `dim` floats and, for each row, the index of its
// id among the batch's distinct ids (the inverse of a de-duplication),
// SegmentSums writes
//
//   sums[s]    = sum of data[i]      over the rows i with segment[i] == s,
//   squares[s] = sum of data[i] ** 2 over the same rows (optional),
//
// for the segments s in [begin, end) only, adding in row order: the result
// is the one a sequential loop gives, whatever the split into segment ranges.
// Several threads can therefore fill disjoint segment ranges of the same
// output; each scans every segment id and reads only its own rows.
#ifndef TF_SFCTR_OPS_CORE_SEGMENT_SUM_H_
#define TF_SFCTR_OPS_CORE_SEGMENT_SUM_H_

#include <cstdint>

namespace sfctr {

// Index of the first segment id outside [0, num_segments), or -1.
int64_t FirstBadSegment(const int32_t* segment, int64_t n, int64_t num_segments);

// Zeroes, then fills, rows [begin, end) of sums (and of squares unless it is
// null), each [num_segments x dim] row-major. Segment ids must be valid.
// With data_rows, the i-th summed row is data[data_rows[i]] instead of
// data[i] (rows read once per use, never copied out: the backward of a
// combiner, whose per-id gradient is its output row's); those must be valid
// rows of data too.
void SegmentSums(const float* data, const int32_t* data_rows, const int32_t* segment,
                 int64_t n, int64_t dim, int64_t begin, int64_t end, float* sums,
                 float* squares);

// Row splits of a 2-D ragged tensor: splits[0..nrows], the values of row r at
// [splits[r], splits[r + 1]). Index of the first split that breaks
// "splits[0] == 0 and each split >= the one before", or -1.
template <typename Split>
int64_t FirstBadSplit(const Split* splits, int64_t nrows);

// The row of each value: out[i] = r for splits[r] <= i < splits[r + 1], for
// i in [0, splits[nrows]) (one pass over the output; TensorFlow's
// value_rowids builds a [rows x longest row] mask first). Splits must be
// valid (FirstBadSplit) and nrows must fit in int32.
template <typename Split>
void RowIdsFromSplits(const Split* splits, int64_t nrows, int32_t* out);

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_SEGMENT_SUM_H_
