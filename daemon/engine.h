/*
 * engine.h - runs compiled scan graphs (AOTInductor shared objects) through
 * libtorch's C ABI.  A graph is loaded once and run from any number of
 * thread-pool threads at once (the container holds `concurrency` model
 * instances).  Nothing here touches the event loop.
 */
#ifndef TORCHLOOP_ENGINE_H
#define TORCHLOOP_ENGINE_H

#include "protocol.h"

#include <stddef.h>
#include <stdint.h>

struct engine_graph;

struct engine_tensor {
	enum proto_dtype dtype;
	uint32_t ndim;
	int64_t shape[PROTO_MAX_NDIM];
	void *data; /* C-contiguous; inputs: borrowed; outputs: see engine_result */
	uint64_t nbytes;
};

/*
 * Outputs of one run.  Each tensor's data stays valid until
 * engine_result_free: it is the output's own storage when contiguous, else
 * a contiguous copy.
 */
struct engine_result {
	size_t n;
	struct engine_tensor *tensors;
	void **handles; /* AtenTensorHandle, owned */
	void **copies;  /* malloc'ed contiguous copies, owned */
};

/*
 * Loads an artifact (dlopen, RTLD_LOCAL) and creates a CPU container.
 * Refuses an artifact next to which an AOTI extern-node .json sits (it needs
 * the C++ proxy executor).  Returns 0 or -1 with err (ENGINE_ERROR or
 * PROXY_EXECUTOR_REQUIRED).
 */
int engine_load(const char *so_path, size_t concurrency, struct engine_graph **out,
                struct proto_err *err);
void engine_unload(struct engine_graph *g);
size_t engine_num_inputs(const struct engine_graph *g);
size_t engine_num_outputs(const struct engine_graph *g);

/*
 * Runs the graph.  `expected` holds the signature the graph was compiled
 * for (dtype and shape per input); inputs that differ are refused with
 * SPEC_MISMATCH before Run, because generated code does not check shapes.
 * `expected_out` (when not NULL) holds what the graph must return: outputs
 * that differ in count, dtype or shape (an artifact that is not the graph
 * its metadata says) fail with ARTIFACT_CORRUPT before anything is read.
 * Inputs are wrapped without copying when PROTO_TENSOR_ALIGN-aligned, else
 * copied.  Returns 0 with res filled (free with engine_result_free), or -1.
 */
int engine_run(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
               const struct engine_tensor *expected, const struct engine_tensor *expected_out,
               struct engine_result *res, struct proto_err *err);
void engine_result_free(struct engine_result *res);

/* How many distinct libgomp images are mapped into this process (1 is right). */
int engine_count_openmp_runtimes(void);

#endif
