/*
 * op_health.c - health: live (the loop answered) and ready (worker alive,
 * start-up done, preloaded adapters' graphs loaded, the thread pool taking
 * work); "worker_state" and "pool" say which part is not.  "remote" is the
 * remote cache tier: "off", "ok" or "degraded" (it never makes the daemon
 * unready: a fault there means local compiles).
 */
#include "describe.h"

static void op_health(struct request *req)
{
	struct daemon *d = req->d;
	bool worker = compiler_alive(d->compiler);
	struct outmsg *out = request_begin_result(req, 13);

	if (out == NULL)
		return;
	writer_key_bool(&out->w, "live", true);
	writer_key_bool(&out->w, "ready",
	                d->ready && worker && !d->shutting_down && !d->pool_stalled);
	writer_key_bool(&out->w, "worker", worker);
	writer_key_str(&out->w, "worker_state", compiler_state(d->compiler));
	/* "landlock+seccomp", or "off (why)" (daemon/base/sandbox.h) */
	writer_key_str(&out->w, "sandbox", compiler_sandbox(d->compiler));
	writer_str(&out->w, "lanes");
	describe_lanes(&out->w, d->compiler, false);
	writer_key_str(&out->w, "pool", d->pool_stalled ? "stalled" : "ok");
	/* a remote tier at fault degrades (the daemon compiles locally), never unreadies */
	writer_str(&out->w, "remote");
	describe_remote(&out->w, d->graphs.remote, false);
	writer_key_f64(&out->w, "pool_wait", daemon_pool_wait(d));
	writer_key_bool(&out->w, "stopping", d->shutting_down);
	writer_key_u64(&out->w, "adapters", d->graphs.reg.count);
	writer_key_u64(&out->w, "graphs", graphs_loaded(&d->graphs));
	writer_key_u64(&out->w, "inflight", d->inflight);
	request_reply(req, out);
}

const struct op_desc op_health_desc = {"health", op_health, OP_WHILE_STOPPING};
