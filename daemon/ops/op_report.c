/*
 * op_report.c - report: what a client's local runs did (the Python
 * package's run="local", op_artifact.c), at most about once a second, and
 * what has changed since: the daemon still sees the work, and the client
 * learns of a new generation.
 *
 * Request: `adapter`, `specs` (at most REPORT_MAX_SPECS maps: `signature`,
 * `runs` (local runs since the last report, at most REPORT_MAX_RUNS),
 * `p50_us`, `p99_us` (their run times)).  The runs add to the adapter's
 * `local_runs`; the last report's percentiles are its `local_run_p50_us` /
 * `local_run_p99_us` (describe, stats, `torchloop stats --prometheus`).
 * Reply: `specs`, per reported signature: `key`, the graph the daemon serves
 * now ("" when the specialization is gone), and `trial` (true while an
 * upgrade's trial decides between two graphs: the daemon measures that on
 * its own runs, so the client runs through it until the trial ends).
 *
 * Any user that can scan the adapter may report: the counters are what
 * clients say, bounded per report; nothing else changes.
 */
#include "daemon.h"

#include <string.h>

#define REPORT_MAX_SPECS 64
#define REPORT_MAX_RUNS  (1 << 30)

static int get_us(const msgpack_object *m, const char *key, double *out, struct proto_err *err)
{
	const msgpack_object *v = msg_obj_field(m, key);

	if (v != NULL && (v->type == MSGPACK_OBJECT_FLOAT64 || v->type == MSGPACK_OBJECT_FLOAT32))
		*out = v->via.f64;
	else if (v != NULL && v->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
		*out = (double)v->via.u64;
	else
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "specs",
		                  "each report needs %s (a number of microseconds)", key);
	if (!(*out >= 0 && *out <= 1e12))
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "specs", "%s out of range", key);
	return 0;
}

static const struct specialization *find_scan(const struct adapter *a, const char *sig,
                                              uint32_t len)
{
	for (const struct specialization *sp = a->specs; sp; sp = sp->next)
		if (sp->kind == SPEC_SCAN && sp->state == SPEC_READY &&
		    strlen(sp->signature) == len && memcmp(sp->signature, sig, len) == 0)
			return sp;
	return NULL;
}

struct entry {
	const char *sig;
	uint32_t len;
	int64_t runs;
	double p50, p99;
};

static int parse(const msgpack_object *m, struct entry *e, struct proto_err *err)
{
	if (m->type != MSGPACK_OBJECT_MAP ||
	    msg_get_str(m, "signature", &e->sig, &e->len, err) != 0 ||
	    msg_get_i64(m, "runs", &e->runs, err) != 0 || get_us(m, "p50_us", &e->p50, err) != 0 ||
	    get_us(m, "p99_us", &e->p99, err) != 0)
		return err->code != PROTO_E_OK
		           ? -1
		           : proto_fail(err, PROTO_E_INVALID_ARGUMENT, "specs",
		                        "each report is a map of signature, runs, p50_us, p99_us");
	if (e->runs < 0 || e->runs > REPORT_MAX_RUNS)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "specs", "runs out of range");
	return 0;
}

/* One checked entry: counted into a, answered into w. */
static void apply(struct adapter *a, const struct entry *e, struct writer *w)
{
	const struct specialization *sp = find_scan(a, e->sig, e->len);

	a->stats.local_runs += (uint64_t)e->runs;
	if (e->runs > 0) {
		a->stats.local_p50_us = e->p50;
		a->stats.local_p99_us = e->p99;
	}
	msgpack_pack_map(&w->pk, 3);
	writer_str(w, "signature");
	writer_strn(w, e->sig, e->len);
	writer_key_str(w, "key", sp ? sp->graph_key : "");
	writer_key_bool(w, "trial", sp && sp->upgrade.verdict == UPGRADE_TRIAL);
}

static void op_report(struct request *req)
{
	const msgpack_object *specs = msg_field(&req->msg, "specs");
	struct entry e[REPORT_MAX_SPECS];
	struct proto_err err = {0};
	struct outmsg *out;
	struct adapter *a;
	uint32_t n;

	if (request_adapter(req, &a, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	if (specs == NULL || specs->type != MSGPACK_OBJECT_ARRAY ||
	    specs->via.array.size > REPORT_MAX_SPECS) {
		request_fail_code(req, PROTO_E_INVALID_ARGUMENT, "specs",
		                  "specs must be an array of at most %d reports", REPORT_MAX_SPECS);
		return;
	}
	n = specs->via.array.size;
	for (uint32_t i = 0; i < n; i++)
		if (parse(&specs->via.array.ptr[i], &e[i], &err) != 0) {
			request_fail(req, &err);
			return;
		}
	out = request_begin_result(req, 1);
	if (out == NULL)
		return;
	writer_str(&out->w, "specs");
	msgpack_pack_array(&out->w.pk, n);
	for (uint32_t i = 0; i < n; i++)
		apply(a, &e[i], &out->w);
	request_reply(req, out);
}

const struct op_desc op_report_desc = {"report", op_report, 0};
