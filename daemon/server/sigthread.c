/*
 * sigthread.c - SIGTERM, SIGINT and SIGHUP reach the daemon through one
 * thread.  Loop thread, except signal_main().
 *
 * uv_signal_t installs a process-wide handler and restores SIG_DFL when the
 * last handle for a signal closes, so a daemon that closes its signal handles
 * while shutting down has a window in which one more SIGTERM kills it (a
 * supervisor that repeats its stop request, a test harness that follows a
 * `shutdown` op with SIGTERM).  Here the disposition never changes: the
 * signals stay blocked in every thread from main() on, and a dedicated thread
 * takes them with sigwait() and wakes the loop with uv_async_send().  During
 * shutdown the loop still receives them (and ignores them); after
 * sigthread_stop() they stay pending until _exit().
 */
#include "sigthread.h"

#include "log.h"

#include <string.h>

int sigthread_block(const sigset_t *set)
{
	int rc = pthread_sigmask(SIG_BLOCK, set, NULL);

	if (rc != 0) {
		log_error("pthread_sigmask: %s", strerror(rc));
		return -1;
	}
	/* An ignored signal is discarded even while blocked, so sigwait would
	 * never see it: a daemon started from a non-interactive shell's
	 * background job inherits SIGINT ignored, a test runner may pass others
	 * on.  Blocked everywhere, SIG_DFL never runs. */
	for (int sig = 1; sig < NSIG; sig++)
		if (sigismember(set, sig) == 1)
			signal(sig, SIG_DFL);
	return 0;
}

static void *signal_main(void *arg)
{
	struct sigthread *s = arg;

	for (;;) {
		int sig = 0;

		if (sigwait(&s->set, &sig) != 0)
			continue;
		if (atomic_load(&s->quit))
			return NULL;
		if (sig > 0 && (unsigned)sig < 8 * sizeof(unsigned long)) {
			atomic_fetch_or(&s->pending, 1UL << sig);
			uv_async_send(&s->async);
		}
	}
}

static void on_async(uv_async_t *a)
{
	struct sigthread *s = a->data;
	unsigned long bits = atomic_exchange(&s->pending, 0);

	for (int sig = 1; bits != 0 && (unsigned)sig < 8 * sizeof bits; sig++)
		if (bits & (1UL << sig)) {
			bits &= ~(1UL << sig);
			s->cb(s->arg, sig);
		}
}

int sigthread_start(struct sigthread *s, uv_loop_t *loop, sigthread_cb *cb, void *arg)
{
	int rc;

	s->cb = cb;
	s->arg = arg;
	atomic_store(&s->pending, 0);
	atomic_store(&s->quit, false);
	rc = uv_async_init(loop, &s->async, on_async);
	if (rc != 0) {
		log_error("signals: uv_async_init: %s", uv_strerror(rc));
		return -1;
	}
	s->async.data = s;
	rc = pthread_create(&s->tid, NULL, signal_main, s);
	if (rc != 0) {
		log_error("signals: pthread_create: %s", strerror(rc));
		uv_close((uv_handle_t *)&s->async, NULL);
		return -1;
	}
	s->running = true;
	return 0;
}

void sigthread_unref(struct sigthread *s)
{
	if (s->running)
		uv_unref((uv_handle_t *)&s->async);
}

void sigthread_stop(struct sigthread *s)
{
	if (!s->running)
		return;
	s->running = false;
	atomic_store(&s->quit, true);
	/* directed at the thread (SIGTERM is always in the set): sigwait returns */
	pthread_kill(s->tid, SIGTERM);
	pthread_join(s->tid, NULL);
	uv_close((uv_handle_t *)&s->async, NULL);
}
