// De-duplication of a batch of ids (Virtual Sparse Ids), optionally grouped
// by owner for a model-parallel exchange. TF-free.
//
// Dedup(ids, n, groups) gives the batch's distinct ids and, for every input
// position, the index of its id among them:
//
//   * groups == 1: distinct ids in first-occurrence order, exactly what
//     tf.unique returns;
//   * groups > 1: the same ids grouped by owner (Mix64(id) % groups, the
//     owner function of a model-parallel table), first-occurrence order
//     within each group; group_sizes[g] counts the ids of group g. The
//     result is what a stable sort of tf.unique's ids by owner gives, with
//     the inverse already pointing into that order.
//
// Implementation: one open-addressing table of {id, index} entries, sized to
// a power of two >= 2 x the distinct ids seen so far (it starts at the batch
// size and doubles), linear probing on the top bits of Mix64(id). Entries
// carry a generation stamp, so a table kept for the next batch needs no
// clearing. The hashes of the batch are computed first, which lets the probe
// loop prefetch the entries of the ids a few positions ahead.
#ifndef TF_SFCTR_OPS_CORE_DEDUP_H_
#define TF_SFCTR_OPS_CORE_DEDUP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sfctr {

class Deduplicator {
 public:
  Deduplicator() = default;
  Deduplicator(const Deduplicator&) = delete;
  Deduplicator& operator=(const Deduplicator&) = delete;

  // ids[0..n) -> unique (resized to the number of distinct ids), inverse[i]
  // in [0, unique.size()) for every i, group_sizes[0..groups) (may be null
  // when groups == 1). groups must be >= 1.
  void Run(const int64_t* ids, int64_t n, int32_t groups,
           std::vector<int64_t>* unique, int32_t* inverse,
           int32_t* group_sizes);

  // Drops the scratch memory when it grew past max_bytes (a huge batch
  // should not pin its table for the life of the thread).
  void Trim(size_t max_bytes);

  size_t ScratchBytes() const;

 private:
  struct Entry {
    int64_t id;
    int32_t index;
    uint32_t stamp;  // the entry is live iff stamp == stamp_
  };

  void Reset(size_t slots);
  void Grow();
  int32_t Insert(int64_t id, uint64_t hash, int32_t next_index);

  std::vector<Entry> table_;
  uint64_t mask_ = 0;
  int shift_ = 64;
  uint32_t stamp_ = 0;
  std::vector<uint64_t> hashes_;
  std::vector<int64_t> first_;    // distinct ids, first-occurrence order
  std::vector<int32_t> grouped_;  // first-occurrence index -> grouped index
};

// The first position i in [0, n) where inverse[i] is not in
// [0, num_unique) or unique[inverse[i]] != ids[i]; -1 when there is none:
// whether (unique, inverse) describe ids, as a de-duplication gives them.
// One pass over every position (unique is small enough to stay cached).
template <typename Index>
int64_t FirstBadInverse(const int64_t* ids, const int64_t* unique, int64_t num_unique,
                        const Index* inverse, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const Index k = inverse[i];
    if (k < 0 || static_cast<int64_t>(k) >= num_unique || unique[k] != ids[i]) return i;
  }
  return -1;
}

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_DEDUP_H_
