/*
 * scanrun.c - what scan, grad and compile share: validating a request's
 * trees against DESIGN.md's contract (before any compile), running a ready
 * specialization on the thread pool, and writing the reply trees.
 *
 * A run job owns its engine result until the reply frame has been written
 * (the frame references the output buffers instead of copying them).  The
 * pool callback touches only the job; the completion callback is the only
 * place that touches the loop again, and it replies only if the connection
 * is still open (conn_send drops writes to a closed one).
 */
#include "scanrun.h"

#include "log.h"
#include "shm.h"
#include "spec.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct check_ctx {
	const struct adapter *a;
	struct scan_args *args;
	bool have_dtype;
	const char *first_path_root;
	char first_path[PROTO_PATH_MAX];
	bool have_steps;
	char steps_path[PROTO_PATH_MAX];
	bool batched, have_batch; /* dynamic = batch */
	char batch_path[PROTO_PATH_MAX];
	struct proto_err *err;
};

static int check_dtype(const struct tree_node *leaf, const char *path, struct check_ctx *c)
{
	if (!c->have_dtype) {
		c->have_dtype = true;
		c->args->dtype = leaf->tensor.dtype;
		tree_path_root(c->first_path, sizeof c->first_path, path);
		return 0;
	}
	if (leaf->tensor.dtype == c->args->dtype)
		return 0;
	return proto_fail(c->err, PROTO_E_DTYPE_MISMATCH, path,
	                  "%s is %s but %s is %s: every tensor of one request has one dtype", path,
	                  proto_dtype_name(leaf->tensor.dtype), c->first_path,
	                  proto_dtype_name(c->args->dtype));
}

static int check_elements(const struct tree_node *leaf, const char *path, struct check_ctx *c)
{
	if (leaf->tensor.numel <= (uint64_t)c->a->def.max_elements)
		return 0;
	return proto_fail(
	    c->err, PROTO_E_TOO_MANY_ELEMENTS, path, "%s has %llu elements, over max_elements=%lld",
	    path, (unsigned long long)leaf->tensor.numel, (long long)c->a->def.max_elements);
}

/* dynamic = batch: dimension `axis` of every leaf is the one batch size. */
static int check_batch(const struct tree_node *leaf, const char *path, uint32_t axis,
                       struct check_ctx *c)
{
	const struct tree_tensor *t = &leaf->tensor;

	if (!c->batched)
		return 0;
	if (t->ndim <= axis)
		return proto_fail(c->err, PROTO_E_BATCH_MISMATCH, path,
		                  "%s has %u dimension%s; with dynamic = batch every %s leaf's "
		                  "dimension %u is the batch size",
		                  path, t->ndim, t->ndim == 1 ? "" : "s", axis ? "input" : "carry",
		                  axis);
	if (!c->have_batch) {
		c->have_batch = true;
		c->args->batch = t->shape[axis];
		tree_path_root(c->batch_path, sizeof c->batch_path, path);
	} else if (t->shape[axis] != c->args->batch) {
		return proto_fail(c->err, PROTO_E_BATCH_MISMATCH, path,
		                  "%s has batch size %lld (dimension %u) but %s has %lld: with "
		                  "dynamic = batch all leaves share one batch size",
		                  path, (long long)t->shape[axis], axis, c->batch_path,
		                  (long long)c->args->batch);
	}
	if (t->shape[axis] < 1)
		return proto_fail(c->err, PROTO_E_BATCH_MISMATCH, path,
		                  "%s: batch size 0; dynamic = batch serves batch sizes from 1",
		                  path);
	return 0;
}

static int carry_leaf(const struct tree_node *leaf, const char *path, void *ctx)
{
	struct check_ctx *c = ctx;

	return check_dtype(leaf, path, c) || check_batch(leaf, path, 0, c) ||
	               check_elements(leaf, path, c)
	           ? -1
	           : 0;
}

static int input_leaf(const struct tree_node *leaf, const char *path, void *ctx)
{
	struct check_ctx *c = ctx;
	const struct tree_tensor *t = &leaf->tensor;

	if (check_dtype(leaf, path, c) != 0)
		return -1;
	if (t->ndim == 0)
		return proto_fail(c->err, PROTO_E_BAD_RANK, path,
		                  "%s is 0-d; input leaves need a leading scan axis (ndim >= 1)",
		                  path);
	if (!c->have_steps) {
		c->have_steps = true;
		c->args->steps = t->shape[0];
		tree_path_root(c->steps_path, sizeof c->steps_path, path);
	} else if (t->shape[0] != c->args->steps) {
		return proto_fail(
		    c->err, PROTO_E_LENGTH_MISMATCH, path,
		    "%s has leading length %lld but %s has %lld: input leaves share one T", path,
		    (long long)t->shape[0], c->steps_path, (long long)c->args->steps);
	}
	if (t->shape[0] < 1 || t->shape[0] > c->a->def.max_steps)
		return proto_fail(c->err, PROTO_E_TOO_MANY_STEPS, path,
		                  "%s: T=%lld is outside [1, max_steps=%lld]", path,
		                  (long long)t->shape[0], (long long)c->a->def.max_steps);
	return check_batch(leaf, path, 1, c) || check_elements(leaf, path, c) ? -1 : 0;
}

int scan_validate(const struct adapter *a, const struct tree_node *carry,
                  const struct tree_node *inputs, struct scan_args *args, struct proto_err *err)
{
	struct check_ctx c = {.a = a, .args = args, .batched = adapter_batched(a), .err = err};

	args->carry = carry;
	args->batch = 0;
	args->inputs = inputs;
	if (tree_visit(carry, "carry", 0, carry_leaf, &c) != 0 ||
	    tree_visit(inputs, "inputs", 0, input_leaf, &c) != 0)
		return -1;
	if (!c.have_steps)
		return proto_fail(
		    err, PROTO_E_NO_INPUTS, "inputs",
		    "inputs has no tensor leaf: the scan length T comes from the inputs");
	return 0;
}

/* ---- running ----------------------------------------------------------- */

struct run_job {
	uv_work_t work;
	struct request *req;
	struct specialization *sp;
	struct engine_tensor *in;
	size_t n_in;
	/* the graph's signature: the specialization's, or for a symbolic batch
	 * its copy at this request's batch size (owned) */
	const struct engine_tensor *expected, *expected_out;
	struct engine_tensor *bound;
	void *zeros;
	struct engine_result *res;
	struct proto_err err;
	int rc;
	double t0, run_us;
	/* outputs written into the request's shared-memory area (shm.c) */
	uint64_t *placed, out_needed;
	size_t next_placed;
	int team, team_trial; /* OpenMP team of this run, and whether it is a trial */
};

/*
 * OpenMP team per run.  Whether a graph gains from more threads depends on
 * the graph: a bandwidth-bound sum over 8 MiB runs faster on every core, a
 * small RNN whose dozens of tiny kernels each open a parallel region runs
 * 14x slower on two (each region wakes a sleeping thread).  So each
 * specialization tries both on its first runs -- its share of the cores
 * (cores / threads) and all of them -- and keeps the faster (choose_team).
 * Whatever it chose, concurrent runs never take more than cores / runs.
 * omp_set_num_threads sets the calling thread's own value, so it is set
 * before every run; libgomp keeps its thread pool across sizes.
 */
#define TEAM_TRIES 8
static atomic_int runs_active;
static pthread_once_t omp_once = PTHREAD_ONCE_INIT;
static void (*omp_set)(int);

static void find_omp(void)
{
	*(void **)&omp_set = dlsym(RTLD_DEFAULT, "omp_set_num_threads");
}

static void size_openmp(const struct config *cfg, int want, int running)
{
	int n = running < cfg->threads ? running : (int)cfg->threads;
	int cap = cfg->cores / (n > 0 ? n : 1);
	int team = want < cap ? want : cap;

	pthread_once(&omp_once, find_omp);
	if (omp_set)
		omp_set(team > 1 ? team : 1);
}

/* Loop thread, when a run is started: the team it tries or the one chosen. */
static int choose_team(struct specialization *sp, const struct config *cfg, int *trial)
{
	*trial = -1;
	if (sp->omp_team > 0 || cfg->cores <= cfg->omp_threads)
		return sp->omp_team > 0 ? sp->omp_team : cfg->omp_threads;
	*trial = (int)(sp->omp_tries++ % 2);
	return *trial ? cfg->cores : cfg->omp_threads;
}

/* Loop thread, when a trial run is done: after TEAM_TRIES, keep the faster. */
static void team_result(struct specialization *sp, const struct config *cfg, int trial, double us)
{
	if (trial < 0 || sp->omp_team > 0)
		return;
	if (sp->omp_best_us[trial] == 0 || us < sp->omp_best_us[trial])
		sp->omp_best_us[trial] = us;
	if (sp->omp_tries >= TEAM_TRIES && sp->omp_best_us[0] > 0 && sp->omp_best_us[1] > 0)
		sp->omp_team =
		    sp->omp_best_us[1] < sp->omp_best_us[0] ? cfg->cores : cfg->omp_threads;
}

static void run_work(uv_work_t *w)
{
	struct run_job *j = w->data;
	double t0 = now_seconds();

	size_openmp(&j->req->d->cfg, j->team, atomic_fetch_add(&runs_active, 1) + 1);
	uint8_t *base = NULL;

	/* results go straight into the client's area when they all fit */
	if (j->req->out.set) {
		j->out_needed = engine_out_layout(j->expected_out, j->sp->n_out, NULL);
		if (j->out_needed <= j->req->out.size) {
			j->placed = malloc((j->sp->n_out ? j->sp->n_out : 1) * sizeof *j->placed);
			if (j->placed != NULL) {
				engine_out_layout(j->expected_out, j->sp->n_out, j->placed);
				base = j->req->out.base;
			}
		}
	}
	j->rc = engine_run(j->sp->graph, j->in, j->n_in, j->expected, j->expected_out, base, j->res,
	                   &j->err);
	atomic_fetch_sub(&runs_active, 1);
	j->run_us = (now_seconds() - t0) * 1e6;
}

/* Result tensors come to the encoder in the engine's order: when the graph
 * wrote them into the client's area, those of at least min_bytes go back as
 * references to where they are (smaller ones inline, as the client asked). */
static int place_next(const struct tree_tensor *t, uint64_t *offset, void *arg)
{
	struct run_job *j = arg;
	size_t k = j->next_placed++;

	if (j->placed == NULL || k >= j->res->n || t->nbytes == 0 ||
	    t->nbytes < j->req->out.min_bytes)
		return 0;
	*offset = j->req->out.offset + j->placed[k];
	return 1;
}

static void free_result(void *arg)
{
	struct engine_result *res = arg;

	engine_result_free(res);
	free(res);
}

/* Writes result trees of the spec's shapes from the flat outputs. */
static int put_tree(struct outmsg *out, struct run_job *j, const char *key,
                    const struct tree_node *spec, size_t *pos)
{
	struct tree_node node;

	if (spec_fill(spec, j->res->tensors, j->res->n, pos, j->req->msg.up.zone, &node) != 0)
		return -1;
	writer_str(&out->w, key);
	tree_encode_placed(&out->w, &node, place_next, j);
	return 0;
}

static void after_run(uv_work_t *w, int status)
{
	struct run_job *j = w->data;
	struct request *req = j->req;
	struct specialization *sp = j->sp;
	struct outmsg *out;
	size_t pos = 0;

	(void)status;
	if (j->rc == 0) {
		team_result(sp, &req->d->cfg, j->team_trial, j->run_us);
		adapter_record_latency(sp->adapter, j->run_us);
		sp->run_ema_us =
		    sp->runs++ == 0 ? j->run_us : 0.8 * sp->run_ema_us + 0.2 * j->run_us;
		sp->adapter->stats.runs++;
		out = request_begin_result(req, (sp->grad ? 4 : 2) + req->out.set);
		if (out != NULL && req->out.set)
			writer_key_u64(&out->w, "out_needed", j->out_needed);
		if (out == NULL || put_tree(out, j, "carry", &sp->carry, &pos) ||
		    put_tree(out, j, "outputs", &sp->y, &pos) ||
		    (sp->grad && (put_tree(out, j, "grad_carry", &sp->carry, &pos) ||
		                  put_tree(out, j, "grad_inputs", &sp->inputs, &pos)))) {
			if (out)
				outmsg_free(out);
			proto_fail(&j->err, PROTO_E_ENGINE_ERROR, NULL,
			           "the graph's outputs do not match its signature");
			j->rc = -1;
		} else {
			out->cleanup = free_result;
			out->cleanup_arg = j->res;
			j->res = NULL;
			request_reply(req, out);
		}
	}
	if (j->rc != 0 && j->err.code == PROTO_E_ARTIFACT_CORRUPT && sp->state == SPEC_READY)
		specs_invalidate(req->d, sp, j->err.message);
	if (j->rc != 0)
		request_fail(req, &j->err);
	if (j->res)
		free_result(j->res);
	free(j->placed);
	free(j->in);
	free(j->bound);
	free(j->zeros);
	spec_unref(sp);
	free(j);
}

/* A symbolic-batch graph's signature at the request's batch size. */
static int bind_batch(struct run_job *j, int64_t batch, struct proto_err *err)
{
	const struct specialization *sp = j->sp;

	if (specs_check_outputs(sp, batch, err) != 0)
		return -1;
	j->bound = malloc((sp->n_in + sp->n_out + 1) * sizeof *j->bound);
	if (j->bound == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(j->bound, sp->expected, sp->n_in * sizeof *j->bound);
	memcpy(j->bound + sp->n_in, sp->expected_out, sp->n_out * sizeof *j->bound);
	spec_bind(j->bound, sp->n_in + sp->n_out, batch);
	j->expected = j->bound;
	j->expected_out = j->bound + sp->n_in;
	return 0;
}

struct run_job *run_job_new(struct request *req, struct specialization *sp, struct proto_err *err)
{
	struct run_job *j = calloc(1, sizeof *j);

	if (j == NULL) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		return NULL;
	}
	j->req = req;
	j->sp = sp;
	j->expected = sp->expected;
	j->expected_out = sp->expected_out;
	j->in = calloc(sp->n_in ? sp->n_in : 1, sizeof *j->in);
	j->res = calloc(1, sizeof *j->res);
	if (j->in == NULL || j->res == NULL)
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	if (j->in == NULL || j->res == NULL || (sp->batch && bind_batch(j, req->batch, err) != 0)) {
		free(j->in);
		free(j->res);
		free(j->bound);
		free(j);
		return NULL;
	}
	spec_ref(sp);
	return j;
}

void run_job_add(struct run_job *j, const struct tree_node *tree)
{
	spec_flatten(tree, j->in, &j->n_in);
}

/*
 * A graph that has run a few times and whose engine time is at most
 * --inline-run-us runs right here on the loop thread: for µs-scale graphs the
 * two cross-thread wake-ups of the pool (loop -> pool, pool -> loop) cost
 * several times the run itself.  Longer graphs, and every graph's first runs
 * (which measure it), go to the pool so the loop never stalls for long.
 */
#define INLINE_AFTER_RUNS 3

void run_job_start(struct run_job *j)
{
	const struct specialization *sp = j->sp;
	const struct config *cfg = &j->req->d->cfg;

	j->work.data = j;
	j->team = choose_team(j->sp, cfg, &j->team_trial);
	if (cfg->inline_run_us > 0 && sp->runs >= INLINE_AFTER_RUNS &&
	    sp->run_ema_us <= (double)cfg->inline_run_us) {
		j->req->d->stats.inline_runs++;
		run_work(&j->work);
		after_run(&j->work, 0);
		return;
	}
	uv_queue_work(j->req->d->loop, &j->work, run_work, after_run);
}

void run_job_abort(struct run_job *j, const struct proto_err *err)
{
	request_fail(j->req, err);
	free(j->in);
	free(j->bound);
	free(j->zeros);
	free(j->res);
	spec_unref(j->sp);
	free(j);
}

struct engine_tensor *run_job_slots(struct run_job *j, size_t *n)
{
	*n = j->n_in;
	return j->in;
}

void run_job_set_count(struct run_job *j, size_t n)
{
	j->n_in = n;
}

void run_job_own(struct run_job *j, void *zeros)
{
	free(j->zeros);
	j->zeros = zeros;
}

/* ---- decoding the request ---------------------------------------------- */

int scan_decode(struct request *req, struct adapter **a, struct tree_node *carry,
                struct tree_node *inputs, struct proto_err *err)
{
	const char *name;
	uint32_t len;
	int rc = msg_get_str(&req->msg.up.data, "adapter", &name, &len, err);

	if (rc < 0)
		return -1;
	if (rc > 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "adapter",
		                  "request has no adapter");
	*a = registry_find(req->d, name, len);
	if (*a == NULL)
		return proto_fail(err, PROTO_E_NOT_FOUND, "adapter", "no adapter named '%.*s'",
		                  (int)len, name);
	adapter_ref(*a);
	req->adapter = *a;
	(*a)->stats.requests++;
	if (msg_get_tree(&req->msg, "carry", true, carry, err) != 0 ||
	    msg_get_tree(&req->msg, "inputs", true, inputs, err) != 0)
		return -1;
	return 0;
}
