/*
 * team.h - a specialization's OpenMP team per run (team.c).
 *
 * Whether a graph gains from more threads depends on the graph: a
 * bandwidth-bound sum over 8 MiB runs faster on every core, a small RNN whose
 * dozens of tiny kernels each open a parallel region runs 14x slower on two
 * (each region wakes a sleeping thread).  So each specialization tries both on
 * its first runs -- its share of the cores (cores / threads) and all of them
 * -- and keeps the faster.
 *
 * A kept team of every core can still meet a core that another process holds:
 * a client whose own torch just summed a result keeps a libgomp worker
 * spinning for milliseconds, and the team then waits for a scheduler slice at
 * every barrier (an ema forward and backward of 0.33 ms in process took
 * 2.8 ms through the daemon).  When the average of that team's runs (an
 * exponential one, so that one slow run among fast ones is not enough)
 * exceeds TEAM_CONTENDED times the fastest one-core run, the run that made it
 * so is counted as contended: the specialization's runs then take the
 * one-core share until calm_at, a wait that starts at TEAM_WAIT_MS and
 * doubles (to TEAM_WAIT_MAX_MS) while the contention goes on.  (Against the
 * fastest one-core run itself, or 1.5 times it, runs that the clients' own busy
 * polls slowed sent an ema forward of 73 us to one thread, 152 us; the
 * contention this is for stalls runs by milliseconds.)
 *
 * The trials themselves can meet such a core, or the compile worker building
 * the specialization's partner graph beside its first runs: a kept share
 * tries every core once every TEAM_RETRY_MS, for TEAM_RETRY_RUNS runs in a
 * row, and takes it when one of them beats the share's fastest.  One run
 * alone never did: after a second without a run of the team, its libgomp
 * workers sleep, and waking them at each parallel region made the lone retry
 * of an ema [4096] T = 16 forward slower than one thread (the bench's row
 * stayed on one thread: 266 us p50 against 98 in process; 163 with the team,
 * pypath.py --rows).
 */
#ifndef TORCHLOOP_TEAM_H
#define TORCHLOOP_TEAM_H

#include <stdbool.h>
#include <stdint.h>

#define TEAM_TRIES       8
#define TEAM_WAIT_MS     10
#define TEAM_WAIT_MAX_MS 1000
#define TEAM_RETRY_MS    1000
#define TEAM_RETRY_RUNS  4
#define TEAM_CONTENDED   4.0

struct team_choice {
	int team; /* 0 while trying */
	unsigned tries;
	double best_us[2];   /* fastest run with a one-core share / all cores */
	uint64_t calm_at;    /* time (ms) until which runs keep to the share */
	uint32_t backoff_ms; /* the last such wait, 0 after a run at full speed */
	uint64_t retry_at;   /* a kept share: time (ms) of its next trial of every core */
	unsigned retry_left; /* runs of every core left in the trial going on */
	double cores_ema_us; /* a kept team of every core: its runs' average (0: none yet) */
};

/* The team of a run starting at now_ms (cores: every core, share: the
 * one-core share, cores / threads); *trial: 0 or 1 for a trial run (the
 * share's, every core's; a kept share's retry is 1), else -1. */
int team_choose(struct team_choice *t, int cores, int share, uint64_t now_ms, int *trial);

/* What a run of team (trial as team_choose said) measured, done at now_ms;
 * true when it counted as contended. */
bool team_measured(struct team_choice *t, int cores, int share, int team, int trial, double us,
                   uint64_t now_ms);

#endif
