/*
 * aoti.h - the few extern "C" prototypes torchloopd uses from libtorch's
 * stable C shim (torch/csrc/inductor/aoti_torch/c/shim.h) and from the
 * AOTInductor model container (aoti_runtime/interface.h).  Those headers are
 * C++; these declarations mirror them for torch 2.14 (checked by
 * tests/unit/test_engine.c against a real artifact).  No C++ torch header is
 * included anywhere in the daemon.
 */
#ifndef TORCHLOOP_AOTI_H
#define TORCHLOOP_AOTI_H

#include <stddef.h>
#include <stdint.h>

typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef int32_t AOTITorchError;   /* 0 = AOTI_TORCH_SUCCESS */
typedef int32_t AOTIRuntimeError; /* 0 = success */
typedef struct AOTInductorModelContainerOpaque *AOTInductorModelContainerHandle;
typedef struct AOTInductorStreamOpaque *AOTInductorStreamHandle;
typedef struct AOTIProxyExecutorOpaque *AOTIProxyExecutorHandle;

/* libtorch_cpu (linked directly) */
int32_t aoti_torch_device_type_cpu(void);
int32_t aoti_torch_dtype_float32(void);
int32_t aoti_torch_dtype_float64(void);
AOTITorchError aoti_torch_create_tensor_from_blob(void *data, int64_t ndim,
                                                  const int64_t *sizes_ptr,
                                                  const int64_t *strides_ptr,
                                                  int64_t storage_offset, int32_t dtype,
                                                  int32_t device_type, int32_t device_index,
                                                  AtenTensorHandle *ret);
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle tensor);
AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle tensor, void **ret_data_ptr);
AOTITorchError aoti_torch_get_dim(AtenTensorHandle tensor, int64_t *ret_dim);
AOTITorchError aoti_torch_get_sizes(AtenTensorHandle tensor, int64_t **ret_sizes);
AOTITorchError aoti_torch_get_strides(AtenTensorHandle tensor, int64_t **ret_strides);
AOTITorchError aoti_torch_get_dtype(AtenTensorHandle tensor, int32_t *ret_dtype);

/* the artifact (resolved with dlsym per loaded .so) */
typedef AOTIRuntimeError (*aoti_create_fn)(AOTInductorModelContainerHandle *container,
                                           size_t num_models, const char *device_str,
                                           const char *cubin_dir);
typedef AOTIRuntimeError (*aoti_delete_fn)(AOTInductorModelContainerHandle container);
typedef AOTIRuntimeError (*aoti_run_fn)(AOTInductorModelContainerHandle container,
                                        AtenTensorHandle *input_handles, size_t num_inputs,
                                        AtenTensorHandle *output_handles, size_t num_outputs,
                                        AOTInductorStreamHandle stream,
                                        AOTIProxyExecutorHandle proxy_executor);
typedef AOTIRuntimeError (*aoti_count_fn)(AOTInductorModelContainerHandle container, size_t *ret);
typedef AOTIRuntimeError (*aoti_last_error_fn)(const char **msg);

#endif
