/*
 * daemon.c - start-up, readiness, signals and shutdown.  Loop thread.
 *
 * Start: open the cache (refusing a noexec mount), listen, spawn the
 * compile worker and, meanwhile, register what --state-dir and --adapters
 * hold (files: no worker needed); once the worker said hello, run the
 * probe, then load the adapters' cached graphs and declare ready.  Requests
 * that need the adapters wait for them (ops.c), so a client that retried
 * across a restart never sees NOT_FOUND.  SIGHUP reloads the adapters
 * directory.  SIGTERM/SIGINT (or the shutdown op): stop accepting, let
 * in-flight requests finish for up to drain-timeout seconds, answer what is
 * left with SHUTTING_DOWN, remove the socket and let the loop run dry.
 */
#include "daemon.h"

#include "busypoll.h"
#include "log.h"

#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define EXIT_GRACE_MS 5000
#define FD_RESERVE    64 /* listening socket, worker pipes, cache files, dlopen, logs */

void probe_start(struct daemon *d, void (*done)(struct daemon *d, const struct proto_err *err));
int systemd_init(struct daemon *d);
void systemd_notify(struct daemon *d, const char *state);
void systemd_stop(struct daemon *d);

static void on_exit_grace(uv_timer_t *t)
{
	struct daemon *d = t->data;

	log_error("thread-pool work still pending %d s after shutdown began; exiting without it",
	          EXIT_GRACE_MS / 1000);
	fflush(NULL);
	_exit(d->exit_code);
}

static void finish_shutdown(struct daemon *d)
{
	static bool done;

	if (done)
		return;
	done = true;
	log_info("stopping: closing connections and the compile worker");
	uv_timer_stop(&d->drain_timer);
	uv_close((uv_handle_t *)&d->drain_timer, NULL);
	uv_timer_stop(&d->pool_timer);
	uv_close((uv_handle_t *)&d->pool_timer, NULL);
	/* A pool thread stuck in a graph run (or a disk that hangs) would keep the
	 * loop alive for ever: past the grace period, exit without it. */
	uv_timer_start(&d->exit_timer, on_exit_grace, EXIT_GRACE_MS, 0);
	uv_unref((uv_handle_t *)&d->exit_timer);
	/* signals still arrive (and are ignored: shutting_down) but no longer
	 * hold the loop; main() stops the thread once the loop is done */
	sigthread_unref(&d->sig);
	systemd_stop(d);
	if (d->compiler)
		compiler_stop(d->compiler);
	graphs_stop_runs(&d->graphs);
	conns_close_all(d);
	graphs_close(&d->graphs);
}

static void on_drain_timeout(uv_timer_t *t)
{
	struct daemon *d = t->data;

	log_warn("drain timeout (%lld s) with %u requests in flight", d->cfg.drain_timeout,
	         d->inflight);
	finish_shutdown(d);
}

void daemon_begin_shutdown(struct daemon *d, const char *why)
{
	if (d->shutting_down)
		return;
	d->shutting_down = true;
	d->graphs.stopping = true;
	d->ready = false;
	log_info("shutting down (%s); %u requests in flight", why, d->inflight);
	systemd_notify(d, "STOPPING=1");
	listen_close(d);
	d->release_held(d); /* refused: SHUTTING_DOWN */
	if (d->inflight == 0)
		finish_shutdown(d);
	else
		uv_timer_start(&d->drain_timer, on_drain_timeout,
		               (uint64_t)d->cfg.drain_timeout * 1000, 0);
}

void daemon_request_done(struct daemon *d)
{
	d->inflight--;
	if (d->shutting_down && d->inflight == 0)
		finish_shutdown(d);
}

static void start_reload(struct daemon *d);

static void reloaded(struct daemon *d, int failed)
{
	d->reloading = false;
	log_info("SIGHUP: reload done: %u adapters, %d file(s) failed", d->graphs.reg.count,
	         failed);
	if (d->reload_again && !d->shutting_down) {
		d->reload_again = false;
		start_reload(d);
		return;
	}
	if (!d->shutting_down)
		systemd_notify(d, "READY=1");
}

static void start_reload(struct daemon *d)
{
	if (d->reloading) {
		d->reload_again = true; /* once the load in flight is done */
		return;
	}
	systemd_notify(d, "RELOADING=1");
	if (d->cfg.adapters_dir[0] == '\0') {
		log_info("SIGHUP: no --adapters directory to reload");
		systemd_notify(d, "READY=1");
		return;
	}
	log_info("SIGHUP: reloading %s", d->cfg.adapters_dir);
	d->reloading = true;
	if (registry_load_dir(d, d->cfg.adapters_dir, true, reloaded) != 0)
		reloaded(d, 1);
}

#ifdef TORCHLOOPD_TEST_HOOKS
/*
 * Test hooks (build/torchloopd-testhooks only): SIGUSR2 stalls the event loop
 * for 3 s (the watchdog test), SIGUSR1 the graph runner and a pool thread
 * for 4 s (health's "pool": "stalled" test), as a graph run or compile of seconds
 * would, but for as long on every machine.
 */
static struct runner_item hook_runner_item;
static uv_work_t hook_pool_work;
static int hook_out; /* of the two: a second SIGUSR1 meanwhile does nothing */

static void hook_sleep_runner(struct runner_item *it)
{
	(void)it;
	sleep(4);
}

static void hook_sleep_pool(uv_work_t *w)
{
	(void)w;
	sleep(4);
}

static void hook_runner_done(struct runner_item *it)
{
	(void)it;
	hook_out--;
}

static void hook_pool_done(uv_work_t *w, int status)
{
	(void)w;
	(void)status;
	hook_out--;
}

static bool test_hook(struct daemon *d, int signum)
{
	if (signum == SIGUSR2) {
		log_warn("test hook: stalling the event loop for 3 s");
		sleep(3);
		return true;
	}
	if (signum != SIGUSR1)
		return false;
	if (hook_out == 0 && d->graphs.runner.started) {
		hook_out = 2;
		log_warn("test hook: stalling the graph runner and a pool thread for 4 s");
		hook_runner_item.work = hook_sleep_runner;
		hook_runner_item.done = hook_runner_done;
		runner_submit(&d->graphs.runner, &hook_runner_item);
		if (uv_queue_work(d->loop, &hook_pool_work, hook_sleep_pool, hook_pool_done) != 0)
			hook_out--;
	}
	return true;
}
#endif

static void on_signal(void *arg, int signum)
{
	struct daemon *d = arg;

#ifdef TORCHLOOPD_TEST_HOOKS
	if (test_hook(d, signum))
		return;
#endif
	if (signum == SIGHUP) {
		if (!d->shutting_down)
			start_reload(d);
		return;
	}
	daemon_begin_shutdown(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void fatal(struct daemon *d, const char *what, const struct proto_err *err)
{
	log_error("%s: %s", what, err->message);
	d->exit_code = 1;
	daemon_begin_shutdown(d, "start-up failed");
}

static void declare_ready(struct daemon *d)
{
	char status[128];

	d->ready = true;
	snprintf(status, sizeof status, "READY=1\nSTATUS=ready: %u adapters", d->graphs.reg.count);
	systemd_notify(d, status);
	log_info("ready: %u adapters, torch %s", d->graphs.reg.count,
	         compiler_info(d->compiler)->torch);
	if (d->on_ready)
		d->on_ready(d);
}

static void one_prewarmed(struct daemon *d)
{
	if (--d->pending_loads == 0 && !d->ready && !d->shutting_down) {
		log_info("preloaded adapters' graphs loaded from the cache (%u)",
		         graphs_loaded(&d->graphs));
		declare_ready(d);
	}
}

/* graphs_prewarm's callback: the graph layer hands back its struct graphs */
static void prewarmed(struct graphs *g)
{
	one_prewarmed((struct daemon *)((char *)g - offsetof(struct daemon, graphs)));
}

/* Registrations restored and the worker's target known (cache keys hold it):
 * the adapters' graphs from before a restart load before we say ready, and
 * the requests held meanwhile go on (behind those loads). */
static void open_adapters(struct daemon *d)
{
	if (!d->restored || !d->probed || d->adapters_open || d->shutting_down)
		return;
	d->pending_loads = 1;
	for (struct adapter *a = d->graphs.reg.head; a; a = a->next)
		d->pending_loads += graphs_prewarm(&d->graphs, a, prewarmed);
	d->adapters_open = true;
	if (d->held_n)
		log_info("%u request(s) held during the start-up go on", d->held_n);
	d->release_held(d);
	one_prewarmed(d);
}

static void adapters_loaded(struct daemon *d, int failed)
{
	if (d->shutting_down)
		return;
	if (failed)
		log_warn("%d adapter file(s) failed to load; see above", failed);
	d->restored = true;
	log_info("registrations restored: %u adapters", d->graphs.reg.count);
	d->release_held(d); /* list and describe go on now */
	open_adapters(d);
}

/* Persisted registrations first, then --adapters: an operator's file wins. */
static void restored(struct daemon *d, int failed)
{
	if (d->shutting_down)
		return;
	if (failed)
		log_warn("%d persisted registration(s) in %s/registered failed to load", failed,
		         d->cfg.state_dir);
	if (d->cfg.adapters_dir[0] == '\0')
		adapters_loaded(d, 0);
	else if (registry_load_dir(d, d->cfg.adapters_dir, false, adapters_loaded) != 0)
		adapters_loaded(d, 1);
}

static void probe_done(struct daemon *d, const struct proto_err *err)
{
	if (err != NULL) {
		fatal(d, "start-up probe failed", err);
		return;
	}
	if (d->cfg.probe)
		log_info("probe: compile, cache and run work");
	d->probed = true;
	open_adapters(d);
}

static void worker_up(struct daemon *d, const struct proto_err *err)
{
	if (d->shutting_down)
		return;
	if (err != NULL) {
		fatal(d, "compile worker", err);
		return;
	}
	d->worker_ok = true;
	log_info("compile worker ready: torch %s, target %s", compiler_info(d->compiler)->torch,
	         compiler_info(d->compiler)->isa);
	if (d->cfg.probe)
		probe_start(d, probe_done);
	else
		probe_done(d, NULL);
}

static void worker_ready(struct compiler *c, const struct proto_err *err)
{
	struct daemon *d = compiler_data(c);

	if (err == NULL) {
		/* what the worker generates code for is part of every cache key */
		strncat(d->isa, ";worker:", sizeof d->isa - strlen(d->isa) - 1);
		strncat(d->isa, compiler_info(c)->isa, sizeof d->isa - strlen(d->isa) - 1);
	}
	d->worker_up(d, err);
}

/*
 * Every connection is a descriptor, plus one memfd it may have passed and not
 * yet attached, plus the descriptors of one read in flight (libuv takes up to
 * 64 per recvmsg; conn.c closes strays at once): raise the soft
 * RLIMIT_NOFILE to the hard one if needed, and refuse to start when
 * --max-connections cannot fit.
 */
#define FD_PER_READ 64

static int check_fd_limit(const struct config *cfg)
{
	struct rlimit rl;
	rlim_t need =
	    2 * (rlim_t)cfg->max_connections + FD_RESERVE + FD_PER_READ + 2 * (rlim_t)cfg->threads;

	if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
		return 0;
	if (rl.rlim_cur < need && rl.rlim_max > rl.rlim_cur) {
		rl.rlim_cur = rl.rlim_max < need ? rl.rlim_max : need;
		setrlimit(RLIMIT_NOFILE, &rl);
		getrlimit(RLIMIT_NOFILE, &rl);
	}
	if (rl.rlim_cur >= need)
		return 0;
	log_error("--max-connections=%lld needs %llu file descriptors but the limit is %llu "
	          "(hard %llu): lower --max-connections or raise LimitNOFILE / ulimit -n",
	          cfg->max_connections, (unsigned long long)need, (unsigned long long)rl.rlim_cur,
	          (unsigned long long)rl.rlim_max);
	return -1;
}

int daemon_block_signals(struct daemon *d)
{
	sigemptyset(&d->sig.set);
	sigaddset(&d->sig.set, SIGTERM);
	sigaddset(&d->sig.set, SIGINT);
	sigaddset(&d->sig.set, SIGHUP);
#ifdef TORCHLOOPD_TEST_HOOKS
	/* only in build/torchloopd-testhooks (the Makefile), never in torchloopd */
	sigaddset(&d->sig.set, SIGUSR1);
	sigaddset(&d->sig.set, SIGUSR2);
#endif
	return sigthread_block(&d->sig.set);
}

int daemon_graphs_open(struct daemon *d)
{
	struct proto_err err;

	if (worker_target_open(d) != 0)
		return -1;
	if (cache_open(&d->cache, d->cfg.cache_dir, &err) != 0) {
		log_error("cache: %s", err.message);
		return -1;
	}
	d->cache.max_bytes = d->cfg.cache_max_bytes;
	return graphs_open(&d->graphs, d->loop, &d->cfg, &d->cache, d->worker_sha, d->isa);
}

int daemon_graphs_start_worker(struct daemon *d,
                               void (*up)(struct daemon *d, const struct proto_err *err))
{
	const char *inductor = getenv("TORCHINDUCTOR_CACHE_DIR");
	char scratch_root[sizeof d->cfg.cache_dir + 8], inductor_dir[sizeof d->cfg.cache_dir + 16];
	struct compiler_opts o = {d->cfg.python, d->cfg.worker, (double)d->cfg.compile_timeout,
	                          (unsigned)d->cfg.compile_workers, worker_target_env(d)};

	/* the same directory worker_target_env names to the worker */
	snprintf(scratch_root, sizeof scratch_root, "%s/tmp", d->cfg.cache_dir);
	snprintf(inductor_dir, sizeof inductor_dir, "%s/inductor", d->cfg.cache_dir);
	o.sandbox = d->cfg.worker_sandbox;
	o.start_timeout_seconds = (double)d->cfg.worker_start_timeout;
	o.scratch_root = scratch_root;
	o.inductor_dir = inductor && *inductor ? inductor : inductor_dir;
	o.hide = worker_target_hidden(d);

	d->worker_up = up;
	d->compiler = compiler_start(d->loop, &o, worker_ready, d);
	d->graphs.compiler = d->compiler;
	return d->compiler ? 0 : -1;
}

int daemon_start(struct daemon *d)
{
	struct proto_err err;

	d->started = log_now();
	d->loop = uv_default_loop();
	log_threshold = (enum log_level)d->cfg.log_level;
	if (check_fd_limit(&d->cfg) != 0 || daemon_graphs_open(d) != 0)
		return -1;
	uv_timer_init(d->loop, &d->drain_timer);
	d->drain_timer.data = d;
	uv_timer_init(d->loop, &d->exit_timer);
	d->exit_timer.data = d;
	uv_timer_init(d->loop, &d->pool_timer);
	d->pool_timer.data = d;
	uv_timer_start(&d->pool_timer, daemon_pool_canary, 1000, 1000);
	if (sigthread_start(&d->sig, d->loop, on_signal, d) != 0) {
		finish_shutdown(d);
		return -1;
	}
	if (systemd_init(d) != 0) { /* it says why */
		finish_shutdown(d);
		return -1;
	}
	if (!d->server_open && listen_open(d, &err) != 0) {
		log_error("%s", err.message);
		finish_shutdown(d);
		return -1;
	}
	conns_start_sweep(d);
	log_info("cache %s", d->cfg.cache_dir);
	if (daemon_graphs_start_worker(d, worker_up) != 0) { /* it says why */
		/* the listener and the sweep would keep the loop for ever */
		daemon_begin_shutdown(d, "the compile service did not start");
		return -1;
	}
	/* on the pool while the worker starts; requests for them wait (ops.c) */
	if (persist_restore(d, restored) != 0)
		restored(d, 1);
	return 0;
}

/* ---- the loop ---------------------------------------------------------------
 *
 * Once every request is answered (inflight 0), the loop polls for the next
 * one (uv_run NOWAIT) for the busy-poll window before it sleeps in
 * epoll_wait: a client that sends its next request within the window finds
 * the loop awake, and neither side pays a cross-CPU wake-up (25-60 µs on a
 * VM, docs/performance.md).  The window adapts (proto/busypoll.h): the sleep
 * that follows a fruitless poll is timed to the request that ends it.  No
 * polling while requests are in flight (graph runs and compiles keep their
 * cores), while shutting down, or on one core (the poller would hold the CPU
 * its client needs).
 */

/* Polls the loop for up to budget_ns: 1 when a request arrived, 0 when none
 * did, -1 when the loop has nothing left. */
static int poll_for_request(struct daemon *d, uint64_t t0, uint64_t budget_ns)
{
	uint64_t seen = d->stats.requests;

	do {
		if (uv_run(d->loop, UV_RUN_NOWAIT) == 0)
			return -1;
		if (d->stats.requests != seen)
			return 1;
	} while (uv_hrtime() - t0 < budget_ns);
	return 0;
}

void daemon_run(struct daemon *d)
{
	struct busypoll bp;
	uint64_t seen = d->stats.requests, sleep_from = 0, runner_runs = d->graphs.runner_runs;
	bool answered = false; /* a request came since the loop last went idle */

	busypoll_init(&bp, d->cfg.cores > 1 ? (uint64_t)d->cfg.busy_poll_us * 1000 : 0);
	busypoll_stretch(&bp);
	for (;;) {
		if (answered && d->inflight == 0 && bp.max_ns > 0) {
			uint64_t t0 = uv_hrtime();
			int got = 0;

			/* after a run with an OpenMP team its workers spin on the other
			 * cores for a while, and a polling loop would leave the client no
			 * core (measured: 4-8 ms per scan instead of 0.5): sleep, and
			 * leave the window as it is */
			bool team_ran = d->graphs.runner_runs != runner_runs;

			runner_runs = d->graphs.runner_runs;
			answered = false;
			if (!team_ran && bp.window_ns > 0 && !d->shutting_down)
				got = poll_for_request(d, t0, bp.window_ns);
			if (got < 0)
				return;
			if (got > 0) {
				d->stats.busy_polled++;
				seen = d->stats.requests;
				answered = true;
				continue;
			}
			if (!team_ran)
				sleep_from = t0;
		}
		if (uv_run(d->loop, UV_RUN_ONCE) == 0)
			return;
		if (d->stats.requests != seen) {
			if (sleep_from != 0)
				busypoll_update(&bp, false, uv_hrtime() - sleep_from);
			sleep_from = 0;
			seen = d->stats.requests;
			answered = true;
		}
	}
}
