/*
 * sigthread.h - the daemon's signals, taken by one thread with sigwait(2) and
 * handed to the loop.  See sigthread.c.
 */
#ifndef TORCHLOOP_SIGTHREAD_H
#define TORCHLOOP_SIGTHREAD_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <uv.h>

typedef void sigthread_cb(void *arg, int signum);

struct sigthread {
	sigset_t set;
	pthread_t tid;
	uv_async_t async;
	atomic_ulong pending; /* bit n: signal n arrived since the loop last looked */
	atomic_bool quit;
	bool running;
	sigthread_cb *cb;
	void *arg;
};

/* Blocks set in the calling thread.  main() calls it before any thread
 * exists, so every thread (the libuv pool, OpenMP's teams, libtorch's) inherits
 * the mask: none of them can be picked to take a process-directed signal. */
int sigthread_block(const sigset_t *set);
/* Starts the thread that sigwaits for s->set (blocked already; it holds
 * SIGTERM); cb runs on the loop. */
int sigthread_start(struct sigthread *s, uv_loop_t *loop, sigthread_cb *cb, void *arg);
/* The signals keep coming to cb, but no longer hold the loop open. */
void sigthread_unref(struct sigthread *s);
/* Joins the thread and closes the loop's handle.  Signals arriving after it
 * stay pending (blocked everywhere) until the process exits. */
void sigthread_stop(struct sigthread *s);

#endif
