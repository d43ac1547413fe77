// Helpers shared by the op kernels of this library (store_kernels.cc,
// step_kernels.cc).
#ifndef SFCTR_OPS_KERNELS_KERNEL_UTIL_H_
#define SFCTR_OPS_KERNELS_KERNEL_UTIL_H_

#include <new>
#include <stdexcept>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"

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

// The float ops below on resource variables have no dtype attribute: check
// the variable's type before anything reads it as float.
inline Status CheckFloatVariable(Var* var, const char* name) {
  if (!var->tensor()->IsInitialized()) {
    return errors::FailedPrecondition(name, " is not initialized");
  }
  if (var->tensor()->dtype() != DT_FLOAT) {
    return errors::InvalidArgument(name, " must be a float32 variable, got ",
                                   DataTypeString(var->tensor()->dtype()));
  }
  return OkStatus();
}

}  // namespace sfctr_kernels
}  // namespace tensorflow

#endif  // SFCTR_OPS_KERNELS_KERNEL_UTIL_H_
