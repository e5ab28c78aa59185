/*
 * run.c - runs of READY specializations (the graph layer).  Loop thread,
 * except run_work, which runs on the pool (or inline, see run_submit) and
 * touches only its job; the completion callback publishes what the run
 * measured (OpenMP team trials, latency, the run-time average) on the loop.
 */
#include "graphs.h"

#include "log.h"
#include "signature.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

struct run_job {
	uv_work_t work;
	struct runner_item item; /* a run with an OpenMP team: on the runner */
	struct graphs *g;
	struct specialization *sp;
	/* sp's graph when the run was made: a quick tier's upgrade may replace
	 * sp->graph on the loop meanwhile (the old one is kept, see graphs.h) */
	struct engine_graph *graph;
	int arm; /* the upgrade's trial: which graph this is (upgrade_run_graph) */
	struct engine_tensor *in;
	size_t n_in;
	/* the graph's signature: the specialization's, or for a symbolic batch
	 * its copy at this run's batch size (owned) */
	const struct engine_tensor *expected, *expected_out;
	struct engine_tensor *bound;
	void *zeros;
	struct engine_result *res;
	struct proto_err err;
	int rc;
	double run_us;
	/* results written into the caller's area */
	struct run_area area;
	uint64_t *placed, out_needed;
	int team, team_trial; /* OpenMP team of this run, and whether it is a trial */
	/* strategy = chunk: the graph runs `chunks` times; chunk_out is its own
	 * output signature (one chunk), expected_out then the whole scan's */
	int64_t chunks;
	size_t n_carry;
	const struct engine_tensor *chunk_out;
	struct engine_tensor *whole_out;
	run_done_fn *done;
	void *done_arg;
};

static size_t tensor_leaves(const struct tree_node *n)
{
	size_t c = n->kind == TREE_TENSOR;

	for (uint32_t i = 0; i < n->count; i++)
		c += tensor_leaves(&n->items[i]);
	return c;
}

/*
 * OpenMP team per run: team.h chooses it; whatever it chose, concurrent runs
 * never take more than cores / runs.  omp_set_num_threads sets the calling
 * thread's own value, so it is set before every run; libgomp keeps its thread
 * pool across sizes.
 */
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

/* Loop thread, when a run is done: what it measured for its team. */
static void team_result(struct run_job *j)
{
	const struct config *cfg = j->g->cfg;
	struct specialization *sp = j->sp;

	if (!team_measured(&sp->team, cfg->cores, cfg->omp_threads, j->team, j->team_trial,
	                   j->run_us, uv_now(j->g->loop)))
		return;
	j->g->contended_runs++;
	log_debug(
	    "%s: a run of %d threads took %.0f us (one core's share: %.0f): %u ms on the share",
	    sp->signature, j->team, j->run_us, sp->team.best_us[0], (unsigned)sp->team.backoff_ms);
}

/*
 * Chunk c's tensors, for run_chunks: its inputs view rows [cK, (c+1)K) of
 * the request's, its carry the previous chunk's (out, as left by that chunk;
 * the request's for the first); its stacked outputs go to their rows of the
 * results, its carry to p (the results' carry for the last chunk).
 */
static void bind_chunk(const struct run_job *j, int64_t c, uint8_t *p, struct engine_tensor *in,
                       struct engine_tensor *out)
{
	const struct engine_tensor *whole = j->res->tensors;
	size_t nc = j->n_carry;

	for (size_t k = 0; k < j->n_in; k++) {
		uint64_t rows = engine_tensor_bytes(&j->expected[k]);
		in[k] = j->expected[k];
		in[k].nbytes = rows;
		if (k < nc)
			in[k].data = c == 0 ? j->in[k].data : out[k].data;
		else
			in[k].data = (uint8_t *)j->in[k].data + (uint64_t)c * rows;
	}
	for (size_t k = 0; k < j->sp->n_out; k++) {
		uint64_t rows = engine_tensor_bytes(&j->chunk_out[k]);
		out[k] = j->chunk_out[k];
		if (k >= nc) {
			out[k].data = (uint8_t *)whole[k].data + (uint64_t)c * rows;
		} else if (c == j->chunks - 1) {
			out[k].data = whole[k].data;
		} else {
			out[k].data = p;
			p += (rows + 63) & ~(uint64_t)63;
		}
	}
}

/*
 * strategy = chunk, on the pool: the graph of K steps runs T / K times.  Chunk
 * c reads rows [cK, (c+1)K) of every input leaf in place (slices along the
 * leading axis of a C-contiguous tensor are contiguous), writes its stacked
 * outputs straight into the same rows of the whole scan's output buffers,
 * and hands its carry to the next chunk through two scratch buffers used in
 * turn; the last chunk writes the final carry where the result goes.
 */
static int run_chunks(struct run_job *j, uint8_t *base)
{
	const struct specialization *sp = j->sp;
	size_t n_in = j->n_in, n_out = sp->n_out, nc = j->n_carry;
	struct engine_result *res = j->res;
	struct engine_tensor *in = NULL, *out = NULL;
	uint64_t *off = NULL, total, carry_bytes = 0;
	uint8_t *scratch = NULL;
	int rc = -1;

	res->n = n_out;
	res->tensors = calloc(n_out ? n_out : 1, sizeof *res->tensors);
	res->handles = calloc(n_out ? n_out : 1, sizeof *res->handles);
	off = calloc(n_out ? n_out : 1, sizeof *off);
	in = calloc(n_in ? n_in : 1, sizeof *in);
	out = calloc(n_out ? n_out : 1, sizeof *out);
	for (size_t k = 0; k < nc; k++)
		carry_bytes += (engine_tensor_bytes(&j->chunk_out[k]) + 63) & ~(uint64_t)63;
	scratch = aligned_alloc(PROTO_TENSOR_ALIGN, 2 * carry_bytes + PROTO_TENSOR_ALIGN);
	if (!res->tensors || !res->handles || !off || !in || !out || !scratch) {
		proto_fail(&j->err, PROTO_E_INTERNAL, NULL, "out of memory");
		goto done;
	}
	total = engine_out_layout(j->expected_out, n_out, off);
	if (base == NULL) {
		res->block =
		    aligned_alloc(PROTO_TENSOR_ALIGN, (total + PROTO_TENSOR_ALIGN) & ~(uint64_t)63);
		if (res->block == NULL) {
			proto_fail(&j->err, PROTO_E_INTERNAL, NULL,
			           "out of memory for the results");
			goto done;
		}
		base = res->block;
	}
	for (size_t k = 0; k < n_out; k++) {
		res->tensors[k] = j->expected_out[k];
		res->tensors[k].nbytes = engine_tensor_bytes(&j->expected_out[k]);
		res->tensors[k].data = base + off[k];
	}
	for (int64_t c = 0; c < j->chunks; c++) {
		/* this chunk's carry: the scratch half the previous one did not write */
		bind_chunk(j, c, scratch + (size_t)(c % 2) * carry_bytes, in, out);
		if (engine_run_into(j->graph, in, n_in, j->expected, out, n_out, &j->err) != 0)
			goto done;
	}
	rc = 0;
done:
	free(off);
	free(in);
	free(out);
	free(scratch);
	return rc;
}

static void run_work(uv_work_t *w)
{
	struct run_job *j = w->data;
	double t0 = log_now();

	uint8_t *base = NULL;

	size_openmp(j->g->cfg, j->team, atomic_fetch_add(&runs_active, 1) + 1);
	/* results go straight into the caller's area when they all fit */
	if (j->area.base) {
		j->out_needed = engine_out_layout(j->expected_out, j->sp->n_out, NULL);
		if (j->out_needed <= j->area.size) {
			j->placed = malloc((j->sp->n_out ? j->sp->n_out : 1) * sizeof *j->placed);
			if (j->placed != NULL) {
				engine_out_layout(j->expected_out, j->sp->n_out, j->placed);
				base = j->area.base;
			}
		}
	}
	if (j->chunks > 1)
		j->rc = run_chunks(j, base);
	else
		j->rc = engine_run(j->graph, j->in, j->n_in, j->expected, j->expected_out, base,
		                   j->res, &j->err);
	atomic_fetch_sub(&runs_active, 1);
	j->run_us = (log_now() - t0) * 1e6;
}

void run_result_free(void *arg)
{
	struct engine_result *res = arg;

	if (res) {
		engine_result_free(res);
		free(res);
	}
}

void run_free(struct run_job *j)
{
	run_result_free(j->res);
	free(j->placed);
	free(j->in);
	free(j->bound);
	free(j->whole_out);
	free(j->zeros);
	graphs_unref(j->sp);
	free(j);
}

static void after_run(uv_work_t *w, int status)
{
	struct run_job *j = w->data;
	struct specialization *sp = j->sp;

	(void)status;
	if (j->rc == 0) {
		team_result(j);
		upgrade_run_measured(sp, j->arm, j->team_trial, j->run_us);
		adapter_record_latency(sp->adapter, j->run_us);
		sp->run_ema_us =
		    sp->runs++ == 0 ? j->run_us : 0.8 * sp->run_ema_us + 0.2 * j->run_us;
		sp->adapter->stats.runs++;
	} else if (j->err.code == PROTO_E_ARTIFACT_CORRUPT && sp->state == SPEC_READY) {
		graphs_invalidate(j->g, sp, j->err.message);
	}
	j->done(j, j->done_arg);
	run_free(j);
}

/* A symbolic-batch graph's signature at the run's batch size. */
static int bind_batch(struct run_job *j, int64_t batch, struct proto_err *err)
{
	const struct specialization *sp = j->sp;

	if (graphs_check_outputs(sp, batch, err) != 0)
		return -1;
	j->bound = malloc((sp->n_in + sp->n_out + 1) * sizeof *j->bound);
	if (j->bound == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(j->bound, sp->expected, sp->n_in * sizeof *j->bound);
	memcpy(j->bound + sp->n_in, sp->expected_out, sp->n_out * sizeof *j->bound);
	signature_bind(j->bound, sp->n_in + sp->n_out, batch);
	j->expected = j->bound;
	j->expected_out = j->bound + sp->n_in;
	return 0;
}

struct run_job *run_new(struct graphs *g, struct specialization *sp, int64_t batch,
                        const struct run_area *area, struct proto_err *err)
{
	struct run_job *j = calloc(1, sizeof *j);

	if (j == NULL) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		return NULL;
	}
	j->g = g;
	j->sp = sp;
	j->graph = upgrade_run_graph(sp, &j->arm);
	graphs_ref(sp);
	if (area)
		j->area = *area;
	j->expected = sp->expected;
	j->expected_out = sp->expected_out;
	j->in = calloc(sp->n_in ? sp->n_in : 1, sizeof *j->in);
	j->res = calloc(1, sizeof *j->res);
	if (j->in == NULL || j->res == NULL) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		run_free(j);
		return NULL;
	}
	if (sp->batch && bind_batch(j, batch, err) != 0) {
		run_free(j);
		return NULL;
	}
	return j;
}

int run_set_chunks(struct run_job *j, int64_t chunks, struct proto_err *err)
{
	const struct specialization *sp = j->sp;
	int64_t max = sp->adapter->def.max_elements;

	if (chunks <= 1)
		return 0;
	j->n_carry = tensor_leaves(&sp->carry);
	j->whole_out = malloc((sp->n_out ? sp->n_out : 1) * sizeof *j->whole_out);
	if (j->whole_out == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(j->whole_out, j->expected_out, sp->n_out * sizeof *j->whole_out);
	for (size_t k = j->n_carry; k < sp->n_out; k++) {
		struct engine_tensor *t = &j->whole_out[k];
		uint64_t numel = 1;
		t->shape[0] *= chunks;
		for (uint32_t i = 0; i < t->ndim; i++)
			numel *= (uint64_t)t->shape[i];
		if (numel > (uint64_t)max)
			return proto_fail(
			    err, PROTO_E_TOO_MANY_ELEMENTS, "outputs",
			    "outputs: a stacked output of %lld steps holds %llu elements, "
			    "over max_elements=%lld",
			    (long long)t->shape[0], (unsigned long long)numel, (long long)max);
	}
	j->chunks = chunks;
	j->chunk_out = j->expected_out;
	j->expected_out = j->whole_out;
	return 0;
}

void run_add(struct run_job *j, const struct tree_node *tree)
{
	signature_flatten(tree, j->in, &j->n_in);
}

#define JOB_OF(it) ((struct run_job *)((char *)(it)-offsetof(struct run_job, item)))

static void run_item_work(struct runner_item *it)
{
	run_work(&JOB_OF(it)->work);
}

static void run_item_done(struct runner_item *it)
{
	after_run(&JOB_OF(it)->work, 0);
}

/*
 * A graph that has run a few times and whose engine time is at most
 * --inline-run-us runs right here on the loop thread, with one OpenMP thread:
 * for µs-scale graphs the two cross-thread wake-ups of the pool (loop -> pool,
 * pool -> loop) cost several times the run itself.  Longer graphs, and every
 * graph's first runs (which measure it), leave the loop so it never stalls
 * for long: runs with an OpenMP team go to the one runner thread (runner.h:
 * a single master keeps libgomp's workers spinning), runs of one thread to the
 * pool, where several may run at once.
 */
#define INLINE_AFTER_RUNS 3

void run_submit(struct run_job *j, run_done_fn *done, void *arg)
{
	const struct specialization *sp = j->sp;
	const struct config *cfg = j->g->cfg;

	j->done = done;
	j->done_arg = arg;
	j->work.data = j;
	if (cfg->inline_run_us > 0 && sp->runs >= INLINE_AFTER_RUNS &&
	    sp->run_ema_us <= (double)cfg->inline_run_us) {
		j->team = 1;
		j->team_trial = -1;
		j->g->inline_runs++;
		run_work(&j->work);
		after_run(&j->work, 0);
		return;
	}
	j->team = team_choose(&j->sp->team, cfg->cores, cfg->omp_threads, uv_now(j->g->loop),
	                      &j->team_trial);
	if (j->team > 1 && j->g->runner.started) {
		j->g->runner_runs++;
		j->item.work = run_item_work;
		j->item.done = run_item_done;
		runner_submit(&j->g->runner, &j->item);
		return;
	}
	uv_queue_work(j->g->loop, &j->work, run_work, after_run);
}

struct engine_tensor *run_slots(struct run_job *j, size_t *n)
{
	*n = j->n_in;
	return j->in;
}

void run_set_count(struct run_job *j, size_t n)
{
	j->n_in = n;
}

void run_own(struct run_job *j, void *zeros)
{
	free(j->zeros);
	j->zeros = zeros;
}

const struct proto_err *run_error(const struct run_job *j)
{
	return j->rc == 0 ? NULL : &j->err;
}

struct specialization *run_spec(const struct run_job *j)
{
	return j->sp;
}

const struct engine_result *run_result(const struct run_job *j)
{
	return j->res;
}

const uint64_t *run_placed(const struct run_job *j, uint64_t *needed)
{
	*needed = j->out_needed;
	return j->placed;
}

struct engine_result *run_take_result(struct run_job *j)
{
	struct engine_result *res = j->res;

	j->res = NULL;
	return res;
}
