/*
 * compiler_stats.c - what the compile service reports (health, stats,
 * describe): its counters, state and lanes, read from struct compiler
 * (compiler_pool.h).  Loop thread.
 */
#include "compiler_pool.h"

#include <string.h>

void *compiler_data(const struct compiler *c)
{
	return c->data;
}
const struct worker_info *compiler_info(const struct compiler *c)
{
	return &c->info;
}
uint64_t compiler_restarts(const struct compiler *c)
{
	return c->restarts;
}
pid_t compiler_pid(const struct compiler *c)
{
	return PRIMARY(c)->p ? wproc_pid(PRIMARY(c)->p) : 0;
}
unsigned compiler_start_failures(const struct compiler *c)
{
	return c->start_failures;
}
uint64_t compiler_orphans_killed(const struct compiler *c)
{
	return c->orphans_killed;
}
uint64_t compiler_recycled(const struct compiler *c)
{
	return c->recycled;
}

const char *compiler_state(const struct compiler *c)
{
	if (compiler_alive(c))
		return "ok";
	return c->start_failures > 0 ? "backoff" : "starting";
}

void compiler_lane_stats(const struct compiler *c, enum compiler_lane lane, struct lane_stats *out)
{
	const struct lane *l = &c->lanes[lane];

	memset(out, 0, sizeof *out);
	out->max = l->max;
	out->jobs = l->jobs;
	out->preempted = l->preempted;
	out->promoted = l->promoted;
	for (const struct compile_job *j = l->head; j; j = j->next)
		out->queued++;
	for (unsigned i = 0; i < l->max; i++) {
		out->workers += l->slots[i].p != NULL;
		out->busy += l->slots[i].current != NULL;
		out->paused |= l->slots[i].paused;
	}
}

unsigned compiler_queue_length(const struct compiler *c)
{
	unsigned n = 0;
	struct lane_stats st;

	for (int k = 0; k < COMPILER_LANES; k++) {
		compiler_lane_stats(c, (enum compiler_lane)k, &st);
		n += st.queued + st.busy;
	}
	return n;
}
