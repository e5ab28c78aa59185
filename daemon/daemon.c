/*
 * daemon.c - start-up, readiness, signals and shutdown.  Loop thread.
 *
 * Start: open the cache (refusing a noexec mount), listen, spawn the
 * compile worker, then (worker said hello) run the probe, register the
 * adapters directory and declare ready.  SIGHUP reloads the adapters
 * directory.  SIGTERM/SIGINT (or the shutdown op): stop accepting, let
 * in-flight requests finish for up to drain-timeout seconds, answer what is
 * left with SHUTTING_DOWN, remove the socket and let the loop run dry.
 */
#include "daemon.h"

#include "log.h"
#include "sha256.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void probe_start(struct daemon *d, void (*done)(struct daemon *d, const struct proto_err *err));
int sd_glue_init(struct daemon *d);
void sd_glue_notify(struct daemon *d, const char *state);
void sd_glue_stop(struct daemon *d);

static void finish_shutdown(struct daemon *d)
{
	static bool done;

	if (done)
		return;
	done = true;
	log_info("stopping: closing connections and the compile worker");
	uv_timer_stop(&d->drain_timer);
	uv_close((uv_handle_t *)&d->drain_timer, NULL);
	uv_close((uv_handle_t *)&d->sigterm, NULL);
	uv_close((uv_handle_t *)&d->sigint, NULL);
	uv_close((uv_handle_t *)&d->sighup, NULL);
	/* with the handles gone, a repeated SIGTERM must not kill the clean-up;
	 * the drain is bounded by drain-timeout and systemd's stop timeout */
	signal(SIGTERM, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	if (d->test_hooks)
		uv_close((uv_handle_t *)&d->sigusr2, NULL);
	sd_glue_stop(d);
	if (d->compiler)
		compiler_stop(d->compiler);
	conns_close_all(d);
	registry_clear(d);
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
	d->ready = false;
	log_info("shutting down (%s); %u requests in flight", why, d->inflight);
	sd_glue_notify(d, "STOPPING=1");
	server_close(d);
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

static void on_signal(uv_signal_t *s, int signum)
{
	struct daemon *d = s->data;

	if (signum == SIGUSR2) {
		/* test hook: a stalled loop must stop the watchdog pings */
		log_warn("test hook: stalling the event loop for 3 s");
		sleep(3);
		return;
	}
	if (signum == SIGHUP) {
		if (d->shutting_down)
			return;
		sd_glue_notify(d, "RELOADING=1");
		if (d->cfg.adapters_dir[0]) {
			log_info("SIGHUP: reloading %s", d->cfg.adapters_dir);
			registry_load_dir(d, d->cfg.adapters_dir, true);
		} else {
			log_info("SIGHUP: no --adapters directory to reload");
		}
		sd_glue_notify(d, "READY=1");
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
	snprintf(status, sizeof status, "READY=1\nSTATUS=ready: %u adapters", d->reg.count);
	sd_glue_notify(d, status);
	log_info("ready: %u adapters, torch %s", d->reg.count, compiler_info(d->compiler)->torch);
	if (d->on_ready)
		d->on_ready(d);
}

static void prewarmed(struct daemon *d)
{
	if (--d->pending_loads == 0 && !d->ready && !d->shutting_down) {
		log_info("preloaded adapters' graphs loaded from the cache (%u)", specs_loaded(d));
		declare_ready(d);
	}
}

static void probe_done(struct daemon *d, const struct proto_err *err)
{
	if (err != NULL) {
		fatal(d, "start-up probe failed", err);
		return;
	}
	log_info("probe: compile, cache and run work");
	if (d->cfg.adapters_dir[0] && registry_load_dir(d, d->cfg.adapters_dir, false) != 0)
		log_warn("some adapter files failed to load; see above");
	/* graphs these adapters had before a restart load before we say ready */
	d->pending_loads = 1;
	for (struct adapter *a = d->reg.head; a; a = a->next)
		d->pending_loads += specs_prewarm(d, a, prewarmed);
	prewarmed(d);
}

static void worker_ready(struct compiler *c, const struct proto_err *err)
{
	struct daemon *d = compiler_data(c);

	if (d->shutting_down)
		return;
	if (err != NULL) {
		fatal(d, "compile worker", err);
		return;
	}
	d->worker_ok = true;
	log_info("compile worker ready: torch %s", compiler_info(c)->torch);
	if (d->cfg.probe)
		probe_start(d, probe_done);
	else
		probe_done(d, NULL);
}

/* The ISA flags Inductor specialises code for: part of every cache key. */
static void read_isa(struct daemon *d)
{
	static const char *const flags[] = {" avx2",        " avx512f",  " avx512bw", " avx512vl",
	                                    " avx512_bf16", " amx_tile", " fma",      " sve"};
	FILE *f = fopen("/proc/cpuinfo", "re");
	char line[8192];

	snprintf(d->isa, sizeof d->isa, "isa:");
	while (f && fgets(line, sizeof line, f)) {
		if (strncmp(line, "flags", 5) != 0)
			continue;
		for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
			char pat[32];
			snprintf(pat, sizeof pat, "%s ", flags[i]);
			if (strstr(line, pat))
				strncat(d->isa, flags[i], sizeof d->isa - strlen(d->isa) - 1);
		}
		break;
	}
	if (f)
		fclose(f);
}

int daemon_start(struct daemon *d)
{
	struct proto_err err;
	uint64_t size;

	d->started = now_seconds();
	d->loop = uv_default_loop();
	log_threshold = (enum log_level)d->cfg.log_level;
	read_isa(d);
	if (sha256_file(d->cfg.worker, d->worker_sha, &size) != 0) {
		log_error("compile worker script %s: cannot read it", d->cfg.worker);
		return -1;
	}
	if (cache_open(&d->cache, d->cfg.cache_dir, &err) != 0) {
		log_error("cache: %s", err.message);
		return -1;
	}
	uv_timer_init(d->loop, &d->drain_timer);
	d->drain_timer.data = d;
	uv_signal_init(d->loop, &d->sigterm);
	uv_signal_init(d->loop, &d->sigint);
	uv_signal_init(d->loop, &d->sighup);
	d->sigterm.data = d->sigint.data = d->sighup.data = d;
	uv_signal_start(&d->sigterm, on_signal, SIGTERM);
	uv_signal_start(&d->sigint, on_signal, SIGINT);
	uv_signal_start(&d->sighup, on_signal, SIGHUP);
	d->test_hooks =
	    getenv("TORCHLOOPD_TEST_HOOKS") && strcmp(getenv("TORCHLOOPD_TEST_HOOKS"), "1") == 0;
	if (d->test_hooks) {
		uv_signal_init(d->loop, &d->sigusr2);
		d->sigusr2.data = d;
		uv_signal_start(&d->sigusr2, on_signal, SIGUSR2);
	}
	if (sd_glue_init(d) != 0 || (!d->server_open && server_listen(d, &err) != 0)) {
		if (!d->server_open || err.message[0])
			log_error("%s", err.message);
		finish_shutdown(d);
		return -1;
	}
	log_info("cache %s", d->cfg.cache_dir);
	d->compiler = compiler_start(d->loop, d->cfg.python, d->cfg.worker,
	                             (double)d->cfg.compile_timeout, worker_ready, d);
	return d->compiler ? 0 : -1;
}
