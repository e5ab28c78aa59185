/*
 * upgrade.c - a quick tier's upgrade: what replaces the scan op's graph of a
 * long unrolled specialization, and whether the replacement stays.  The
 * policy only: graphs.c builds and loads what it picks, and nothing here
 * calls back into graphs.c (tests/python/test_layers.py).
 *
 * Plan.  The unrolled loop runs fastest but its compile grows with T x the
 * step's size (83-145 s for a 128-step RK4 of 76 ATen calls a step here); the
 * scan op's graph compiles in seconds whatever T but pays a loop iteration
 * a step.  From the step's ATen calls (the worker counts them in the quick
 * graph), what unrolling n steps adds to a compile is estimated as
 *
 *     OP_STEP_SECONDS x calls a step x n
 *
 * The unrolled loop (n = T) is built when that is within --upgrade-budget;
 * over it, the largest block of K unrolled steps that fits (the scan op over
 * T / K blocks, T % K steps unrolled after: strategy "block<K>",
 * daemon/worker/torchloop_worker/blocked.py; n = K + T % K); when not even a block of
 * MIN_BLOCK steps fits, the quick graph stays.  The estimate is only that:
 * the plan and its estimate are in `describe`.
 *
 * Trial.  When the upgrade is loaded, the next runs alternate between it
 * and the quick graph (both are kept: runs hold the graph they started
 * with) until each has UPGRADE_TRIAL_RUNS runs with a settled OpenMP team;
 * the upgrade stays when its median run is at most --upgrade-keep-percent
 * (90) of the quick graph's, else the quick graph serves again.
 *
 * Upgrades that pay.  A lost trial is remembered by its adapter, per kind
 * (unrolled, blocks): the body's other specializations build no upgrade of
 * that kind (what they would cost in background compile is saved; the note
 * in `describe` says which trial decided it) until one of that kind is kept
 * or the adapter is registered again.  The trial is measured again
 * after a restart (the upgrade then loads from the cache: no compile),
 * except for an unrolled upgrade, which a restart finds first and serves.
 *
 * Loop thread.
 */
#include "graphs_internal.h"

#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC poison request conn outmsg daemon

/* Compile seconds per ATen call per unrolled step: lorenz's RK4 (76 calls
 * a step) at T = 128 took 126 s more than its quick graph, ema's (4) 6 s;
 * the worker's codegen_speed.py and single export made that 20% less. */
#define OP_STEP_SECONDS 0.010
#define MIN_BLOCK       4

bool tier_applies(const struct graphs *g, const struct specialization *sp)
{
	long long min = g->cfg->quick_tier_steps;

	return min > 0 && sp->steps >= min && !sp->batch && spec_kinds[sp->kind].tiered &&
	       strcmp(sp->adapter->def.strategy, "unroll") == 0;
}

const char *upgrade_verdict_name(enum upgrade_verdict v)
{
	static const char *const names[] = {"pending", "trial", "kept", "reverted"};

	return names[v];
}

/* Seconds n unrolled steps add to a compile, estimated. */
static double unrolled_seconds(const struct specialization *sp, int64_t n)
{
	return OP_STEP_SECONDS * sp->upgrade.step_ops * (double)n;
}

/* 0: an unrolled upgrade, 1: blocks */
static int plan_kind(const char *plan)
{
	return strncmp(plan, "block", 5) == 0;
}

/* The plan is built (true) unless its kind lost a trial on this adapter. */
static bool paid(struct specialization *sp)
{
	struct adapter *a = sp->adapter;
	const char *lost = a->upgrade_lost[plan_kind(sp->upgrade.plan)];

	if (lost[0] == '\0') {
		a->stats.upgrades_started++;
		return true;
	}
	a->stats.upgrades_skipped++;
	snprintf(sp->note, sizeof sp->note, "quick tier: no upgrade (%s): %s", sp->upgrade.plan,
	         lost);
	sp->upgrade.plan[0] = '\0';
	log_line(LOG_INFO, 0, a->def.name, "%s %s: %s", spec_kinds[sp->kind].name, sp->signature,
	         sp->note);
	return false;
}

/*
 * Fills sp->upgrade's plan (false: none): "unroll" when its unrolled steps fit the budget
 * (or with no budget, or a step of unknown size), else "block<K>" for the
 * largest K whose K + T % K unrolled steps fit, else "" (the quick graph
 * stays; the note says why); "" too when an upgrade of the plan's kind lost
 * its trial on this adapter (paid).  The quick compile's seconds are not part of
 * the test (they say more about the machine's load than about the body),
 * only of the estimate shown.
 */
bool upgrade_plan(const struct graphs *g, struct specialization *sp)
{
	struct upgrade *u = &sp->upgrade;
	double budget = (double)g->cfg->upgrade_budget;
	int64_t t = sp->steps;
	char why[64];

	u->planned = true;
	u->estimate_s = sp->compile_seconds + unrolled_seconds(sp, t);
	u->keep_ratio = (double)g->cfg->upgrade_keep_percent / 100.0;
	if (budget <= 0 || u->step_ops == 0 || unrolled_seconds(sp, t) <= budget) {
		snprintf(u->plan, sizeof u->plan, "unroll");
		return paid(sp);
	}
	for (int k = (int)(t / 2); spec_kinds[sp->kind].blocks && k >= MIN_BLOCK; k--) {
		if (unrolled_seconds(sp, k + t % k) <= budget) {
			snprintf(u->plan, sizeof u->plan, "block%d", k);
			u->estimate_s = sp->compile_seconds + unrolled_seconds(sp, k + t % k);
			return paid(sp);
		}
	}
	u->plan[0] = '\0';
	sp->adapter->stats.upgrades_skipped++;
	if (spec_kinds[sp->kind].blocks)
		snprintf(why, sizeof why, "and so would a block of %d", MIN_BLOCK);
	else
		snprintf(why, sizeof why, "and a VJP is not built in blocks");
	snprintf(sp->note, sizeof sp->note,
	         "quick tier: no upgrade: unrolling %lld steps of %u ATen calls would add ~%.0f s "
	         "to the compile, over --upgrade-budget=%lld, %s",
	         (long long)t, u->step_ops, unrolled_seconds(sp, t), g->cfg->upgrade_budget, why);
	log_line(LOG_INFO, 0, sp->adapter->def.name, "%s %s: %s", spec_kinds[sp->kind].name,
	         sp->signature, sp->note);
	return false;
}

void upgrade_failed(struct specialization *sp, const struct proto_err *err)
{
	log_line(LOG_WARN, 0, sp->adapter->def.name,
	         "%s %s: the upgrade (%s) failed (%s: %s); the scan op's graph keeps serving",
	         spec_kinds[sp->kind].name, sp->signature, sp->upgrade.plan,
	         proto_code_name(err->code), err->message);
	snprintf(sp->note, sizeof sp->note, "quick tier: the upgrade (%s) failed (%s)",
	         sp->upgrade.plan, proto_code_name(err->code));
}

/* What the runs measured was the other graph's. */
static void forget_runs(struct specialization *sp)
{
	sp->runs = 0;
	sp->run_ema_us = 0;
	memset(&sp->team, 0, sizeof sp->team);
}

void upgrade_take_over(struct load_job *j)
{
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;
	struct upgrade *u = &sp->upgrade;

	memcpy(u->quick_key, sp->graph_key, sizeof u->quick_key);
	u->quick_seconds = sp->compile_seconds;
	u->verdict = UPGRADE_TRIAL;
	memset(u->n, 0, sizeof u->n);
	/* runs under way keep the graph they started with: it is retired, not freed */
	sp->retired = sp->graph;
	sp->graph = j->graph;
	j->graph = NULL;
	sp->quick = false;
	memcpy(sp->graph_key, j->key, sizeof sp->graph_key);
	memcpy(sp->lowered, j->lowered, sizeof sp->lowered);
	memcpy(sp->note, j->note, sizeof sp->note);
	sp->from_cache = j->hit;
	if (j->hit) {
		a->stats.cache_hits++;
		sp->compile_seconds = j->compile_seconds;
	} else {
		sp->compile_seconds = j->res.compile_seconds;
		memcpy(sp->compile_phases, j->res.phases, sizeof sp->compile_phases);
		a->stats.compile_seconds += sp->compile_seconds;
	}
	forget_runs(sp);
	log_line(LOG_INFO, 0, a->def.name,
	         "%s %s: the upgrade (%s) took over, on trial (%s, %.1f s; estimated %.1f s)",
	         spec_kinds[sp->kind].name, sp->signature, u->plan,
	         j->hit ? "from cache" : "compiled", sp->compile_seconds, u->estimate_s);
}

/* ---- the trial ----------------------------------------------------------- */

struct engine_graph *upgrade_run_graph(struct specialization *sp, int *arm)
{
	const struct upgrade *u = &sp->upgrade;

	*arm = -1;
	if (u->verdict != UPGRADE_TRIAL || sp->retired == NULL)
		return sp->graph;
	*arm = u->n[0] <= u->n[1] ? 0 : 1;
	return *arm == 0 ? sp->retired : sp->graph;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static double median(double *v, unsigned n)
{
	qsort(v, n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Both graphs ran UPGRADE_TRIAL_RUNS times: the faster one serves. */
static void verdict(struct specialization *sp)
{
	struct upgrade *u = &sp->upgrade;
	struct engine_graph *upgraded = sp->graph;
	char *lost = sp->adapter->upgrade_lost[plan_kind(u->plan)];

	u->median_us[0] = median(u->us[0], u->n[0]);
	u->median_us[1] = median(u->us[1], u->n[1]);
	if (u->median_us[1] <= u->keep_ratio * u->median_us[0]) {
		u->verdict = UPGRADE_KEPT;
		sp->adapter->stats.upgrades_kept++;
		lost[0] = '\0';
	} else {
		sp->adapter->stats.upgrades_reverted++;
		snprintf(
		    lost, sizeof sp->adapter->upgrade_lost[0],
		    "the upgrade (%s) of %s lost its trial, %.1f us against the scan op's %.1f us",
		    u->plan, sp->signature, u->median_us[1], u->median_us[0]);
		u->verdict = UPGRADE_REVERTED;
		sp->graph = sp->retired; /* the upgrade's runs under way keep theirs */
		sp->retired = upgraded;
		sp->quick = true;
		memcpy(sp->graph_key, u->quick_key, sizeof sp->graph_key);
		snprintf(sp->lowered, sizeof sp->lowered, "scan");
		sp->compile_seconds = u->quick_seconds;
		forget_runs(sp);
	}
	snprintf(
	    sp->note, sizeof sp->note,
	    "quick tier: the upgrade (%s) %s: median run %.1f us against the scan op's %.1f us",
	    u->plan, u->verdict == UPGRADE_KEPT ? "kept" : "not kept, not fast enough",
	    u->median_us[1], u->median_us[0]);
	log_line(LOG_INFO, 0, sp->adapter->def.name, "%s %s: %s", spec_kinds[sp->kind].name,
	         sp->signature, sp->note);
}

void upgrade_run_measured(struct specialization *sp, int arm, int team_trial, double us)
{
	struct upgrade *u = &sp->upgrade;

	if (arm < 0 || team_trial >= 0 || u->verdict != UPGRADE_TRIAL ||
	    u->n[arm] >= UPGRADE_TRIAL_RUNS)
		return;
	u->us[arm][u->n[arm]++] = us;
	if (u->n[0] == UPGRADE_TRIAL_RUNS && u->n[1] == UPGRADE_TRIAL_RUNS)
		verdict(sp);
}

/*
 * A quick tier's compile failed in a way the unrolled loop may not: the body
 * and its carry were fine in the eager dry run (BODY_ERROR and
 * CARRY_MISMATCH come before any lowering, and say the same of both), and
 * the daemon is not stopping.  A MISCOMPILE is a verdict already: the worker
 * rebuilt the graph once before giving it (build_placed), and no third build
 * is tried.
 */
bool tier_lowering_failed(const struct proto_err *e)
{
	return e->code != PROTO_E_BODY_ERROR && e->code != PROTO_E_CARRY_MISMATCH &&
	       e->code != PROTO_E_SHUTTING_DOWN && e->code != PROTO_E_MISCOMPILE;
}
