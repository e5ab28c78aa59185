/* describe.c - adapter descriptions shared by list, describe and stats. */
#include "describe.h"

static const char *state_name(enum spec_state s)
{
	static const char *const names[] = {"loading", "compiling", "ready", "failed"};

	return names[s];
}

void describe_bounds(struct writer *w, const struct adapter *a)
{
	writer_key_str(w, "name", a->def.name);
	writer_key_i64(w, "max_steps", a->def.max_steps);
	writer_key_i64(w, "max_elements", a->def.max_elements);
	writer_key_i64(w, "recompile_budget", a->def.budget);
	writer_key_u64(w, "budget_used", a->held);
	/* each uid's share (graphs.h, struct budget_share): at most
	 * --max-uids-per-adapter + 1 entries */
	writer_str(w, "budget_shares");
	msgpack_pack_array(&w->pk, a->n_shares);
	for (unsigned i = 0; i < a->n_shares; i++) {
		msgpack_pack_map(&w->pk, 2);
		writer_key_i64(w, "uid", (int64_t)a->shares[i].uid);
		writer_key_u64(w, "used", a->shares[i].used);
	}
	writer_key_str(w, "strategy", a->def.strategy);
	writer_key_str(w, "dynamic", a->def.dynamic);
	writer_key_str(w, "entry", a->def.entry);
	writer_key_str(w, "body", a->def.graph ? "graph" : "source");
	writer_key_i64(w, "owner", (int64_t)a->def.owner);
}

void describe_phases(struct writer *w, const struct specialization *sp)
{
	int n = 0;

	for (int i = 0; i < COMPILE_PHASES; i++)
		n += sp->compile_phases[i] > 0;
	msgpack_pack_map(&w->pk, (uint32_t)n);
	for (int i = 0; i < COMPILE_PHASES; i++)
		if (sp->compile_phases[i] > 0)
			writer_key_f64(w, COMPILE_PHASE_NAMES[i], sp->compile_phases[i]);
}

void describe_origin(struct writer *w, const struct daemon *d, const struct adapter *a)
{
	static const char *const names[] = {"registered", "file", "restored"};

	writer_key_str(w, "origin", names[a->def.origin]);
	/* files are re-read from --adapters; registrations only with --state-dir */
	writer_key_bool(w, "persisted",
	                a->def.origin != ADAPTER_FILE && d->cfg.state_dir[0] != '\0');
}

/* Specializations held, whatever their kind (budget_used leaves out the
 * saved pair's backward: graphs.h, spec_kind_info.budgeted). */
static uint64_t graphs_held(const struct adapter *a)
{
	uint64_t n = 0;

	for (const struct specialization *sp = a->specs; sp; sp = sp->next)
		n += sp->state != SPEC_FAILED;
	return n;
}

void describe_counters(struct writer *w, const struct adapter *a)
{
	const struct adapter_stats *s = &a->stats;

	writer_key_u64(w, "requests", s->requests);
	writer_key_u64(w, "errors", s->errors);
	writer_key_u64(w, "compiles", s->compiles);
	writer_key_f64(w, "compile_seconds", s->compile_seconds);
	writer_key_u64(w, "cache_hits", s->cache_hits);
	writer_key_u64(w, "cache_misses", s->cache_misses);
	writer_key_u64(w, "runs", s->runs);
	writer_key_f64(w, "run_p50_us", adapter_latency_percentile(a, 0.5));
	writer_key_f64(w, "run_p99_us", adapter_latency_percentile(a, 0.99));
	writer_key_u64(w, "local_runs", s->local_runs);
	writer_key_f64(w, "local_run_p50_us", s->local_p50_us);
	writer_key_f64(w, "local_run_p99_us", s->local_p99_us);
	writer_key_u64(w, "graphs", graphs_held(a));
	writer_key_u64(w, "failed_specs", a->failed);
	writer_key_u64(w, "failed_evictions", s->failed_evictions);
	writer_key_u64(w, "worker_crashes", a->worker_crashes);
	writer_key_u64(w, "upgrades_started", s->upgrades_started);
	writer_key_u64(w, "upgrades_skipped", s->upgrades_skipped);
	writer_key_u64(w, "upgrades_kept", s->upgrades_kept);
	writer_key_u64(w, "upgrades_reverted", s->upgrades_reverted);
}

void describe_specs(struct writer *w, const struct adapter *a)
{
	uint32_t n = 0;

	for (const struct specialization *sp = a->specs; sp; sp = sp->next)
		n++;
	msgpack_pack_array(&w->pk, n);
	for (const struct specialization *sp = a->specs; sp; sp = sp->next) {
		msgpack_pack_map(&w->pk, 7 + (sp->state == SPEC_FAILED) +
		                             DESCRIBE_LOWERING * (sp->state == SPEC_READY));
		writer_key_str(w, "signature", sp->signature);
		writer_key_str(w, "key", sp->key);
		writer_key_str(w, "kind", spec_kinds[sp->kind].name);
		writer_key_str(w, "state", state_name(sp->state));
		writer_key_f64(w, "compile_seconds", sp->compile_seconds);
		writer_key_bool(w, "from_cache", sp->from_cache);
		writer_str(w, "compile_phases");
		describe_phases(w, sp);
		if (sp->state == SPEC_FAILED)
			writer_key_str(w, "error", proto_code_name(sp->error.code));
		if (sp->state == SPEC_READY)
			describe_lowering(w, sp);
	}
}

/* The quick tier's upgrade: its plan ("unroll", "block<K>", "" for none),
 * estimate and trial (upgrade.c); nil when no quick graph served. */
static void describe_upgrade(struct writer *w, const struct upgrade *u)
{
	if (!u->planned) {
		msgpack_pack_nil(&w->pk);
		return;
	}
	msgpack_pack_map(&w->pk, 7);
	writer_key_str(w, "plan", u->plan);
	writer_key_u64(w, "step_ops", u->step_ops);
	writer_key_f64(w, "estimated_seconds", u->estimate_s);
	writer_key_str(w, "verdict", upgrade_verdict_name(u->verdict));
	writer_key_u64(w, "trial_runs", u->n[0] + u->n[1]);
	writer_key_f64(w, "quick_run_us", u->median_us[0]);
	writer_key_f64(w, "upgrade_run_us", u->median_us[1]);
}

void describe_lowering(struct writer *w, const struct specialization *sp)
{
	writer_key_str(w, "lowered", sp->lowered);
	writer_key_str(w, "note", sp->note);
	writer_key_str(w, "tier", sp->quick ? "quick" : "final");
	writer_key_bool(w, "upgrading", sp->upgrading);
	/* the cache object serving now: the quick tier's while tier is quick */
	writer_key_str(w, "graph_key", sp->graph_key[0] ? sp->graph_key : sp->key);
	writer_str(w, "upgrade");
	describe_upgrade(w, &sp->upgrade);
}

void describe_lanes(struct writer *w, const struct compiler *c, bool full)
{
	struct lane_stats st;

	msgpack_pack_map(&w->pk, COMPILER_LANES);
	for (int k = 0; k < COMPILER_LANES; k++) {
		compiler_lane_stats(c, (enum compiler_lane)k, &st);
		writer_str(w, COMPILER_LANE_NAMES[k]);
		msgpack_pack_map(&w->pk, full ? 8 : 3);
		writer_key_u64(w, "workers", st.workers);
		writer_key_u64(w, "busy", st.busy);
		writer_key_u64(w, "queued", st.queued);
		if (!full)
			continue;
		writer_key_u64(w, "max", st.max);
		writer_key_bool(w, "paused", st.paused);
		writer_key_u64(w, "jobs", st.jobs);
		writer_key_u64(w, "preempted", st.preempted);
		writer_key_u64(w, "promoted", st.promoted);
	}
}

void describe_remote(struct writer *w, const struct remote *r, bool full)
{
	const struct remote_stats *st;

	if (r == NULL || !full) {
		writer_str(w, r == NULL ? "off" : remote_state(r));
		return;
	}
	st = remote_stats(r);
#define REMOTE_STAT_ONE(name, help) +1
	msgpack_pack_map(&w->pk, 2 + (0 REMOTE_STATS(REMOTE_STAT_ONE)));
#undef REMOTE_STAT_ONE
	writer_key_str(w, "state", remote_state(r));
	writer_key_str(w, "last_error", remote_last_error(r));
#define REMOTE_STAT_KEY(name, help) writer_key_u64(w, #name, st->name);
	REMOTE_STATS(REMOTE_STAT_KEY)
#undef REMOTE_STAT_KEY
}
