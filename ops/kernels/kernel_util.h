// Helpers shared by the op kernels of this library (store_kernels.cc,
// step_kernels.cc).
#ifndef SFCTR_OPS_KERNELS_KERNEL_UTIL_H_
#define SFCTR_OPS_KERNELS_KERNEL_UTIL_H_

#include <new>
#include <stdexcept>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace sfctr_kernels {

// Runs a kernel body that may run out of host memory (std::bad_alloc from
// the core or the kernel's own buffers): the op fails with
// ResourceExhausted, "<op>: out of host memory <where()>", instead of the
// exception unwinding into TensorFlow (which ends the process). Returns
// whether the body finished. The core's entry points that change a table
// already return a status saying what was kept; this catches the rest
// (reads, exports, scratch buffers, a pool task's bookkeeping).
template <typename Where, typename Body>
inline bool CatchOutOfMemory(OpKernelContext* ctx, const Where& where, const Body& body) {
  try {
    body();
    return true;
  } catch (const std::bad_alloc&) {
    ctx->CtxFailure(errors::ResourceExhausted(ctx->op_kernel().type_string(),
                                              ": out of host memory ", where()));
  } catch (const std::length_error&) {  // a buffer past max_size
    ctx->CtxFailure(errors::ResourceExhausted(ctx->op_kernel().type_string(),
                                              ": a buffer too large for memory ", where()));
  }
  return false;
}

}  // namespace sfctr_kernels
}  // namespace tensorflow

#endif  // SFCTR_OPS_KERNELS_KERNEL_UTIL_H_
