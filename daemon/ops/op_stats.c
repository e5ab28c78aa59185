/* op_stats.c - stats: daemon-wide counters, error codes, and per adapter. */
#include "describe.h"
#include "log.h"

struct counter {
	const char *name;
	uint64_t value;
};

/* stats' top level besides the counters: uptime, sandbox, lanes, remote, error_codes,
 * adapters */
#define STATS_OTHER_KEYS 6

/* stats' error_codes (those sent at least once) and adapters (bounds and counters) */
static void write_codes_and_adapters(struct writer *w, const struct daemon *d)
{
	uint32_t n_codes = 0;

	for (int c = 1; c < PROTO_E__COUNT; c++)
		n_codes += d->stats.error_codes[c] != 0;
	writer_str(w, "error_codes");
	msgpack_pack_map(&w->pk, n_codes);
	for (int c = 1; c < PROTO_E__COUNT; c++)
		if (d->stats.error_codes[c])
			writer_key_u64(w, proto_code_name(c), d->stats.error_codes[c]);
	writer_str(w, "adapters");
	msgpack_pack_array(&w->pk, d->graphs.reg.count);
	for (const struct adapter *a = d->graphs.reg.head; a; a = a->next) {
		msgpack_pack_map(&w->pk, DESCRIBE_BOUNDS + DESCRIBE_COUNTERS);
		describe_bounds(w, a);
		describe_counters(w, a);
	}
}

static void op_stats(struct request *req)
{
	struct daemon *d = req->d;
	uint64_t cache_evicted, cache_evicted_bytes;
	cache_evict_counts(&cache_evicted, &cache_evicted_bytes);
	const struct counter counters[] = {
	    {"connections", d->stats.connections},
	    {"open_connections", d->n_conns},
	    {"requests", d->stats.requests},
	    {"errors", d->stats.errors + d->stats.frame_errors},
	    {"limit_breaches", d->stats.limit_breaches},
	    {"inflight", d->inflight},
	    {"inline_runs", d->graphs.inline_runs},
	    {"runner_runs", d->graphs.runner_runs},
	    {"contended_runs", d->graphs.contended_runs},
	    {"busy_polled", d->stats.busy_polled},
	    {"worker_restarts", compiler_restarts(d->compiler)},
	    {"worker_start_failures", compiler_start_failures(d->compiler)},
	    {"worker_orphans_killed", compiler_orphans_killed(d->compiler)},
	    {"worker_recycled", compiler_recycled(d->compiler)},
	    {"pool_stalls", d->stats.pool_stalls},
	    {"idle_closed", d->stats.idle_closed},
	    {"stalled_closed", d->stats.stalled_frames_closed},
	    {"memory_pauses", d->stats.memory_pauses},
	    {"queued_bytes", d->queued_bytes},
	    {"shm_bytes", d->shm_bytes},
	    {"shm_regions", d->shm_regions},
	    {"shm_attaches", d->stats.shm_attaches},
	    {"shm_stray_fds", d->stats.shm_stray_fds},
	    {"graphs_evicted", d->stats.graphs_evicted},
	    {"failed_evictions", d->graphs.failed_evictions},
	    {"cache_evicted", cache_evicted},
	    {"cache_evicted_bytes", cache_evicted_bytes},
	    {"busy", d->stats.busy},
	    /* requests waiting for the start-up's registrations and worker (ops.c) */
	    {"start_waiting", d->held_n},
	    {"start_waited", d->held_total},
	};
	size_t n = sizeof counters / sizeof counters[0];
	struct outmsg *out = request_begin_result(req, (uint32_t)(n + STATS_OTHER_KEYS));

	if (out == NULL)
		return;
	writer_key_f64(&out->w, "uptime", log_now() - d->started);
	writer_key_str(&out->w, "sandbox", compiler_sandbox(d->compiler));
	for (size_t i = 0; i < n; i++)
		writer_key_u64(&out->w, counters[i].name, counters[i].value);
	writer_str(&out->w, "lanes");
	describe_lanes(&out->w, d->compiler, true);
	writer_str(&out->w, "remote");
	describe_remote(&out->w, d->graphs.remote, true);
	write_codes_and_adapters(&out->w, d);
	request_reply(req, out);
}

const struct op_desc op_stats_desc = {"stats", op_stats, 0};
