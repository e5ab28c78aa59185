/*
 * op_compile.c - compile (admin): warm a specialization from shapes and
 * dtype alone.  carry and inputs are spec trees (docs/protocol.md: the
 * worker form), so no tensor bytes travel.  Replies once the graph is ready.
 * Admin-only because each new shape takes one of the adapter's budget slots
 * without a single tensor being sent: an unprivileged client could fill the
 * budget for everyone (docs/operations.md, "Who may do what").
 */
#include "op_scan.h"
#include "describe.h"

#include "signature.h"

#include <string.h>

static void compile_ready(struct request *req, struct specialization *sp)
{
	struct outmsg *out = request_begin_result(req, 5 + DESCRIBE_LOWERING);

	if (out == NULL)
		return;
	writer_key_str(&out->w, "signature", sp->signature);
	writer_key_str(&out->w, "kind", spec_kinds[sp->kind].name);
	writer_key_bool(&out->w, "from_cache", sp->from_cache);
	writer_key_f64(&out->w, "compile_seconds", sp->compile_seconds);
	writer_str(&out->w, "compile_phases");
	describe_phases(&out->w, sp);
	describe_lowering(&out->w, sp);
	request_reply(req, out);
}

static int read_spec(struct request *req, const char *key, enum proto_dtype dtype,
                     struct tree_node *out, struct proto_err *err)
{
	const msgpack_object *o = msg_field(&req->msg, key);

	if (o == NULL)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key,
		                  "compile needs %s (a spec tree)", key);
	if (shapes_read(o, req->msg.up.zone, dtype, false, out, err) != 0) {
		char why[PROTO_MESSAGE_MAX]; /* err->message is an argument: copy it first */
		enum proto_code code =
		    err->code == PROTO_E_COMPILE_FAILED ? PROTO_E_INVALID_ARGUMENT : err->code;
		snprintf(why, sizeof why, "%s", err->message);
		return proto_fail(err, code, key, "%s: %s", key, why);
	}
	return 0;
}

static int parse(struct request *req, struct scan_args *args, struct proto_err *err)
{
	const char *s;
	uint32_t n;
	enum proto_dtype dtype;

	if (msg_get_str(&req->msg.up.data, "dtype", &s, &n, err) != 0)
		return proto_fail(err, PROTO_E_BAD_DTYPE, "dtype",
		                  "compile needs dtype: float32 or float64");
	if (n == 7 && memcmp(s, "float32", 7) == 0)
		dtype = PROTO_DTYPE_F32;
	else if (n == 7 && memcmp(s, "float64", 7) == 0)
		dtype = PROTO_DTYPE_F64;
	else
		return proto_fail(err, PROTO_E_BAD_DTYPE, "dtype",
		                  "dtype must be float32 or float64");
	if (msg_get_str(&req->msg.up.data, "kind", &s, &n, err) == 0) {
		int kind = spec_kind_parse(s, n);
		if (kind < 0)
			return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "kind",
			                  "kind must be scan, grad, grad_checkpoint, scan_save or "
			                  "grad_saved");
		args->kind = (enum spec_kind)kind;
	}
	return read_spec(req, "carry", dtype, &req->carry, err) ||
	               read_spec(req, "inputs", dtype, &req->inputs, err)
	           ? -1
	           : 0;
}

static void op_compile(struct request *req)
{
	struct scan_args args = {0};
	struct proto_err err;
	struct adapter *a;

	if (request_adapter(req, &a, &err) != 0 || parse(req, &args, &err) != 0 ||
	    op_scan_saving(a, args.kind, "kind", &err) != 0 ||
	    op_scan_validate(a, &req->carry, false, &req->inputs, &args, &err) != 0 ||
	    op_scan_wrt(req, &args, &err) != 0 || op_scan_chunk(req, a, &args, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	request_acquire(req, a, &args, compile_ready);
}

const struct op_desc op_compile_desc = {"compile", op_compile, OP_ADMIN};
