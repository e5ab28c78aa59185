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
 * Outputs of one run, in the result buffers: the caller's (engine_run's
 * out_base) or `block`, allocated here and freed with the result.
 */
struct engine_result {
	size_t n;
	struct engine_tensor *tensors;
	void **handles; /* AtenTensorHandle (aliases of the result buffers), owned */
	void *block;    /* the result buffers when the caller gave none, owned */
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
/* Keeps fd (cache_pin's) open while the graph is loaded; closed on unload. */
void engine_pin(struct engine_graph *g, int fd);
/* Data inputs (the graph also takes one result buffer per output, after them). */
size_t engine_num_inputs(const struct engine_graph *g);
size_t engine_num_outputs(const struct engine_graph *g);

/*
 * Lays the outputs out one after another, each PROTO_TENSOR_ALIGN-aligned:
 * fills offsets (may be NULL) and returns the bytes they take.
 */
uint64_t engine_out_layout(const struct engine_tensor *out, size_t n, uint64_t *offsets);

/*
 * Runs the graph.  `expected` holds the signature the graph was compiled
 * for (dtype and shape per input); inputs that differ are refused with
 * SPEC_MISMATCH before Run, because generated code does not check shapes.
 * `expected_out` holds the outputs' dtypes and shapes: the graph writes its
 * results straight into buffers laid out by engine_out_layout at out_base
 * (a client's shared memory, 64-byte aligned), or, with out_base NULL, in a
 * block allocated for the result.  Outputs that differ from expected_out
 * (an artifact that is not the graph its metadata says) fail with
 * ARTIFACT_CORRUPT.  Inputs are wrapped without copying when
 * PROTO_TENSOR_ALIGN-aligned, else copied.  Returns 0 with res filled
 * (free with engine_result_free), or -1.
 */
int engine_run(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
               const struct engine_tensor *expected, const struct engine_tensor *expected_out,
               uint8_t *out_base, struct engine_result *res, struct proto_err *err);
void engine_result_free(struct engine_result *res);
/* Bytes of a C-contiguous tensor of t's dtype and shape. */
uint64_t engine_tensor_bytes(const struct engine_tensor *t);
/*
 * engine_run with the outputs written where out[i].data points (shapes and
 * dtypes in out[i]; nbytes is set here): for a run split in chunks, whose
 * results land in slices of bigger buffers.  Nothing is left allocated.
 */
int engine_run_into(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
                    const struct engine_tensor *expected, struct engine_tensor *out, size_t n_out,
                    struct proto_err *err);

/* How many distinct libgomp images are mapped into this process (1 is right). */
int engine_count_openmp_runtimes(void);

#endif
