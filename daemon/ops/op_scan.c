/*
 * op_scan.c - scan: run (compiling first if needed) one adapter's scan; and
 * what the scan, grad and compile ops share: decoding a request's trees and
 * validating them against DESIGN.md's contract (before any compile),
 * starting a run of the graph layer (run.c) for it, and writing the reply
 * trees from the run's results.
 *
 * The reply frame takes the run's results over and references the output
 * buffers instead of copying them, until it has been written.  It is sent
 * only if the connection is still open (conn_send drops writes to a closed
 * one).
 */
#include "op_scan.h"

#include "log.h"
#include "shm.h"
#include "signature.h"

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

int op_scan_validate(const struct adapter *a, const struct tree_node *carry, bool params,
                     const struct tree_node *inputs, struct scan_args *args, struct proto_err *err)
{
	struct check_ctx c = {.a = a, .args = args, .batched = adapter_batched(a), .err = err};

	args->carry = carry;
	args->batch = 0;
	args->inputs = inputs;
	if (params ? tree_visit(&carry->items[0], "carry", 0, carry_leaf, &c) != 0 ||
	                 tree_visit(&carry->items[1], "params", 0, carry_leaf, &c) != 0
	           : tree_visit(carry, "carry", 0, carry_leaf, &c) != 0)
		return -1;
	if (tree_visit(inputs, "inputs", 0, input_leaf, &c) != 0)
		return -1;
	if (!c.have_steps)
		return proto_fail(
		    err, PROTO_E_NO_INPUTS, "inputs",
		    "inputs has no tensor leaf: the scan length T comes from the inputs");
	return 0;
}

/* ---- replying with a run's results ---------------------------------------- */

struct reply_ctx {
	struct request *req;
	const struct engine_result *res;
	const uint64_t *placed;
	size_t next_placed;
};

/* Result tensors come to the encoder in the engine's order: when the graph
 * wrote them into the client's area, those of at least min_bytes go back as
 * references to where they are (smaller ones inline, as the client asked). */
static int place_next(const struct tree_tensor *t, uint64_t *offset, void *arg)
{
	struct reply_ctx *c = arg;
	size_t k = c->next_placed++;

	if (c->placed == NULL || k >= c->res->n || t->nbytes == 0 ||
	    t->nbytes < c->req->out.min_bytes)
		return 0;
	*offset = c->req->out.offset + c->placed[k];
	return 1;
}

/* Writes result trees of the spec's shapes from the flat outputs; key NULL:
 * passes over them (a request's params come back only as gradients). */
static int put_tree(struct outmsg *out, struct reply_ctx *c, const char *key,
                    const struct tree_node *spec, size_t *pos)
{
	struct tree_node node;
	size_t first = *pos;

	if (signature_fill(spec, c->res->tensors, c->res->n, pos, c->req->msg.up.zone, &node) != 0)
		return -1;
	if (key == NULL) {
		c->next_placed += *pos - first;
		return 0;
	}
	writer_str(&out->w, key);
	tree_encode_placed(&out->w, &node, place_next, c);
	return 0;
}

/* The result trees in the engine's order (spec_kinds, graphs.h): the final
 * carry and the stacked outputs, saved (and the pair's key), the carry's and
 * the inputs' gradients.  With params, the graph's carry is (carry, params):
 * params are not sent back, their gradients are grad_params. */
static int put_results(struct outmsg *out, struct reply_ctx *c, const struct specialization *sp)
{
	const struct spec_kind_info *k = &spec_kinds[sp->kind];
	const struct tree_node *carry = c->req->params ? &sp->carry.items[0] : &sp->carry;
	const struct tree_node *params = c->req->params ? &sp->carry.items[1] : NULL;
	size_t pos = 0;

	if (k->results && (put_tree(out, c, "carry", carry, &pos) ||
	                   (params && put_tree(out, c, NULL, params, &pos)) ||
	                   put_tree(out, c, "outputs", &sp->y, &pos)))
		return -1;
	if (k->saved && !k->grad) {
		if (put_tree(out, c, "saved", &sp->saved, &pos) != 0)
			return -1;
		writer_key_str(&out->w, "saved_key", sp->pair_key);
	}
	return k->grad && (put_tree(out, c, "grad_carry", carry, &pos) ||
	                   (params && put_tree(out, c, "grad_params", params, &pos)) ||
	                   put_tree(out, c, "grad_inputs", &sp->inputs, &pos))
	           ? -1
	           : 0;
}

/* The reply's keys besides out_needed (put_results). */
static uint32_t result_keys(const struct request *req, const struct specialization *sp)
{
	const struct spec_kind_info *k = &spec_kinds[sp->kind];

	return (k->results ? 2 : 0) + (k->saved && !k->grad ? 2 : 0) +
	       (k->grad ? 2 + req->params : 0);
}

/* The reply frame references the result buffers: it owns them until written. */
static void reply_run(struct run_job *j, void *arg)
{
	struct request *req = arg;
	struct specialization *sp = run_spec(j);
	struct reply_ctx c = {req, run_result(j), NULL, 0};
	const struct proto_err *failed = run_error(j);
	struct proto_err err;
	struct outmsg *out;
	uint64_t needed;

	if (failed) {
		request_fail(req, failed);
		return;
	}
	c.placed = run_placed(j, &needed);
	out = request_begin_result(req, result_keys(req, sp) + req->out.set);
	if (out == NULL)
		return;
	if (req->out.set)
		writer_key_u64(&out->w, "out_needed", needed);
	if (put_results(out, &c, sp) != 0) {
		conn_outmsg_free(out);
		proto_fail(&err, PROTO_E_ENGINE_ERROR, NULL,
		           "the graph's outputs do not match its signature");
		request_fail(req, &err);
		return;
	}
	out->cleanup = run_result_free;
	out->cleanup_arg = run_take_result(j);
	request_reply(req, out);
}

struct run_job *op_scan_new(struct request *req, struct specialization *sp, struct proto_err *err)
{
	struct run_area area = {req->out.set ? req->out.base : NULL, req->out.size};
	struct run_job *j = run_new(&req->d->graphs, sp, req->batch, &area, err);

	if (j && run_set_chunks(j, req->chunks, err) != 0) {
		run_free(j);
		return NULL;
	}
	if (j) {
		run_add(j, &req->carry);
		run_add(j, &req->inputs);
	}
	return j;
}

static void chunk_leaves(struct tree_node *n, int64_t steps)
{
	if (n->kind == TREE_TENSOR) {
		n->tensor.shape[0] = steps;
		tree_tensor_sizes(&n->tensor);
	}
	for (uint32_t i = 0; i < n->count; i++)
		chunk_leaves(&n->items[i], steps);
}

int op_scan_chunk(struct request *req, const struct adapter *a, struct scan_args *args,
                  struct proto_err *err)
{
	const int64_t k = PROTO_CHUNK_STEPS;

	req->chunks = 0;
	if (strcmp(a->def.strategy, "chunk") != 0 || spec_kinds[args->kind].grad ||
	    args->batch > 0 || args->steps <= k || args->steps % k != 0)
		return 0;
	if (signature_copy(args->inputs, req->msg.up.zone, &req->chunk_inputs) != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	chunk_leaves(&req->chunk_inputs, k);
	req->chunks = args->steps / k;
	args->inputs = &req->chunk_inputs;
	args->steps = k;
	return 0;
}

void op_scan_start(struct run_job *j, struct request *req)
{
	run_submit(j, reply_run, req);
}

/* ---- decoding the request ---------------------------------------------- */

/* `params` (optional): tensors every step reads unchanged.  Inside, the
 * carry is the pair (carry, params), which the body returns as it got it. */
static int decode_params(struct request *req, struct tree_node *carry, struct proto_err *err)
{
	struct tree_node params;
	int rc = msg_get_tree(&req->msg, "params", false, &params, err);

	if (rc != 0)
		return rc < 0 ? -1 : 0;
	req->params = true;
	return op_scan_pair(req, carry, &params, err);
}

int op_scan_pair(struct request *req, struct tree_node *first, const struct tree_node *second,
                 struct proto_err *err)
{
	struct tree_node *pair = msgpack_zone_malloc(req->msg.up.zone, 2 * sizeof *pair);

	if (pair == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	pair[0] = *first;
	pair[1] = *second;
	memset(first, 0, sizeof *first);
	first->kind = TREE_TUPLE;
	first->count = 2;
	first->items = pair;
	return 0;
}

int op_scan_decode(struct request *req, struct adapter **a, struct tree_node *carry,
                   struct tree_node *inputs, struct proto_err *err)
{
	if (request_adapter(req, a, err) != 0)
		return -1;
	if (msg_get_tree(&req->msg, "carry", true, carry, err) != 0 ||
	    msg_get_tree(&req->msg, "inputs", true, inputs, err) != 0)
		return -1;
	return decode_params(req, carry, err);
}

int op_scan_saving(const struct adapter *a, enum spec_kind kind, const char *path,
                   struct proto_err *err)
{
	if (!spec_kinds[kind].saved ||
	    (strcmp(a->def.strategy, "unroll") == 0 && !adapter_batched(a)))
		return 0;
	return proto_fail(err, PROTO_E_INVALID_ARGUMENT, path,
	                  "%s: adapter %s is strategy %s, dynamic %s; a graph that keeps saved for "
	                  "the backward is the unrolled loop's at static shapes (strategy unroll, "
	                  "dynamic none)",
	                  path, a->def.name, a->def.strategy, a->def.dynamic);
}

int op_scan_wrt(struct request *req, struct scan_args *args, struct proto_err *err)
{
	const char *s;
	uint32_t n;
	size_t leaves = tree_count_tensors(args->carry) + tree_count_tensors(args->inputs);
	bool all = true;
	char *wrt;

	args->wrt = NULL;
	if (msg_field(&req->msg, "wrt") == NULL)
		return 0;
	if (!spec_kinds[args->kind].saved)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "wrt",
		                  "wrt: only a scan with save and a grad with saved take it");
	if (msg_get_str(&req->msg.up.data, "wrt", &s, &n, err) != 0 || n != leaves ||
	    strspn(s, "01") < n)
		return proto_fail(
		    err, PROTO_E_INVALID_ARGUMENT, "wrt",
		    "wrt: a string of one '0' or '1' per tensor leaf of carry, params "
		    "and inputs (%zu here)",
		    leaves);
	for (uint32_t i = 0; i < n; i++)
		all &= s[i] == '1';
	if (all)
		return 0; /* the same graph as none */
	wrt = msgpack_zone_malloc(req->msg.up.zone, n + 1);
	if (wrt == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(wrt, s, n);
	wrt[n] = '\0';
	args->wrt = wrt;
	return 0;
}

/* ---- the scan op ------------------------------------------------------------ */

/* save: true asks for the forward that keeps what the backward needs
 * (kind scan_save): the reply adds saved and saved_key, which a grad takes. */
static int scan_kind(struct request *req, const struct adapter *a, struct scan_args *args,
                     struct proto_err *err)
{
	bool save = false;

	if (msg_get_bool(&req->msg.up.data, "save", &save, err) < 0)
		return -1;
	args->kind = save ? SPEC_SCAN_SAVE : SPEC_SCAN;
	return op_scan_saving(a, args->kind, "save", err);
}

static void scan_ready(struct request *req, struct specialization *sp)
{
	struct proto_err err;
	struct run_job *j = op_scan_new(req, sp, &err);

	if (j == NULL)
		request_fail(req, &err);
	else
		op_scan_start(j, req);
}

static void op_scan(struct request *req)
{
	struct adapter *a;
	struct scan_args args = {0};
	struct proto_err err;

	if (op_scan_decode(req, &a, &req->carry, &req->inputs, &err) != 0 ||
	    scan_kind(req, a, &args, &err) != 0 ||
	    op_scan_validate(a, &req->carry, req->params, &req->inputs, &args, &err) != 0 ||
	    op_scan_wrt(req, &args, &err) != 0 || op_scan_chunk(req, a, &args, &err) != 0 ||
	    shm_out_decode(req, &req->out, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	request_acquire(req, a, &args, scan_ready);
}

const struct op_desc op_scan_desc = {"scan", op_scan, 0};
