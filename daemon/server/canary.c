/*
 * canary.c - the thread pool's and the graph runner's canaries: a no-op job
 * to each every second (daemon_pool_canary, the daemon's pool timer); one
 * that waits past --pool-stall-timeout marks the daemon not ready (health)
 * and stops the watchdog.  Loop thread.
 */
#include "daemon.h"

#include "log.h"

#include <stddef.h>

static void canary_work(uv_work_t *w)
{
	(void)w;
}

/* A canary came back: the pool is running again once both have. */
static void canary_back(struct daemon *d, double sent)
{
	if (d->pool_stalled && !d->canary_out && !d->runner_canary_out) {
		log_warn("thread pool: running again after %.1f s", log_now() - sent);
		d->pool_stalled = false;
	}
}

static void canary_done(uv_work_t *w, int status)
{
	struct daemon *d = w->data;

	(void)status;
	d->canary_out = false;
	canary_back(d, d->canary_sent);
}

static void runner_canary_work(struct runner_item *it)
{
	(void)it;
}

static void runner_canary_done(struct runner_item *it)
{
	struct daemon *d = (struct daemon *)((char *)it - offsetof(struct daemon, runner_canary));

	d->runner_canary_out = false;
	canary_back(d, d->runner_canary_sent);
}

double daemon_pool_wait(const struct daemon *d)
{
	double now = log_now(), pool = d->canary_out ? now - d->canary_sent : 0,
	       runner = d->runner_canary_out ? now - d->runner_canary_sent : 0;

	return pool > runner ? pool : runner;
}

/*
 * Every second: a no-op job goes to the pool, and one to the graph runner,
 * unless the last one has not come back yet.  One that waits past
 * --pool-stall-timeout means every pool thread, or the runner, is stuck:
 * health says so (not ready) and the watchdog stops, so a service manager
 * restarts the daemon.
 */
void daemon_pool_canary(uv_timer_t *t)
{
	struct daemon *d = t->data;

	if (!d->runner_canary_out && d->graphs.runner.started && !d->graphs.runner.closing) {
		d->runner_canary_out = true;
		d->runner_canary_sent = log_now();
		d->runner_canary.work = runner_canary_work;
		d->runner_canary.done = runner_canary_done;
		runner_submit(&d->graphs.runner, &d->runner_canary);
	}
	if (!d->canary_out) {
		d->canary_out = true;
		d->canary_sent = log_now();
		d->canary.data = d;
		if (uv_queue_work(d->loop, &d->canary, canary_work, canary_done) != 0)
			d->canary_out = false;
	}
	if (!d->pool_stalled && daemon_pool_wait(d) > (double)d->cfg.pool_stall_timeout) {
		d->pool_stalled = true;
		d->stats.pool_stalls++;
		log_error("thread pool: no thread has been free for %.0f s (over "
		          "--pool-stall-timeout=%lld): reporting not ready",
		          daemon_pool_wait(d), d->cfg.pool_stall_timeout);
	}
}
