/*
 * engine.c - dlopen'ed AOTInductor artifacts driven through the model
 * container's extern "C" entry points, with tensors made by libtorch's C
 * shim.  Runs on thread-pool threads; a graph may run concurrently (the
 * container serialises per model instance).  engine_unload must only be
 * called once no run is in flight (the registry holds references).
 *
 * Ownership at the ABI: Run steals the input handles (it NULLs what it took)
 * and hands back owned output handles, which engine_result_free deletes.
 *
 * Fault flag: an artifact whose kernels check indices read from data exports
 * `int torchloop_index_fault` (the worker's index_guard.py): a failed check
 * sets a bit there and the kernel goes on with a safe index, because a C++
 * exception cannot leave the OpenMP region it is raised in.  Runs of such an
 * artifact are serialised by fault_lock (the flag is one per artifact):
 * cleared before Run, read after; a set bit fails the request.
 */
#include "engine.h"

#include "aoti.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct engine_graph {
	void *dl;
	AOTInductorModelContainerHandle container;
	aoti_delete_fn destroy;
	aoti_run_fn run;
	aoti_last_error_fn last_error;
	size_t n_in, n_out;
	int pin_fd;                 /* the cache entry's pin (engine_pin), -1: none */
	int *fault;                 /* ENGINE_FAULT_SYMBOL, or NULL: the graph checks no index */
	pthread_mutex_t fault_lock; /* serialises runs when fault is set */
	char path[512];
};

/* Bits of the fault flag (daemon/worker/torchloop_worker/index_guard.py). */
#define ENGINE_FAULT_SYMBOL "torchloop_index_fault"
#define ENGINE_FAULT_INDEX  1
#define ENGINE_FAULT_ASSERT 2
#define ENGINE_FAULT_LINALG 4

static int runtime_fail(const struct engine_graph *g, struct proto_err *err, const char *what)
{
	const char *detail = NULL;

	if (g->last_error != NULL && g->last_error(&detail) == 0 && detail && *detail) {
		/* the inputs matched the signature (checked before Run): a graph that
		 * finds them unmatched was compiled for another one */
		if (strstr(detail, "input_handles[") && strstr(detail, "unmatched"))
			return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
			                  "%s is not the graph its metadata describes: %s", g->path,
			                  detail);
		return proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "%s: %s: %s", g->path, what,
		                  detail);
	}
	return proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "%s: %s failed", g->path, what);
}

/* AOTI writes <name>.json next to the .so when extern kernels need the proxy executor. */
static int needs_proxy_executor(const char *so_path, struct proto_err *err)
{
	char json[600];
	size_t n = strlen(so_path);

	if (n < 3 || n + 3 >= sizeof json)
		return 0;
	snprintf(json, sizeof json, "%.*s.json", (int)(n - 3), so_path);
	if (access(json, F_OK) != 0)
		return 0;
	return proto_fail(err, PROTO_E_PROXY_EXECUTOR_REQUIRED, NULL,
	                  "%s needs AOTI's C++ proxy executor (extern-node file %s); "
	                  "torchloopd runs artifacts from C and cannot provide it",
	                  so_path, json);
}

static void *need_sym(struct engine_graph *g, const char *name, struct proto_err *err)
{
	void *p = dlsym(g->dl, name);

	if (p == NULL)
		proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "%s: missing symbol %s", g->path, name);
	return p;
}

static int resolve(struct engine_graph *g, size_t concurrency, struct proto_err *err)
{
	aoti_create_fn create =
	    (aoti_create_fn)need_sym(g, "AOTInductorModelContainerCreateWithDevice", err);
	aoti_count_fn n_in =
	    (aoti_count_fn)need_sym(g, "AOTInductorModelContainerGetNumInputs", err);
	aoti_count_fn n_out =
	    (aoti_count_fn)need_sym(g, "AOTInductorModelContainerGetNumOutputs", err);

	g->destroy = (aoti_delete_fn)need_sym(g, "AOTInductorModelContainerDelete", err);
	g->run = (aoti_run_fn)need_sym(g, "AOTInductorModelContainerRun", err);
	g->last_error = (aoti_last_error_fn)dlsym(g->dl, "AOTInductorGetLastError");
	g->fault = (int *)dlsym(g->dl, ENGINE_FAULT_SYMBOL);
	if (!create || !n_in || !n_out || !g->destroy || !g->run)
		return -1;
	if (create(&g->container, concurrency ? concurrency : 1, "cpu", NULL) != 0)
		return runtime_fail(g, err, "creating the model container");
	if (n_in(g->container, &g->n_in) != 0 || n_out(g->container, &g->n_out) != 0)
		return runtime_fail(g, err, "reading the graph's arity");
	/* out-variant graphs: the result buffers follow the data inputs */
	if (g->n_in < g->n_out)
		return proto_fail(
		    err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		    "%s takes %zu inputs for %zu outputs: not a graph that writes its "
		    "results into buffers it is given",
		    g->path, g->n_in, g->n_out);
	g->n_in -= g->n_out;
	return 0;
}

int engine_load(const char *so_path, size_t concurrency, struct engine_graph **out,
                struct proto_err *err)
{
	struct engine_graph *g;

	if (needs_proxy_executor(so_path, err))
		return -1;
	g = calloc(1, sizeof *g);
	if (g == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	snprintf(g->path, sizeof g->path, "%s", so_path);
	g->pin_fd = -1;
	pthread_mutex_init(&g->fault_lock, NULL);
	g->dl = dlopen(so_path, RTLD_NOW | RTLD_LOCAL);
	if (g->dl == NULL) {
		proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "dlopen %s: %s", so_path, dlerror());
		free(g);
		return -1;
	}
	if (resolve(g, concurrency, err) != 0) {
		engine_unload(g);
		return -1;
	}
	*out = g;
	return 0;
}

void engine_unload(struct engine_graph *g)
{
	if (g == NULL)
		return;
	if (g->container != NULL)
		g->destroy(g->container);
	if (g->dl != NULL)
		dlclose(g->dl);
	if (g->pin_fd >= 0)
		close(g->pin_fd);
	pthread_mutex_destroy(&g->fault_lock);
	free(g);
}

void engine_pin(struct engine_graph *g, int fd)
{
	if (g->pin_fd >= 0)
		close(g->pin_fd);
	g->pin_fd = fd;
}

size_t engine_num_inputs(const struct engine_graph *g)
{
	return g->n_in;
}

size_t engine_num_outputs(const struct engine_graph *g)
{
	return g->n_out;
}

static int32_t torch_dtype(enum proto_dtype d)
{
	return d == PROTO_DTYPE_F32 ? aoti_torch_dtype_float32() : aoti_torch_dtype_float64();
}

static void contiguous_strides(uint32_t ndim, const int64_t *shape, int64_t *strides)
{
	int64_t s = 1;

	for (uint32_t i = ndim; i-- > 0;) {
		strides[i] = s;
		s *= shape[i] > 0 ? shape[i] : 1;
	}
}

static int check_inputs(const struct engine_graph *g, const struct engine_tensor *in, size_t n,
                        const struct engine_tensor *expected, struct proto_err *err)
{
	if (n != g->n_in)
		return proto_fail(err, PROTO_E_SPEC_MISMATCH, NULL,
		                  "graph takes %zu inputs, got %zu", g->n_in, n);
	for (size_t i = 0; i < n; i++) {
		const struct engine_tensor *a = &in[i], *e = &expected[i];
		if (a->dtype != e->dtype || a->ndim != e->ndim ||
		    memcmp(a->shape, e->shape, a->ndim * sizeof a->shape[0]) != 0)
			return proto_fail(err, PROTO_E_SPEC_MISMATCH, NULL,
			                  "input %zu differs from the compiled signature", i);
	}
	return 0;
}

/* Wraps (or, when misaligned, copies) one input; *copy gets any copy made. */
static int wrap_input(const struct engine_tensor *t, AtenTensorHandle *h, void **copy,
                      struct proto_err *err)
{
	int64_t strides[PROTO_MAX_NDIM];
	void *data = t->data;

	*copy = NULL;
	if (((uintptr_t)data % PROTO_TENSOR_ALIGN) != 0 || data == NULL) {
		size_t sz =
		    (t->nbytes + PROTO_TENSOR_ALIGN - 1) & ~(size_t)(PROTO_TENSOR_ALIGN - 1);
		*copy = aligned_alloc(PROTO_TENSOR_ALIGN, sz ? sz : PROTO_TENSOR_ALIGN);
		if (*copy == NULL)
			return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		if (t->nbytes)
			memcpy(*copy, data, t->nbytes);
		data = *copy;
	}
	contiguous_strides(t->ndim, t->shape, strides);
	if (aoti_torch_create_tensor_from_blob(data, t->ndim, t->shape, strides, 0,
	                                       torch_dtype(t->dtype), aoti_torch_device_type_cpu(),
	                                       0, h) != 0)
		return proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "cannot wrap an input tensor");
	return 0;
}

/* Copies a strided tensor into a contiguous buffer, element by element. */
static void strided_copy(char *dst, const char *src, uint32_t ndim, const int64_t *shape,
                         const int64_t *strides, size_t item)
{
	int64_t idx[PROTO_MAX_NDIM] = {0};
	uint64_t total = 1;

	for (uint32_t i = 0; i < ndim; i++)
		total *= (uint64_t)shape[i];
	for (uint64_t n = 0; n < total; n++) {
		int64_t off = 0;
		for (uint32_t i = 0; i < ndim; i++)
			off += idx[i] * strides[i];
		memcpy(dst + n * item, src + off * (int64_t)item, item);
		for (uint32_t i = ndim; i-- > 0;) {
			if (++idx[i] < shape[i])
				break;
			idx[i] = 0;
		}
	}
}

/* Bytes of a contiguous tensor of t's dtype and shape (its nbytes field is
 * not trusted: the graph writes exactly this many). */
uint64_t engine_tensor_bytes(const struct engine_tensor *t)
{
	uint64_t n = proto_dtype_size(t->dtype);

	for (uint32_t k = 0; k < t->ndim; k++)
		n *= (uint64_t)t->shape[k];
	return n;
}

uint64_t engine_out_layout(const struct engine_tensor *out, size_t n, uint64_t *offsets)
{
	uint64_t at = 0;

	for (size_t i = 0; i < n; i++) {
		at = (at + PROTO_TENSOR_ALIGN - 1) / PROTO_TENSOR_ALIGN * PROTO_TENSOR_ALIGN;
		if (offsets)
			offsets[i] = at;
		at += engine_tensor_bytes(&out[i]);
	}
	return at;
}

/*
 * Reads output i: it must have the signature's dtype and shape (else the
 * artifact is not the graph its metadata describes), and its bytes end up in
 * slot i of the result buffers -- where the graph wrote them, or copied there
 * when a graph returned other storage.
 */
static int read_output(struct engine_result *res, size_t i, const struct engine_tensor *want,
                       struct proto_err *err)
{
	AtenTensorHandle h = res->handles[i];
	struct engine_tensor *t = &res->tensors[i];
	int64_t dim, *sizes, *strides, cont[PROTO_MAX_NDIM];
	int32_t dtype;
	void *data;

	if (aoti_torch_get_dim(h, &dim) != 0 || aoti_torch_get_sizes(h, &sizes) != 0 ||
	    aoti_torch_get_strides(h, &strides) != 0 || aoti_torch_get_dtype(h, &dtype) != 0 ||
	    aoti_torch_get_data_ptr(h, &data) != 0)
		return proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "cannot read output %zu", i);
	if (dim != want->ndim || dtype != torch_dtype(want->dtype) ||
	    memcmp(sizes, want->shape, (size_t)dim * sizeof *sizes) != 0)
		return proto_fail(
		    err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		    "output %zu of the graph has rank %lld, but its signature needs %s "
		    "rank %u of other dims: the artifact is not the graph its "
		    "metadata describes",
		    i, (long long)dim, proto_dtype_name(want->dtype), want->ndim);
	if (data == t->data || t->nbytes == 0)
		return 0;
	contiguous_strides(t->ndim, t->shape, cont);
	if (memcmp(cont, strides, (size_t)dim * sizeof *cont) == 0)
		memcpy(t->data, data, t->nbytes);
	else
		strided_copy(t->data, data, t->ndim, t->shape, strides, proto_dtype_size(t->dtype));
	return 0;
}

/* A fault the kernels flagged (bits of ENGINE_FAULT_SYMBOL) as err. */
static int fault_fail(const struct engine_graph *g, int bits, struct proto_err *err)
{
	if (bits & ENGINE_FAULT_INDEX)
		return proto_fail(
		    err, PROTO_E_INDEX_OUT_OF_RANGE, NULL,
		    "an index the graph read from its inputs is out of range "
		    "(as eager torch's 'index out of bounds'); no result was returned");
	if (bits & ENGINE_FAULT_LINALG)
		return proto_fail(err, PROTO_E_LINALG_ERROR, NULL,
		                  "a linear-algebra op of the graph met a singular (or, for a "
		                  "Cholesky factorization, non-positive-definite) matrix, as eager "
		                  "torch's torch.linalg.LinAlgError; no result was returned");
	return proto_fail(err, PROTO_E_ENGINE_ERROR, NULL, "%s: an assertion in the graph failed",
	                  g->path);
}

/* Run, with the fault flag cleared before and read after (under fault_lock)
 * when the artifact has one.  Returns 0, or -1 with err. */
static int run_checked(struct engine_graph *g, AtenTensorHandle *handles, size_t n_all,
                       struct engine_result *res, struct proto_err *err)
{
	int rc, bits = 0;

	if (g->fault != NULL) {
		pthread_mutex_lock(&g->fault_lock);
		__atomic_store_n(g->fault, 0, __ATOMIC_RELAXED);
	}
	rc = g->run(g->container, handles, n_all, (AtenTensorHandle *)res->handles, g->n_out, NULL,
	            NULL);
	if (g->fault != NULL) {
		/* the team's writes are ordered before its join; acquire for the rest */
		bits = __atomic_exchange_n(g->fault, 0, __ATOMIC_ACQ_REL);
		pthread_mutex_unlock(&g->fault_lock);
	}
	if (rc != 0)
		return runtime_fail(g, err, "running the graph");
	if (bits != 0)
		return fault_fail(g, bits, err);
	return 0;
}

/* Wraps the inputs and res's output buffers, runs the container and reads
 * its outputs into res (res->tensors and res->handles are set up). */
static int run_graph(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
                     const struct engine_tensor *expected_out, struct engine_result *res,
                     struct proto_err *err)
{
	size_t n_all = n_in + g->n_out, made = 0;
	AtenTensorHandle *handles = calloc(n_all ? n_all : 1, sizeof *handles);
	void **copies = calloc(n_all ? n_all : 1, sizeof *copies);
	int rc = -1;

	if (!handles || !copies) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		goto out;
	}
	for (; made < n_all; made++) {
		const struct engine_tensor *t =
		    made < n_in ? &in[made] : &res->tensors[made - n_in];
		if (wrap_input(t, &handles[made], &copies[made], err) != 0)
			goto out;
	}
	if (run_checked(g, handles, n_all, res, err) != 0)
		goto out;
	rc = 0;
	for (size_t i = 0; i < g->n_out && rc == 0; i++)
		rc = read_output(res, i, &expected_out[i], err);
out:
	for (size_t i = 0; handles && i < made; i++)
		if (handles[i] != NULL) /* Run took what it NULLed */
			aoti_torch_delete_tensor_object(handles[i]);
	for (size_t i = 0; copies && i < n_all; i++)
		free(copies[i]);
	free(handles);
	free(copies);
	return rc;
}

int engine_run(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
               const struct engine_tensor *expected, const struct engine_tensor *expected_out,
               uint8_t *out_base, struct engine_result *res, struct proto_err *err)
{
	uint64_t *offsets = NULL, total;
	int rc = -1;

	memset(res, 0, sizeof *res);
	if (check_inputs(g, in, n_in, expected, err) != 0)
		return -1;
	offsets = calloc(g->n_out ? g->n_out : 1, sizeof *offsets);
	res->n = g->n_out;
	res->tensors = calloc(g->n_out ? g->n_out : 1, sizeof *res->tensors);
	res->handles = calloc(g->n_out ? g->n_out : 1, sizeof *res->handles);
	if (!offsets || !res->tensors || !res->handles) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		goto out;
	}
	total = engine_out_layout(expected_out, g->n_out, offsets);
	if (out_base == NULL) {
		res->block =
		    aligned_alloc(PROTO_TENSOR_ALIGN, (total + PROTO_TENSOR_ALIGN) & ~(uint64_t)63);
		if (res->block == NULL) {
			proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory for the results");
			goto out;
		}
		out_base = res->block;
	}
	for (size_t i = 0; i < g->n_out; i++) {
		res->tensors[i] = expected_out[i];
		res->tensors[i].nbytes = engine_tensor_bytes(&expected_out[i]);
		res->tensors[i].data = out_base + offsets[i];
	}
	rc = run_graph(g, in, n_in, expected_out, res, err);
out:
	free(offsets);
	if (rc != 0)
		engine_result_free(res);
	return rc;
}

int engine_run_into(struct engine_graph *g, const struct engine_tensor *in, size_t n_in,
                    const struct engine_tensor *expected, struct engine_tensor *out, size_t n_out,
                    struct proto_err *err)
{
	struct engine_result res = {n_out, out, NULL, NULL};
	int rc;

	if (n_out != g->n_out)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "the graph has %zu outputs, its signature %zu", g->n_out, n_out);
	if (check_inputs(g, in, n_in, expected, err) != 0)
		return -1;
	res.handles = calloc(n_out ? n_out : 1, sizeof *res.handles);
	if (res.handles == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	for (size_t i = 0; i < n_out; i++)
		out[i].nbytes = engine_tensor_bytes(&out[i]);
	rc = run_graph(g, in, n_in, out, &res, err);
	for (size_t i = 0; i < n_out; i++)
		if (res.handles[i])
			aoti_torch_delete_tensor_object(res.handles[i]);
	free(res.handles);
	return rc;
}

void engine_result_free(struct engine_result *res)
{
	for (size_t i = 0; i < res->n; i++)
		if (res->handles && res->handles[i])
			aoti_torch_delete_tensor_object(res->handles[i]);
	free(res->tensors);
	free(res->handles);
	free(res->block);
	memset(res, 0, sizeof *res);
}

int engine_count_openmp_runtimes(void)
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[1024], seen[8][512];
	int n = 0;

	if (f == NULL)
		return -1;
	while (fgets(line, sizeof line, f) != NULL) {
		char *path = strchr(line, '/');
		int dup = 0;
		if (path == NULL || strstr(path, "libgomp") == NULL)
			continue;
		path[strcspn(path, "\n")] = '\0';
		for (int i = 0; i < n; i++)
			dup |= strcmp(seen[i], path) == 0;
		if (!dup && n < 8)
			snprintf(seen[n++], sizeof seen[0], "%s", path);
	}
	fclose(f);
	return n;
}
