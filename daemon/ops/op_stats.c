/* op_stats.c - stats: daemon-wide counters, error codes, and per adapter. */
#include "describe.h"
#include "log.h"

static void op_stats(struct request *req)
{
	struct daemon *d = req->d;
	struct outmsg *out = request_begin_result(req, 30);
	uint32_t n_codes = 0;

	if (out == NULL)
		return;
	writer_key_f64(&out->w, "uptime", log_now() - d->started);
	writer_key_u64(&out->w, "connections", d->stats.connections);
	writer_key_u64(&out->w, "open_connections", d->n_conns);
	writer_key_u64(&out->w, "requests", d->stats.requests);
	writer_key_u64(&out->w, "errors", d->stats.errors + d->stats.frame_errors);
	writer_key_u64(&out->w, "limit_breaches", d->stats.limit_breaches);
	writer_key_u64(&out->w, "inflight", d->inflight);
	writer_key_u64(&out->w, "inline_runs", d->graphs.inline_runs);
	writer_key_u64(&out->w, "runner_runs", d->graphs.runner_runs);
	writer_key_u64(&out->w, "busy_polled", d->stats.busy_polled);
	writer_key_u64(&out->w, "worker_restarts", compiler_restarts(d->compiler));
	writer_key_u64(&out->w, "worker_start_failures", compiler_start_failures(d->compiler));
	writer_key_u64(&out->w, "worker_orphans_killed", compiler_orphans_killed(d->compiler));
	writer_key_u64(&out->w, "worker_recycled", compiler_recycled(d->compiler));
	writer_str(&out->w, "lanes");
	describe_lanes(&out->w, d->compiler, true);
	writer_key_u64(&out->w, "pool_stalls", d->stats.pool_stalls);
	writer_key_u64(&out->w, "idle_closed", d->stats.idle_closed);
	writer_key_u64(&out->w, "stalled_closed", d->stats.stalled_frames_closed);
	writer_key_u64(&out->w, "memory_pauses", d->stats.memory_pauses);
	writer_key_u64(&out->w, "queued_bytes", d->queued_bytes);
	writer_key_u64(&out->w, "shm_bytes", d->shm_bytes);
	writer_key_u64(&out->w, "shm_regions", d->shm_regions);
	writer_key_u64(&out->w, "shm_attaches", d->stats.shm_attaches);
	writer_key_u64(&out->w, "shm_stray_fds", d->stats.shm_stray_fds);
	writer_key_u64(&out->w, "graphs_evicted", d->stats.graphs_evicted);
	writer_key_u64(&out->w, "failed_evictions", d->graphs.failed_evictions);
	writer_key_u64(&out->w, "busy", d->stats.busy);
	writer_str(&out->w, "remote");
	describe_remote(&out->w, d->graphs.remote, true);
	for (int c = 1; c < PROTO_E__COUNT; c++)
		n_codes += d->stats.error_codes[c] != 0;
	writer_str(&out->w, "error_codes");
	msgpack_pack_map(&out->w.pk, n_codes);
	for (int c = 1; c < PROTO_E__COUNT; c++)
		if (d->stats.error_codes[c])
			writer_key_u64(&out->w, proto_code_name(c), d->stats.error_codes[c]);
	writer_str(&out->w, "adapters");
	msgpack_pack_array(&out->w.pk, d->graphs.reg.count);
	for (const struct adapter *a = d->graphs.reg.head; a; a = a->next) {
		msgpack_pack_map(&out->w.pk, DESCRIBE_BOUNDS + DESCRIBE_COUNTERS);
		describe_bounds(&out->w, a);
		describe_counters(&out->w, a);
	}
	request_reply(req, out);
}

const struct op_desc op_stats_desc = {"stats", op_stats, 0};
