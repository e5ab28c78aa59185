/*
 * probe.c - the start-up probe: one tiny scan (carry + x over T=2) goes the
 * whole way -- compile worker, cache commit and verify, dlopen from the
 * cache directory, run -- and its result is checked against hand-computed
 * numbers.  A failure (no torch, a noexec cache, a broken toolchain) stops
 * the start with a clear message instead of failing the first client.  The
 * artifact is cached like any other, so later starts only load and run it.
 */
#include "daemon.h"

#include "log.h"
#include "signature.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char PROBE_SOURCE[] =
    "def body(carry, x):\n    carry = carry + x\n    return carry, carry\n";

struct probe {
	uv_work_t work;
	struct daemon *d;
	void (*done)(struct daemon *d, const struct proto_err *err);
	char key[CACHE_KEY_HEX];
	int lock_fd;
	bool need_compile, lock_busy;
	uv_timer_t retry;
	double lock_wait_started;
	int rc;
	struct proto_err err;
	struct compile_job job;
	struct compile_result res;
	struct tree_node carry, inputs;
};

static void probe_key(struct probe *p)
{
	const struct worker_info *wi = compiler_info(p->d->compiler);
	const char *parts[] = {"torchloopd.probe", PROBE_SOURCE, wi->torch,
	                       wi->torch_git,      AOTI_OPTIONS, TORCHLOOP_VERSION,
	                       p->d->worker_sha,   p->d->isa};

	cache_key(parts, sizeof parts / sizeof parts[0], p->key);
}

/* Runs the loaded probe graph and checks it: pool. */
static int probe_run(struct probe *p)
{
	double c[2] = {1, 2}, x[4] = {10, 20, 30, 40};
	const double want_carry[2] = {41, 62}, want_y[4] = {11, 22, 41, 62};
	double *cin = aligned_alloc(64, 64), *xin = aligned_alloc(64, 64);
	struct engine_tensor in[2] = {{PROTO_DTYPE_F64, 1, {2}, cin, 16},
	                              {PROTO_DTYPE_F64, 2, {2, 2}, xin, 32}};
	struct engine_graph *g = NULL;
	struct engine_result res;
	char so[PATH_MAX];
	int rc = -1;

	memcpy(cin, c, sizeof c);
	memcpy(xin, x, sizeof x);
	cache_so_path(&p->d->cache, p->key, so, sizeof so);
	if (engine_load(so, 1, &g, &p->err) == 0 &&
	    engine_run(g, in, 2, in, in, NULL, &res, &p->err) == 0) {
		rc = res.n == 2 &&
		             memcmp(res.tensors[0].data, want_carry, sizeof want_carry) == 0 &&
		             memcmp(res.tensors[1].data, want_y, sizeof want_y) == 0
		         ? 0
		         : proto_fail(&p->err, PROTO_E_ENGINE_ERROR, NULL,
		                      "the probe graph computed wrong numbers");
		engine_result_free(&res);
	}
	engine_unload(g);
	free(cin);
	free(xin);
	return rc;
}

static void lookup_work(uv_work_t *w)
{
	struct probe *p = w->data;
	struct cache_meta meta;
	int q, found;

	if (p->res.so_path[0]) { /* after a compile: commit first */
		memset(&meta, 0, sizeof meta);
		meta.n_inputs = 4; /* carry, inputs and their two result buffers */
		meta.n_outputs = 2;
		snprintf(meta.strategy, sizeof meta.strategy, "unroll");
		meta.y_spec = p->res.y_spec;
		meta.y_spec_len = p->res.y_spec_len;
		p->rc = cache_commit(&p->d->cache, p->key, p->res.so_path, &meta, &p->err);
		cache_remove_job(p->job.output);
		cache_unlock(&p->d->cache, p->key, p->lock_fd);
		p->lock_fd = -1;
		if (p->rc == 0)
			p->rc = probe_run(p);
		return;
	}
	found = cache_lookup(&p->d->cache, p->key, &meta, &q, &p->err);
	if (found == 0) {
		int locked = cache_trylock(&p->d->cache, p->key, &p->lock_fd, &p->err);
		if (locked == 1) {
			p->lock_busy = true; /* another daemon compiles it: look again soon */
			return;
		}
		if (locked == 0)
			found = cache_lookup(&p->d->cache, p->key, &meta, &q, &p->err);
		else
			found = -1;
	}
	if (found < 0) {
		p->rc = -1;
	} else if (found == 0) {
		p->need_compile = true;
	} else {
		cache_meta_free(&meta);
		cache_unlock(&p->d->cache, p->key, p->lock_fd);
		p->lock_fd = -1;
		p->rc = probe_run(p);
	}
}

static void after(uv_work_t *w, int status);

static void compiled(struct compile_job *job, const struct compile_result *res,
                     const struct proto_err *err)
{
	struct probe *p = job->data;

	if (err != NULL) {
		cache_remove_job(job->output);
		p->rc = -1;
		p->err = *err;
		after(&p->work, 0);
		return;
	}
	p->res = *res;
	p->res.y_spec = malloc(res->y_spec_len);
	if (p->res.y_spec)
		memcpy(p->res.y_spec, res->y_spec, res->y_spec_len);
	uv_queue_work(p->d->loop, &p->work, lookup_work, after);
}

static void retry_closed(uv_handle_t *h)
{
	struct probe *p = h->data;

	p->done(p->d, p->rc == 0 ? NULL : &p->err);
	free(p->res.y_spec);
	free(p);
}

static void on_retry(uv_timer_t *t)
{
	struct probe *p = t->data;

	uv_queue_work(p->d->loop, &p->work, lookup_work, after);
}

static void after(uv_work_t *w, int status)
{
	struct probe *p = w->data;
	static const int64_t c_shape[] = {2}, x_shape[] = {2, 2};

	(void)status;
	if (p->rc == 0 && p->lock_busy) {
		p->lock_busy = false;
		if (p->lock_wait_started == 0)
			p->lock_wait_started = log_now();
		if (log_now() - p->lock_wait_started <= (double)p->d->cfg.compile_timeout) {
			uv_timer_start(&p->retry, on_retry, CACHE_LOCK_RETRY_MS, 0);
			return;
		}
		p->rc = proto_fail(&p->err, PROTO_E_COMPILE_TIMEOUT, NULL,
		                   "another process has held the probe's cache lock for over "
		                   "--compile-timeout=%lld s",
		                   p->d->cfg.compile_timeout);
	}
	if (p->rc == 0 && p->need_compile) {
		p->need_compile = false;
		p->carry = (struct tree_node){.kind = TREE_TENSOR,
		                              .tensor = {.dtype = PROTO_DTYPE_F64, .ndim = 1}};
		p->inputs = (struct tree_node){.kind = TREE_TENSOR,
		                               .tensor = {.dtype = PROTO_DTYPE_F64, .ndim = 2}};
		memcpy(p->carry.tensor.shape, c_shape, sizeof c_shape);
		memcpy(p->inputs.tensor.shape, x_shape, sizeof x_shape);
		p->job = (struct compile_job){.body_source = PROBE_SOURCE,
		                              .body_file = "<probe>",
		                              .entry = "body",
		                              .strategy = "unroll",
		                              .kind = "forward",
		                              .carry = &p->carry,
		                              .inputs = &p->inputs,
		                              .dtype = PROTO_DTYPE_F64,
		                              .steps = 2,
		                              .done = compiled,
		                              .data = p};
		cache_tmp_path(&p->d->cache, p->key, p->job.output, sizeof p->job.output);
		log_info("probe: compiling a test scan (first start with this cache and torch)");
		compiler_submit(p->d->compiler, &p->job);
		return;
	}
	if (p->lock_fd >= 0)
		cache_unlock(&p->d->cache, p->key, p->lock_fd);
	uv_close((uv_handle_t *)&p->retry, retry_closed);
}

void probe_start(struct daemon *d, void (*done)(struct daemon *d, const struct proto_err *err))
{
	struct probe *p = calloc(1, sizeof *p);

	if (p == NULL) {
		struct proto_err err;
		proto_fail(&err, PROTO_E_INTERNAL, NULL, "out of memory");
		done(d, &err);
		return;
	}
	p->d = d;
	p->done = done;
	p->lock_fd = -1;
	p->work.data = p;
	uv_timer_init(d->loop, &p->retry);
	p->retry.data = p;
	probe_key(p);
	uv_queue_work(d->loop, &p->work, lookup_work, after);
}
