/*
 * busypoll.h - adaptive busy polling: wait for a socket by polling it for a
 * while before sleeping.
 *
 * On a virtual machine a sleeping thread costs 25-60 µs to wake (an
 * interprocessor interrupt through the host), more than a small scan's
 * whole work.  A waiter that polls instead finds the bytes as they land.
 * The window adapts much as the kernel's haltpoll governor does: a wait
 * that polling covered keeps it; a sleep that ended within BUSYPOLL_GROW
 * times `max_ns` grows it (the bytes came soon after polling gave up); a
 * longer sleep shrinks it (polling would not have helped: long graph runs, a
 * client busy between requests), down to 0, where every wait sleeps until a
 * short one grows it again.  The slack matters: a sleeping peer's wake-up
 * costs about a window itself, so with both sides at 0 no wait is ever
 * shorter than the maximum, and a grow test at 1x never recovers (measured:
 * the Python client stuck at 51-111 µs per small scan in some runs).
 * Used by the daemon's loop (daemon_run in daemon/server/daemon.c), libtorchloop
 * (client/torchloop.c) and the Python client's C codec
 * (client/python/torchloop/_fast.c).  Header-only: _fast.c is built by
 * setuptools from its own directory.
 */
#ifndef TORCHLOOP_BUSYPOLL_H
#define TORCHLOOP_BUSYPOLL_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#define BUSYPOLL_START_NS 10000u /* the first window after a shrink to 0 */
#define BUSYPOLL_GROW     4      /* a sleep this many windows long or shorter grows it */
/* Clients poll only for the replies of requests smaller than this (tensor
 * bytes, inline or by reference): a larger request's run is long, or has an
 * OpenMP team whose workers need the core a polling client would hold
 * (measured: N = 4096, T = 16 -- 544 KiB -- through shared memory, 126 µs p50
 * with the client polling, 58 µs without).  Below it a memory-bound graph
 * runs in tens of µs on the loop thread, with one OpenMP thread
 * (--inline-run-us): N = 4096, T = 1 (exactly 64 KiB of tensors) took
 * 32-37 µs through shared memory with a 64 KiB limit (no polling) and
 * 11-13 µs with this one (docs/performance.md). */
#define BUSYPOLL_MAX_REQUEST (256u << 10)

struct busypoll {
	uint64_t max_ns;     /* 0: never poll */
	uint64_t window_ns;  /* this wait's polling budget, <= ceiling_ns */
	uint64_t ceiling_ns; /* how far a window may stretch (busypoll_stretch) */
};

/* The clients' clock for windows (the daemon's loop uses uv_hrtime). */
static inline uint64_t busypoll_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void busypoll_init(struct busypoll *b, uint64_t max_ns)
{
	b->max_ns = max_ns;
	b->window_ns = max_ns;
	b->ceiling_ns = max_ns;
}

/*
 * Lets the window stretch past max_ns, up to BUSYPOLL_GROW * max_ns, to the
 * last short sleep's length and a quarter.  A peer whose own wait ended in a
 * sleep answers one wake-up late; when a wake-up costs more than max_ns both
 * sides miss every time and stay there (measured on this VM, 6 interleaved
 * rounds: the Python client's N = 4, T = 128 scan 130 µs p50 against 22-27 µs
 * once a window covered the other side's wake-up; libtorchloop's lone client
 * stuck at 5 200 scans/s in 1 run of 4, against 88 000-109 000).  The
 * daemon's loop and the Python client (a solver's one connection) stretch;
 * libtorchloop does not: with it stretching too, 32 clients on 2 cores served
 * 14 % fewer scans per second.
 */
static inline void busypoll_stretch(struct busypoll *b)
{
	b->ceiling_ns = BUSYPOLL_GROW * b->max_ns;
}

/* After a wait: polled says whether polling found the bytes; waited_ns is the
 * whole wait (polling and sleep) when it did not. */
static inline void busypoll_update(struct busypoll *b, bool polled, uint64_t waited_ns)
{
	if (polled || b->max_ns == 0)
		return;
	if (waited_ns <= BUSYPOLL_GROW * b->max_ns) {
		uint64_t want = waited_ns + waited_ns / 4;

		b->window_ns = b->window_ns ? 2 * b->window_ns : BUSYPOLL_START_NS;
		if (b->window_ns > b->max_ns)
			b->window_ns = b->max_ns;
		if (b->ceiling_ns > b->max_ns && want > b->window_ns) /* busypoll_stretch */
			b->window_ns = want < b->ceiling_ns ? want : b->ceiling_ns;
	} else {
		b->window_ns /= 2;
		if (b->window_ns < BUSYPOLL_START_NS)
			b->window_ns = 0;
	}
}

#endif
