/*
 * main.c - torchloopd's entry point: settings, the thread-pool size, the
 * loop, and the exit code.
 */
#include "daemon.h"

#include "log.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	static struct daemon d;
	char pool[32];
	int rc = config_parse(&d.cfg, argc, argv);

	if (rc != 0)
		return rc > 0 ? 0 : 2;
	signal(SIGPIPE, SIG_IGN);
	/* before any thread exists, so that every thread inherits the mask and
	 * only the daemon's signal thread takes them (sigthread.c) */
	if (daemon_block_signals(&d) != 0)
		return 1;
	/* graph runs + cache I/O and dlopen, which must not queue behind runs */
	snprintf(pool, sizeof pool, "%lld", d.cfg.threads + 2);
	setenv("UV_THREADPOOL_SIZE", pool, 1);
	/* Generated graphs check their inputs' shapes against the ones they were
	 * compiled for only with this set (read once per graph, at its first run).
	 * The daemon checks requests against the signature itself; this catches an
	 * artifact that is not the graph its metadata says (results are written
	 * into buffers the daemon lays out from the metadata). */
	setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 1);
	d.dispatch = ops_dispatch;
	d.release_held = ops_release_held;
	if (daemon_start(&d) != 0)
		d.exit_code = 1;
	daemon_run(&d);
	/* what is left never held the loop: the signal thread's handle and the
	 * exit timer (both unref'd) */
	sigthread_stop(&d.sig);
	if (d.exit_timer.type == UV_TIMER && !uv_is_closing((uv_handle_t *)&d.exit_timer))
		uv_close((uv_handle_t *)&d.exit_timer, NULL);
	uv_run(d.loop, UV_RUN_DEFAULT);
	rc = uv_loop_close(d.loop);
	if (rc != 0)
		log_warn("loop closed with handles open: %s", uv_strerror(rc));
	log_info("stopped (exit %d)", d.exit_code);
	/*
	 * Everything of ours is closed and freed above.  Skip the exit-time
	 * destructors of libtorch and its runtimes: they join pools of threads
	 * we never own and have hung under load; valgrind and ASan still see
	 * the process end.
	 */
	fflush(NULL);
	_exit(d.exit_code);
}
