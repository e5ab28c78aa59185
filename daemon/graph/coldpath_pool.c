/*
 * coldpath_pool.c - the cold path's work on pool threads (coldpath.c starts
 * it and continues after it): LOOKUP (the cache, the key's flock tried,
 * the artifact dlopened on a hit) and COMMIT (the worker's artifact
 * committed to the cache, then dlopened); the shapes a loaded graph must
 * take and give.
 *
 * Pool: each function owns its struct load_job and touches only the
 * specialization fields nobody else reads while the state is LOADING
 * (graph, y, n_in/out, expected).
 */
#include "graphs_internal.h"

#include "frame.h"
#include "log.h"
#include "shapes.h"
#include "signature.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

static void fill_expected(struct specialization *sp);
static void fill_expected_out(struct specialization *sp);

/* ---- pool: cache lookup, commit, load ---------------------------------- */

static size_t layout(const struct specialization *sp, bool results, struct engine_tensor *out);

static int check_arity(struct specialization *sp, size_t n_in, size_t n_out, struct proto_err *err)
{
	size_t want_in = layout(sp, false, NULL), want_out = layout(sp, true, NULL);

	if (n_in != want_in || n_out != want_out)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "artifact takes %zu inputs and gives %zu outputs; the signature "
		                  "needs %zu and %zu",
		                  n_in, n_out, want_in, want_out);
	return 0;
}

/* A saved kind's worker spec is the tuple (outputs' spec, saved's): y is
 * the first, saved the second (one 1-D tensor). */
static int split_saved(struct specialization *sp, struct proto_err *err)
{
	const struct tree_node *y = &sp->y;

	if (!spec_kinds[sp->kind].saved)
		return 0;
	if (y->kind != TREE_TUPLE || y->count != 2 || y->items[1].kind != TREE_TENSOR ||
	    y->items[1].tensor.ndim != 1)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "a %s graph's output spec is not (outputs, saved)",
		                  spec_kinds[sp->kind].name);
	sp->saved = y->items[1];
	sp->y = y->items[0];
	return 0;
}

/*
 * Parses the y spec and dlopens the artifact of j's key: pool.  An upgrade
 * loads into the job (the specialization is READY: its y spec, the same for
 * every lowering, is not written again) and must take what the quick tier's
 * graph took.
 */
static int load_artifact(struct load_job *j, const uint8_t *y, size_t y_len, struct proto_err *err)
{
	struct specialization *sp = j->sp;
	struct engine_graph **graph = j->purpose == LOAD_UPGRADE ? &j->graph : &sp->graph;
	msgpack_unpacked up;
	size_t off = 0, n_in, n_out;
	char so[PATH_MAX];
	int rc;

	if (j->purpose == LOAD_UPGRADE)
		goto open;
	msgpack_unpacked_init(&up);
	if (msgpack_unpack_next(&up, (const char *)y, y_len, &off) != MSGPACK_UNPACK_SUCCESS) {
		msgpack_unpacked_destroy(&up);
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL, "unreadable output spec");
	}
	rc = shapes_read(&up.data, sp->zone, sp->dtype, sp->batch, &sp->y, err);
	msgpack_unpacked_destroy(&up);
	if (rc != 0 || split_saved(sp, err) != 0)
		return -1;
open:
	if (cache_load_link(j->g->cache, j->key, so, sizeof so, err) != 0)
		return -1;
	/* one model per pool thread, plus the loop thread's inline runs */
	rc = engine_load(so, (size_t)j->g->cfg->threads + 1, graph, err);
	unlink(so);
	if (rc != 0)
		return -1;
	engine_pin(*graph, cache_pin(j->g->cache, j->key));
	n_in = engine_num_inputs(*graph);
	n_out = engine_num_outputs(*graph);
	if (j->purpose != LOAD_UPGRADE) {
		sp->n_in = n_in;
		sp->n_out = n_out;
	}
	return check_arity(sp, n_in, n_out, err);
}

/* After a load into the specialization (not an upgrade): pool. */
static void loaded(struct load_job *j)
{
	if (j->purpose == LOAD_UPGRADE)
		return;
	fill_expected(j->sp);
	fill_expected_out(j->sp);
	index_append(j->g, j->sp);
}

/* Shapes (and sizes: the engine lays the result buffers out by them) of one
 * tree's tensor leaves, with T prepended when stacked; out NULL: counts. */
static void expect_tree(const struct tree_node *t, int64_t stacked, struct engine_tensor *out,
                        size_t *n)
{
	size_t first = *n;

	if (out == NULL) {
		*n += tree_count_tensors(t);
		return;
	}
	signature_flatten(t, out, n);
	for (size_t i = first; i < *n; i++) {
		if (stacked > 0) {
			memmove(out[i].shape + 1, out[i].shape,
			        (PROTO_MAX_NDIM - 1) * sizeof out[i].shape[0]);
			out[i].shape[0] = stacked;
			out[i].ndim++;
		}
		out[i].nbytes = proto_dtype_size(out[i].dtype);
		for (uint32_t k = 0; k < out[i].ndim; k++)
			out[i].nbytes *= (uint64_t)out[i].shape[k];
		out[i].data = NULL;
	}
}

/* The graph's data inputs (results false) or results, in order, as
 * spec_kinds says (graphs.h); returns how many. */
static size_t layout(const struct specialization *sp, bool results, struct engine_tensor *out)
{
	const struct spec_kind_info *k = &spec_kinds[sp->kind];
	size_t n = 0;

	if (!results) {
		expect_tree(&sp->carry, 0, out, &n);
		expect_tree(&sp->inputs, 0, out, &n);
	} else if (k->results) {
		expect_tree(&sp->carry, 0, out, &n);
		expect_tree(&sp->y, sp->steps, out, &n);
	}
	if (k->saved && k->grad != results)
		expect_tree(&sp->saved, 0, out, &n);
	if (k->grad && !results) { /* cotangents: final carry, then stacked outputs */
		expect_tree(&sp->carry, 0, out, &n);
		expect_tree(&sp->y, sp->steps, out, &n);
	} else if (k->grad) {
		expect_tree(&sp->carry, 0, out, &n);
		expect_tree(&sp->inputs, 0, out, &n);
	}
	return n;
}

static void fill_expected(struct specialization *sp)
{
	sp->expected = calloc(sp->n_in ? sp->n_in : 1, sizeof *sp->expected);
	if (sp->expected != NULL)
		layout(sp, false, sp->expected);
}

/* What the graph must return (the engine checks its outputs against it). */
static void fill_expected_out(struct specialization *sp)
{
	sp->expected_out = calloc(sp->n_out ? sp->n_out : 1, sizeof *sp->expected_out);
	if (sp->expected_out != NULL)
		layout(sp, true, sp->expected_out);
}

/* Pool: LOOKUP.  Leaves hit, lock_busy, or neither (a miss), or rc -1. */
void lookup_work(uv_work_t *w)
{
	struct load_job *j = w->data;
	struct specialization *sp = j->sp;
	struct cache_meta meta;
	int found;

	j->hit = j->lock_busy = false;
	found = cache_lookup(j->g->cache, j->key, &meta, &j->quarantined, &j->err);
	if (found == 0 && j->purpose == LOAD_PREWARM)
		return; /* a miss: prewarming never compiles */
	if (found == 0 && sp->lock_fd < 0) {
		/* someone else may be compiling this key: never wait here, look again later */
		int locked = cache_trylock(j->g->cache, sp->key, &sp->lock_fd, &j->err);
		if (locked == 1) {
			j->lock_busy = true;
			return;
		}
		if (locked < 0) {
			j->rc = -1;
			return;
		}
		found = cache_lookup(j->g->cache, j->key, &meta, &j->quarantined, &j->err);
	}
	if (found < 0) {
		j->rc = -1;
		return;
	}
	if (found == 0)
		return; /* a miss */
	j->hit = true;
	j->compile_seconds = meta.compile_seconds;
	memcpy(j->lowered, meta.lowered, sizeof j->lowered);
	memcpy(j->note, meta.note, sizeof j->note);
	j->step_ops = meta.step_ops;
	j->rc = load_artifact(j, meta.y_spec, meta.y_spec_len, &j->err);
	cache_meta_free(&meta);
	if (j->rc == 0) {
		if (j->purpose != LOAD_PREWARM)
			loaded(j); /* compiled by an earlier daemon: remember it */
		else {
			fill_expected(sp);
			fill_expected_out(sp);
		}
	} else if (j->err.code == PROTO_E_ARTIFACT_CORRUPT || j->err.code == PROTO_E_ENGINE_ERROR) {
		/* an entry that does not load here never will: set aside, and not
		 * remembered, so the next request compiles it again */
		cache_quarantine(j->g->cache, j->key, j->err.message);
		j->err.flags |= PROTO_ERR_TRANSIENT;
	}
}

/* Pool: COMMIT the worker's artifact to the cache, then load it. */
/* A fetched blob verified (remote_blob_open) and its artifact written where
 * a compile's would be, j->res filled as a compile's reply: then COMMIT goes
 * on as for a compile. */
static int unseal(struct load_job *j)
{
	struct remote_meta m;
	const uint8_t *so;
	size_t so_len, secret_len;
	const uint8_t *secret = remote_secret(j->g->remote, &secret_len);
	FILE *f;

	j->refusal = remote_blob_open(secret, secret_len, j->key, j->blob, j->blob_len,
	                              remote_max_object(j->g->remote), &m, &so, &so_len, &j->err);
	if (j->refusal != BLOB_OK)
		return j->rc = -1;
	memset(&j->res, 0, sizeof j->res);
	cache_tmp_path(j->g->cache, j->key, j->res.so_path, sizeof j->res.so_path);
	memcpy(j->job.output, j->res.so_path, sizeof j->job.output);
	f = fopen(j->res.so_path, "wxe");
	if (f == NULL || fwrite(so, 1, so_len, f) != so_len || fclose(f) != 0) {
		if (f)
			fclose(f);
		return j->rc = proto_fail(&j->err, PROTO_E_INTERNAL, NULL, "cannot write %s",
		                          j->res.so_path);
	}
	j->res.y_spec = malloc(m.y_spec_len ? m.y_spec_len : 1);
	if (j->res.y_spec == NULL)
		return j->rc = proto_fail(&j->err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(j->res.y_spec, m.y_spec, m.y_spec_len);
	j->res.y_spec_len = m.y_spec_len;
	j->res.n_inputs = m.n_inputs;
	j->res.n_outputs = m.n_outputs;
	j->res.compile_seconds = m.compile_seconds;
	j->res.step_ops = m.step_ops;
	memcpy(j->res.lowered, m.lowered, sizeof j->res.lowered);
	memcpy(j->res.note, m.note, sizeof j->res.note);
	memcpy(j->strategy_done, m.strategy, sizeof j->strategy_done);
	return 0;
}

/* The committed artifact sealed for the remote tier (published on the loop);
 * nothing when it cannot be read or is over the tier's size cap. */
static void seal(struct load_job *j, const struct cache_meta *meta)
{
	struct remote_meta m = {
	    meta->n_inputs, meta->n_outputs, meta->step_ops, meta->compile_seconds, "", "", "",
	    meta->y_spec,   meta->y_spec_len};
	char path[PATH_MAX];
	size_t secret_len;
	const uint8_t *secret = remote_secret(j->g->remote, &secret_len);
	uint8_t *so = NULL;
	struct stat st;
	int fd;

	memcpy(m.strategy, meta->strategy, sizeof m.strategy);
	memcpy(m.lowered, meta->lowered, sizeof m.lowered);
	memcpy(m.note, meta->note, sizeof m.note);
	cache_so_path(j->g->cache, j->key, path, sizeof path);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) != 0 ||
	    (uint64_t)st.st_size > remote_max_object(j->g->remote) ||
	    (so = malloc((size_t)st.st_size + 1)) == NULL ||
	    read(fd, so, (size_t)st.st_size) != st.st_size) {
		j->publish_skipped = true;
	} else {
		j->publish = remote_blob_seal(secret, secret_len, j->key, &m, so,
		                              (size_t)st.st_size, &j->publish_len);
	}
	free(so);
	if (fd >= 0)
		close(fd);
}

void commit_work(uv_work_t *w)
{
	struct load_job *j = w->data;
	struct specialization *sp = j->sp;
	struct cache_meta meta = {0};

	if (j->blob != NULL && unseal(j) != 0)
		return;
	meta.n_inputs = j->res.n_inputs;
	meta.n_outputs = j->res.n_outputs;
	meta.compile_seconds = j->res.compile_seconds;
	snprintf(meta.strategy, sizeof meta.strategy, "%s",
	         j->blob ? j->strategy_done : j->job.strategy);
	memcpy(meta.lowered, j->res.lowered, sizeof meta.lowered);
	memcpy(meta.note, j->res.note, sizeof meta.note);
	memcpy(j->lowered, j->res.lowered, sizeof j->lowered);
	memcpy(j->note, j->res.note, sizeof j->note);
	meta.step_ops = j->step_ops = j->res.step_ops;
	meta.y_spec = j->res.y_spec;
	meta.y_spec_len = j->res.y_spec_len;
	j->rc = cache_commit(j->g->cache, j->key, j->res.so_path, &meta, &j->err);
	cache_remove_job(j->job.output);
	/* the lock is the unrolled graph's: a quick tier keeps it for its upgrade */
	if (!j->quick)
		spec_unlock(sp);
	if (j->rc == 0)
		j->rc = load_artifact(j, j->res.y_spec, j->res.y_spec_len, &j->err);
	if (j->rc == 0)
		loaded(j);
	if (j->rc == 0 && j->blob == NULL && j->g->remote != NULL)
		seal(j, &meta);
}
