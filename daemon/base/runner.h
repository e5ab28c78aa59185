/*
 * runner.h - the one thread that runs graphs with an OpenMP team.
 *
 * libgomp gives every thread that opens a parallel region its own pool of
 * workers, and once the process holds more of them than there are CPUs it
 * stops spinning at barriers ("throttled": the workers sleep in futex waits
 * and every region pays their wake-up).  Graph runs spread over libuv's pool
 * made one pool of workers per pool thread, so a run on a 2-core machine
 * woke a cold worker every time (N = 4096, T = 128: 2.5x the in-process
 * run in tests/bench/bigruns.py).  Runs with a team of more than one thread therefore all go to
 * this one thread: one master, cores - 1 workers, which spin between the runs of a busy client.
 * Runs of one thread stay on the pool (they start no team).
 *
 * Loop thread, except each item's work, which runs on the runner's thread.
 */
#ifndef TORCHLOOP_RUNNER_H
#define TORCHLOOP_RUNNER_H

#include <pthread.h>
#include <stdbool.h>
#include <uv.h>

struct runner_item {
	struct runner_item *next;
	void (*work)(struct runner_item *it); /* on the runner's thread */
	void (*done)(struct runner_item *it); /* on the loop, once work returned */
};

struct runner {
	uv_async_t async;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	/* under lock: items to run, items run (for the loop), stop */
	struct runner_item *queue, **queue_tail, *ran, **ran_tail;
	bool stop;
	/* loop thread */
	unsigned inflight; /* submitted, done not yet called: the loop stays alive */
	bool started, closing;
};

int runner_start(struct runner *r, uv_loop_t *loop);
/* Queues it (FIFO); its done is called on the loop, never from here. */
void runner_submit(struct runner *r, struct runner_item *it);
/* Stops the thread once the items submitted are done, and closes the handle
 * (the loop then has nothing of the runner's left).  Safe if never started. */
void runner_close(struct runner *r);

#endif
