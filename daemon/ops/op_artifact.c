/*
 * op_artifact.c - artifact: a scan specialization's compiled graph, for the
 * client to run in its own process (the Python package's run="local",
 * docs/python.md "Local runs").  The request is a scan's (adapter, carry,
 * inputs, params: the same decoding, bounds, budget and identity, and a
 * compile when the specialization is new, as a scan would); the reply holds
 * the artifact's bytes and its calling convention instead of results:
 *
 *   key        the graph's cache key: its generation (an upgrade that takes
 *              over serves another key; `describe` shows the current one)
 *   kind       scan, or (request `kind`, with `wrt`) one of the saved pair,
 *              scan_save or grad_saved: graphs.h spec_kind_info lays their
 *              inputs and results out; saved_key: the pair's
 *   n_inputs   data inputs: the carry's tensor leaves (with params, the pair
 *              (carry, params)), then the inputs' (then saved and the
 *              cotangents for grad_saved); one result buffer per output
 *              follows them; `inputs`: their shapes
 *   outputs    per output, its shape (the request's dtype): the final
 *              carry's leaves (n_carry_out of them, params included), then
 *              the stacked outputs'
 *   y          the stacked outputs' spec tree (the worker's form)
 *   so         the shared object's bytes
 *
 * Only an admin or the uid that registered a captured graph may fetch it
 * (may_fetch).  The bytes travel in the reply (about 1.6 MB for a small step), read from
 * the cache once per specialization and process: no descriptor passing,
 * so the package's C and Python readers need nothing new.  A symbolic batch
 * or strategy chunk (runs of a shorter graph) is INVALID_ARGUMENT (the daemon
 * runs those).
 */
#include "op_scan.h"

#include "cache.h"
#include "shapes.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The largest artifact handed out (constants are packaged in the .so). */
#define ARTIFACT_MAX_BYTES (256u << 20)

/* The artifact of key, read whole: malloc'ed bytes (*len), or NULL with err. */
static uint8_t *read_artifact(const struct cache *cache, const char *key, size_t *len,
                              struct proto_err *err)
{
	char path[PATH_MAX];
	struct stat st;
	uint8_t *buf = NULL;
	size_t got = 0;
	int fd;

	if (cache_load_link(cache, key, path, sizeof path, err) != 0)
		return NULL;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	unlink(path);
	if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0 ||
	    (uint64_t)st.st_size > ARTIFACT_MAX_BYTES ||
	    (buf = malloc((size_t)st.st_size)) == NULL) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "artifact %s: cannot read it (%s)", key,
		           fd < 0 ? strerror(errno) : "size");
		goto out;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
		if (n <= 0) {
			proto_fail(err, PROTO_E_INTERNAL, NULL, "artifact %s: short read", key);
			free(buf);
			buf = NULL;
			goto out;
		}
		got += (size_t)n;
	}
	*len = got;
out:
	if (fd >= 0)
		close(fd);
	return buf;
}

/* The shapes of n tensors of a signature. */
static void write_shapes(struct writer *w, const struct engine_tensor *t, size_t n)
{
	msgpack_pack_array(&w->pk, (uint32_t)n);
	for (size_t i = 0; i < n; i++) {
		msgpack_pack_array(&w->pk, t[i].ndim);
		for (uint32_t k = 0; k < t[i].ndim; k++)
			msgpack_pack_int64(&w->pk, t[i].shape[k]);
	}
}

static void artifact_ready(struct request *req, struct specialization *sp)
{
	struct proto_err err;
	struct outmsg *out;
	size_t len = 0;
	uint8_t *so = read_artifact(&req->conn->d->cache, sp->graph_key, &len, &err);

	if (so == NULL) {
		request_fail(req, &err);
		return;
	}
	out = request_begin_result(req, 10);
	if (out == NULL) {
		free(so);
		return;
	}
	writer_key_str(&out->w, "key", sp->graph_key);
	writer_key_str(&out->w, "signature", sp->signature);
	writer_key_str(&out->w, "kind", spec_kinds[sp->kind].name);
	writer_key_str(&out->w, "saved_key", sp->pair_key);
	writer_key_u64(&out->w, "n_inputs", sp->n_in);
	writer_key_u64(&out->w, "n_carry_out", tree_count_tensors(&sp->carry));
	writer_str(&out->w, "inputs");
	write_shapes(&out->w, sp->expected, sp->n_in);
	writer_str(&out->w, "outputs");
	write_shapes(&out->w, sp->expected_out, sp->n_out);
	writer_str(&out->w, "y");
	shapes_write(&out->w, &sp->y);
	writer_str(&out->w, "so");
	msgpack_pack_bin(&out->w.pk, len);
	writer_ref(&out->w, so, len);
	out->cleanup = free; /* the bytes outlive the write */
	out->cleanup_arg = so;
	request_reply(req, out);
}

static int local_kind(const struct adapter *a, struct proto_err *err)
{
	if (adapter_batched(a) || strcmp(a->def.strategy, "chunk") == 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "adapter",
		                  "adapter %s is %s: its scans run in the daemon only", a->def.name,
		                  adapter_batched(a) ? "dynamic = batch" : "strategy chunk");
	return 0;
}

/*
 * The artifact holds what its body baked in (a captured graph's constants,
 * a source body's): another user may scan an adapter it can name, but not
 * read those.  So an admin, or the uid that registered the graph.
 */
static int may_fetch(struct request *req, const struct adapter *a, struct proto_err *err)
{
	if ((a->def.graph && a->def.owner == req->conn->uid) || request_is_admin(req))
		return 0;
	return proto_fail(err, PROTO_E_PERMISSION_DENIED, "adapter",
	                  "adapter %s's artifact holds what its %s baked in: only %s may fetch it "
	                  "(scan it instead)",
	                  a->def.name, a->def.graph ? "graph" : "body",
	                  a->def.graph ? "the uid that registered it or an admin" : "an admin");
}

/* `kind`: scan (the default), or one of the saved pair: scan_save, grad_saved. */
static int pair_kind(struct request *req, const struct adapter *a, struct scan_args *args,
                     struct proto_err *err)
{
	const char *s;
	uint32_t n;
	int rc = msg_get_str(&req->msg.up.data, "kind", &s, &n, err);
	int kind = rc == 0 ? spec_kind_parse(s, n) : SPEC_SCAN;

	if (rc < 0 || (kind != SPEC_SCAN && kind != SPEC_SCAN_SAVE && kind != SPEC_GRAD_SAVED))
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "kind",
		                  "kind must be scan, scan_save or grad_saved");
	args->kind = (enum spec_kind)kind;
	return op_scan_saving(a, args->kind, "kind", err);
}

static void op_artifact(struct request *req)
{
	struct adapter *a;
	struct scan_args args = {.kind = SPEC_SCAN};
	struct proto_err err;

	if (op_scan_decode(req, &a, &req->carry, &req->inputs, &err) != 0 ||
	    may_fetch(req, a, &err) != 0 || local_kind(a, &err) != 0 ||
	    pair_kind(req, a, &args, &err) != 0 ||
	    op_scan_validate(a, &req->carry, req->params, &req->inputs, &args, &err) != 0 ||
	    op_scan_wrt(req, &args, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	request_acquire(req, a, &args, artifact_ready);
}

const struct op_desc op_artifact_desc = {"artifact", op_artifact, 0};
