/*
 * op_grad.c - grad: the scan's outputs plus the vector-Jacobian product
 * for cotangents of (final carry, stacked outputs) with respect to
 * (carry, inputs).  A None cotangent (a whole tree or a leaf) means zero.
 * The vjp graph is its own specialization (kind "grad", or with checkpoint
 * "grad_checkpoint") and counts against the adapter's budget.  With saved
 * (what a scan with save kept, and its saved_key), only the gradients:
 * kind "grad_saved", which does not run the forward again.
 */
#include "op_scan.h"
#include "shm.h"
#include "signature.h"

#include <stdlib.h>
#include <string.h>

struct cot_ctx {
	struct engine_tensor *slots;
	size_t n;
	enum proto_dtype dtype;
	int64_t steps; /* > 0: expected shapes get this leading axis */
	int64_t batch; /* a symbolic-batch graph's SHAPES_BATCH dimensions are this */
	uint64_t zero_bytes;
	struct proto_err *err;
};

static int cot_mismatch(struct cot_ctx *c, const char *path, const char *what)
{
	return proto_fail(c->err, PROTO_E_COTANGENT_MISMATCH, path, "%s: %s", path, what);
}

static void zero_slots(const struct tree_node *spec, struct cot_ctx *c)
{
	size_t first = c->n;

	signature_flatten(spec, c->slots, &c->n);
	for (size_t i = first; i < c->n; i++) {
		struct engine_tensor *t = &c->slots[i];
		if (c->steps > 0) {
			memmove(t->shape + 1, t->shape, (PROTO_MAX_NDIM - 1) * sizeof t->shape[0]);
			t->shape[0] = c->steps;
			t->ndim++;
		}
		signature_bind(t, 1, c->batch);
		t->data = NULL; /* patched to a shared zero buffer */
		if (t->nbytes > c->zero_bytes)
			c->zero_bytes = t->nbytes;
	}
}

static int cot_tensor(const struct tree_node *spec, const struct tree_node *cot, const char *path,
                      struct cot_ctx *c)
{
	const struct tree_tensor *t = &cot->tensor;
	uint32_t off = c->steps > 0;
	bool same = t->ndim == spec->tensor.ndim + off && (!off || t->shape[0] == c->steps);

	if (cot->kind != TREE_TENSOR)
		return cot_mismatch(c, path, "expected a tensor or None");
	if (t->dtype != c->dtype)
		return cot_mismatch(c, path, "dtype differs from the request's");
	for (uint32_t i = 0; same && i < spec->tensor.ndim; i++) {
		int64_t want = spec->tensor.shape[i];
		same = t->shape[off + i] == (want == SHAPES_BATCH ? c->batch : want);
	}
	if (!same)
		return cot_mismatch(c, path, "shape differs from the value it is a cotangent of");
	signature_flatten(cot, c->slots, &c->n);
	return 0;
}

static int cot_walk(const struct tree_node *spec, const struct tree_node *cot, char *path,
                    size_t len, struct cot_ctx *c)
{
	if (cot->kind == TREE_NONE) {
		zero_slots(spec, c);
		return 0;
	}
	if (spec->kind == TREE_TENSOR)
		return cot_tensor(spec, cot, path, c);
	if (spec->kind == TREE_NONE)
		return cot_mismatch(c, path, "expected None (the value is None)");
	if (cot->kind != spec->kind || cot->count != spec->count)
		return cot_mismatch(c, path,
		                    "structure differs from the value it is a cotangent of");
	for (uint32_t i = 0; i < spec->count; i++) {
		size_t l = len;
		if (spec->kind == TREE_DICT &&
		    (cot->keys[i].len != spec->keys[i].len ||
		     memcmp(cot->keys[i].ptr, spec->keys[i].ptr, cot->keys[i].len)))
			return cot_mismatch(c, path, "dict keys differ (names or order)");
		tree_path_push(path, PROTO_PATH_MAX, &l, spec, i);
		if (cot_walk(&spec->items[i], &cot->items[i], path, l, c) != 0)
			return -1;
		path[len] = '\0';
	}
	return 0;
}

static int add_cotangents(struct run_job *j, struct request *req, struct specialization *sp,
                          struct proto_err *err)
{
	struct cot_ctx c = {.dtype = sp->dtype, .batch = req->batch, .err = err};
	char path[PROTO_PATH_MAX] = "cot_carry";
	void *zeros;

	c.slots = run_slots(j, &c.n);
	if (cot_walk(&sp->carry, &req->cot_carry, path, 9, &c) != 0)
		return -1;
	c.steps = sp->steps;
	snprintf(path, sizeof path, "cot_outputs");
	if (cot_walk(&sp->y, &req->cot_outputs, path, 11, &c) != 0)
		return -1;
	zeros = aligned_alloc(PROTO_TENSOR_ALIGN, (c.zero_bytes + 127) & ~(uint64_t)63);
	if (zeros == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memset(zeros, 0, (c.zero_bytes + 127) & ~(uint64_t)63);
	for (size_t i = 0; i < c.n; i++)
		if (c.slots[i].data == NULL)
			c.slots[i].data = zeros;
	run_own(j, zeros);
	run_set_count(j, c.n);
	return 0;
}

/* A grad_saved run's saved: the tensor its forward's reply carried, from the
 * same pair of graphs (saved_key), after the carry and the inputs. */
static int add_saved(struct run_job *j, struct request *req, struct specialization *sp,
                     struct proto_err *err)
{
	const struct tree_node *t = &req->saved;
	int64_t want = sp->saved.tensor.shape[0];

	if (!spec_kinds[sp->kind].saved)
		return 0;
	if (t->kind != TREE_TENSOR || t->tensor.ndim != 1 || t->tensor.dtype != sp->dtype ||
	    t->tensor.shape[0] != want)
		return proto_fail(
		    err, PROTO_E_SAVED_MISMATCH, "saved",
		    "saved: this grad's forward graph keeps one 1-D %s tensor of %lld "
		    "elements (the saved of a scan with save on the same carry and "
		    "inputs)",
		    proto_dtype_name(sp->dtype), (long long)want);
	if (req->saved_key_len != strlen(sp->pair_key) ||
	    memcmp(req->saved_key, sp->pair_key, req->saved_key_len) != 0)
		return proto_fail(err, PROTO_E_SAVED_MISMATCH, "saved_key",
		                  "saved_key: saved was kept by another graph (another body, "
		                  "definition, signature or daemon build) than this grad's");
	run_add(j, t);
	return 0;
}

static void grad_ready(struct request *req, struct specialization *sp)
{
	struct proto_err err;
	struct run_job *j = op_scan_new(req, sp, &err);

	if (j == NULL) {
		request_fail(req, &err);
		return;
	}
	if (add_saved(j, req, sp, &err) != 0 || add_cotangents(j, req, sp, &err) != 0) {
		run_free(j);
		request_fail(req, &err);
		return;
	}
	op_scan_start(j, req);
}

static int optional_tree(struct request *req, const char *key, struct tree_node *out,
                         struct proto_err *err)
{
	int rc = msg_get_tree(&req->msg, key, false, out, err);

	if (rc > 0)
		out->kind = TREE_NONE; /* absent: all zeros */
	return rc < 0 ? -1 : 0;
}

/* With params, cot_carry is the carry's: the params' cotangent is zero. */
static int pair_cot_carry(struct request *req, struct proto_err *err)
{
	static const struct tree_node none = {.kind = TREE_NONE};

	if (!req->params || req->cot_carry.kind == TREE_NONE)
		return 0;
	return op_scan_pair(req, &req->cot_carry, &none, err);
}

/* checkpoint: true asks for the checkpointed VJP (carries saved, steps
 * recomputed): a kind of its own, so a graph of its own.  saved (with
 * saved_key) asks for the backward of a scan with save (grad_saved). */
static int grad_kind(struct request *req, const struct adapter *a, enum spec_kind *kind,
                     struct proto_err *err)
{
	bool checkpoint = false;
	int rc = msg_get_tree(&req->msg, "saved", false, &req->saved, err);

	if (rc < 0 || msg_get_bool(&req->msg.up.data, "checkpoint", &checkpoint, err) < 0)
		return -1;
	*kind = checkpoint ? SPEC_GRAD_CHECKPOINT : SPEC_GRAD;
	if (rc > 0) {
		req->saved.kind = TREE_NONE;
		return 0;
	}
	if (checkpoint)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "saved",
		                  "saved: a grad with checkpoint recomputes its steps; saved is "
		                  "for the backward of a scan with save");
	if (msg_get_str(&req->msg.up.data, "saved_key", &req->saved_key, &req->saved_key_len,
	                err) != 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "saved_key",
		                  "saved_key: a grad with saved needs the saved_key (a string) of "
		                  "the scan that returned it");
	*kind = SPEC_GRAD_SAVED;
	return op_scan_saving(a, *kind, "saved", err);
}

static void op_grad(struct request *req)
{
	struct adapter *a;
	struct scan_args args = {0};
	struct proto_err err;

	if (op_scan_decode(req, &a, &req->carry, &req->inputs, &err) != 0 ||
	    grad_kind(req, a, &args.kind, &err) != 0 ||
	    op_scan_validate(a, &req->carry, req->params, &req->inputs, &args, &err) != 0 ||
	    op_scan_wrt(req, &args, &err) != 0 ||
	    optional_tree(req, "cot_carry", &req->cot_carry, &err) != 0 ||
	    pair_cot_carry(req, &err) != 0 ||
	    optional_tree(req, "cot_outputs", &req->cot_outputs, &err) != 0 ||
	    shm_out_decode(req, &req->out, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	request_acquire(req, a, &args, grad_ready);
}

const struct op_desc op_grad_desc = {"grad", op_grad, 0};
