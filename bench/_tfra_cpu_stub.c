/* No-op CUDA runtime entry points so that the TF Recommenders-Addons 0.8.1
 * wheel (built with CUDA) loads under tensorflow-cpu. Benchmarks only.
 *
 * The wheel's op libraries register their GPU kernels' fat binaries at load
 * time and reference cudart functions; tensorflow-cpu ships no cudart, so
 * tf.load_op_library (RTLD_NOW) fails with "undefined symbol:
 * __cudaUnregisterFatBinary". On a CPU-only TensorFlow no GPU kernel is ever
 * placed, so the registration calls are no-ops and every other entry point
 * reports "no CUDA device" (cudaErrorNoDevice = 100).
 *
 * Mangled C++ names are valid C identifiers, so the two stream_executor
 * symbols are defined here too (constructor/destructor that do nothing).
 */
#include <stddef.h>

static void *fat_handle[1];
static char no_device[] = "no CUDA device (tf_sfctr bench stub)";

void **__cudaRegisterFatBinary(void *fat) { (void)fat; return fat_handle; }
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterFunction(void) {}
void __cudaRegisterVar(void) {}
unsigned __cudaPushCallConfiguration(void) { return 100; }
int __cudaPopCallConfiguration(void) { return 100; }

int cudaGetDeviceCount(int *n) { if (n) *n = 0; return 100; }
const char *cudaGetErrorString(int e) { (void)e; return no_device; }
const char *cudaGetErrorName(int e) { (void)e; return "cudaErrorNoDevice"; }

#define NO_DEVICE(name) int name(void) { return 100; }
NO_DEVICE(cudaDeviceGetAttribute)
NO_DEVICE(cudaDeviceSynchronize)
NO_DEVICE(cudaEventCreate)
NO_DEVICE(cudaEventDestroy)
NO_DEVICE(cudaEventQuery)
NO_DEVICE(cudaEventRecord)
NO_DEVICE(cudaFree)
NO_DEVICE(cudaFreeAsync)
NO_DEVICE(cudaFreeHost)
NO_DEVICE(cudaFuncGetAttributes)
NO_DEVICE(cudaGetDevice)
NO_DEVICE(cudaGetDeviceProperties_v2)
NO_DEVICE(cudaGetLastError)
NO_DEVICE(cudaHostAlloc)
NO_DEVICE(cudaHostGetDevicePointer)
NO_DEVICE(cudaLaunchKernel)
NO_DEVICE(cudaMalloc)
NO_DEVICE(cudaMallocAsync)
NO_DEVICE(cudaMallocManaged)
NO_DEVICE(cudaMemcpy)
NO_DEVICE(cudaMemcpyAsync)
NO_DEVICE(cudaMemcpyToSymbol)
NO_DEVICE(cudaMemset)
NO_DEVICE(cudaMemsetAsync)
NO_DEVICE(cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
NO_DEVICE(cudaPeekAtLastError)
NO_DEVICE(cudaPointerGetAttributes)
NO_DEVICE(cudaSetDevice)
NO_DEVICE(cudaStreamCreate)
NO_DEVICE(cudaStreamDestroy)
NO_DEVICE(cudaStreamQuery)
NO_DEVICE(cudaStreamSynchronize)

/* stream_executor::gpu::ScopedActivateExecutorContext::{ctor, dtor} */
void _ZN15stream_executor3gpu29ScopedActivateExecutorContextC1EPNS_14StreamExecutorE(void *self, void *executor) { (void)self; (void)executor; }
void _ZN15stream_executor3gpu29ScopedActivateExecutorContextD1Ev(void *self) { (void)self; }
