// SfctrFrame / SfctrUnframe: the framing of a model-parallel step's ids
// message (tf_sfctr/distributed/exchange.py). Words are 64-bit (float64
// tensors carrying int64 ids and float32 pairs as bits); a header word is an
// int64 count. CPU only, one thread: a message is a few MB at most, one
// memcpy per (section, rank).
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace {

constexpr int64_t kMaxWords = std::numeric_limits<int32_t>::max();

// The length an all-to-all input of n rows is padded to (the `steady`
// attribute): n rounded up to a multiple of 2^(bit_length(n) - 4), so at most
// 16 lengths per octave and less than 1/8 of padding. Horovod negotiates an
// all-to-all again whenever its input's shape changes; a steady length lets its
// response cache skip that on most steps. The rows past the splits are not
// sent. tf_sfctr/distributed/exchange.py steady_length is the same rule.
int64_t SteadyLength(int64_t n) {
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) <= n) ++bits;  // bit length of n
  const int64_t granule = int64_t{1} << (bits > 4 ? bits - 4 : 0);
  return (n + granule - 1) / granule * granule;
}

class FrameOp : public OpKernel {
 public:
  explicit FrameOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("steady", &steady_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList sections, counts;
    OP_REQUIRES_OK(ctx, ctx->input_list("sections", &sections));
    OP_REQUIRES_OK(ctx, ctx->input_list("counts", &counts));
    const int n = sections.size();
    const int64_t world = counts[0].NumElements();
    OP_REQUIRES(ctx, world >= 1,
                errors::InvalidArgument("counts[0] is empty: a message needs at least one rank"));
    // offsets[k * world + r]: where rank r's words of section k start.
    std::vector<int64_t> offsets(static_cast<size_t>(n) * world);
    std::vector<int64_t> part(world, n);  // words per destination, header included
    for (int k = 0; k < n; ++k) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(counts[k].shape()) &&
                           counts[k].NumElements() == world,
                  errors::InvalidArgument("counts[", k, "] must be a vector of ", world,
                                          " counts (one per rank, as counts[0]), got shape ",
                                          counts[k].shape().DebugString()));
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(sections[k].shape()),
                  errors::InvalidArgument("sections[", k, "] must be a vector, got shape ",
                                          sections[k].shape().DebugString()));
      const int32_t* c = counts[k].flat<int32_t>().data();
      int64_t at = 0;
      for (int64_t r = 0; r < world; ++r) {
        OP_REQUIRES(ctx, c[r] >= 0,
                    errors::InvalidArgument("counts[", k, "][", r, "] = ", c[r],
                                            ": counts must be >= 0"));
        offsets[k * world + r] = at;
        at += c[r];
        part[r] += c[r];
      }
      OP_REQUIRES(ctx, at == sections[k].NumElements(),
                  errors::InvalidArgument("counts[", k, "] add up to ", at,
                                          " words but sections[", k, "] has ",
                                          sections[k].NumElements()));
    }
    int64_t total = 0;
    for (int64_t r = 0; r < world; ++r) {
      OP_REQUIRES(ctx, part[r] <= kMaxWords,
                  errors::InvalidArgument("the message for rank ", r, " would have ", part[r],
                                          " words; an all-to-all split holds at most ",
                                          kMaxWords));
      total += part[r];
    }
    Tensor* message = nullptr;
    Tensor* splits = nullptr;
    const int64_t length = steady_ ? SteadyLength(total) : total;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({length}), &message));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({world}), &splits));
    double* out = message->flat<double>().data();
    // Padding (never sent) is zero, so that the output is deterministic.
    std::memset(out + total, 0, sizeof(double) * (length - total));
    int32_t* out_splits = splits->flat<int32_t>().data();
    for (int64_t r = 0; r < world; ++r) {
      out_splits[r] = static_cast<int32_t>(part[r]);
      for (int k = 0; k < n; ++k) {
        const int64_t count = counts[k].flat<int32_t>()(r);
        std::memcpy(out++, &count, sizeof(double));
      }
      for (int k = 0; k < n; ++k) {
        const int64_t count = counts[k].flat<int32_t>()(r);
        if (count == 0) continue;
        std::memcpy(out, sections[k].flat<double>().data() + offsets[k * world + r],
                    sizeof(double) * count);
        out += count;
      }
    }
  }
 private:
  bool steady_ = false;
};

class UnframeOp : public OpKernel {
 public:
  explicit UnframeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& message = ctx->input(0);
    const Tensor& sizes = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(message.shape()),
                errors::InvalidArgument("message must be a vector, got shape ",
                                        message.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(sizes.shape()),
                errors::InvalidArgument("sizes must be a vector (words from each rank), got "
                                        "shape ", sizes.shape().DebugString()));
    const int64_t world = sizes.NumElements();
    OP_REQUIRES(ctx, world >= 1,
                errors::InvalidArgument("sizes is empty: a message comes from at least one rank"));
    const int32_t* size = sizes.flat<int32_t>().data();
    const double* in = message.flat<double>().data();
    // Read and check every header before writing anything.
    std::vector<int64_t> counts(static_cast<size_t>(world) * n_);
    std::vector<int64_t> totals(n_, 0);
    int64_t at = 0;
    for (int64_t s = 0; s < world; ++s) {
      OP_REQUIRES(ctx, size[s] >= n_ && at + size[s] <= message.NumElements(),
                  errors::InvalidArgument(
                      "the part from rank ", s, " has ", size[s], " words at word ", at,
                      " of a ", message.NumElements(), "-word message; a part holds a ", n_,
                      "-word header and lies inside the message"));
      int64_t body = 0;
      for (int k = 0; k < n_; ++k) {
        int64_t c;
        std::memcpy(&c, in + at + k, sizeof(c));
        OP_REQUIRES(ctx, c >= 0 && c <= size[s],
                    errors::InvalidArgument("the part from rank ", s, " gives section ", k,
                                            " a count of ", c, ", outside [0, ", size[s], "]"));
        counts[s * n_ + k] = c;
        body += c;
        totals[k] += c;
      }
      OP_REQUIRES(ctx, n_ + body == size[s],
                  errors::InvalidArgument("the part from rank ", s, " has ", size[s],
                                          " words, but its header counts ", n_, " + ", body,
                                          ": not a message framed with ", n_, " sections"));
      at += size[s];
    }
    OP_REQUIRES(ctx, at == message.NumElements(),
                errors::InvalidArgument("sizes add up to ", at, " words but the message has ",
                                        message.NumElements()));
    std::vector<double*> out(n_);
    for (int k = 0; k < n_; ++k) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(k, TensorShape({totals[k]}), &t));
      out[k] = t->flat<double>().data();
    }
    Tensor* counts_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(n_, TensorShape({world, n_}), &counts_out));
    int32_t* c_out = counts_out->flat<int32_t>().data();
    at = 0;
    for (int64_t s = 0; s < world; ++s) {
      const double* p = in + at + n_;
      for (int k = 0; k < n_; ++k) {
        const int64_t c = counts[s * n_ + k];
        c_out[s * n_ + k] = static_cast<int32_t>(c);
        if (c > 0) std::memcpy(out[k], p, sizeof(double) * c);
        out[k] += c;
        p += c;
      }
      at += size[s];
    }
  }

 private:
  int n_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("SfctrFrame").Device(DEVICE_CPU), FrameOp);
REGISTER_KERNEL_BUILDER(Name("SfctrUnframe").Device(DEVICE_CPU), UnframeOp);

}  // namespace
}  // namespace tensorflow
