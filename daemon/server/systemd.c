/*
 * systemd.c - service-manager glue (libsystemd): socket activation,
 * readiness and status notifications, and the watchdog.  Loop thread.
 * Everything is a no-op when the daemon was not started by systemd.
 */
#include "daemon.h"

#include "log.h"

#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

static uint64_t watchdog_usec;

static void on_watchdog(uv_timer_t *t)
{
	struct daemon *d = t->data;
	char status[160];

	/* a stuck thread pool cannot serve: let the service manager restart us */
	snprintf(status, sizeof status, "%sSTATUS=%s: %u adapters, %u graphs, %u in flight",
	         d->pool_stalled ? "" : "WATCHDOG=1\n",
	         d->pool_stalled ? "thread pool stalled"
	         : d->ready      ? "ready"
	                         : "starting",
	         d->graphs.reg.count, graphs_loaded(&d->graphs), d->inflight);
	sd_notify(0, status);
}

/* Socket activation: adopt an inherited listening socket (never unlinked). */
static int adopt_socket(struct daemon *d)
{
	int n = sd_listen_fds(0);
	int rc;

	if (n <= 0)
		return 0;
	if (n > 1) {
		log_error("socket activation passed %d sockets; torchloopd expects one", n);
		return -1;
	}
	uv_pipe_init(d->loop, &d->server, 0);
	d->server.data = d;
	d->server_open = true;
	d->own_socket = false;
	rc = uv_pipe_open(&d->server, SD_LISTEN_FDS_START);
	if (rc == 0)
		listen_start(d, &rc);
	if (rc != 0) {
		log_error("cannot use the inherited socket: %s", uv_strerror(rc));
		return -1;
	}
	log_info("listening on the socket systemd passed (fd %d)", SD_LISTEN_FDS_START);
	return 0;
}

int systemd_init(struct daemon *d)
{
	int enabled = sd_watchdog_enabled(0, &watchdog_usec);

	uv_timer_init(d->loop, &d->watchdog);
	d->watchdog.data = d;
	if (enabled > 0 && watchdog_usec > 0)
		/* 45% of the interval (a little under systemd's "half") keeps every gap
		 * inside half the interval despite timer slack */
		uv_timer_start(&d->watchdog, on_watchdog, 0, watchdog_usec * 45 / 100000);
	return adopt_socket(d);
}

void systemd_notify(struct daemon *d, const char *state)
{
	(void)d;
	sd_notify(0, state);
}

void systemd_stop(struct daemon *d)
{
	uv_timer_stop(&d->watchdog);
	uv_close((uv_handle_t *)&d->watchdog, NULL);
}
