/*
 * test_team.c - a specialization's OpenMP team (daemon/graph/team.c): the
 * trials keep the faster team; a kept team of every core whose runs'
 * average exceeds 4 times the fastest one-core run sends the runs to the
 * one-core share for a wait that doubles while the contention lasts (to its
 * cap), and a run at full speed afterwards ends it; a kept share tries every core again now and
 * then, a few runs in a row, and takes it when one of them wins.  Hand-computed times; 2 cores, a
 * one-core share of 1.
 */
#include "team.h"

#include <criterion/criterion.h>

#define CORES 2
#define SHARE 1

/* The TEAM_TRIES trials, alternating share / every core, with these times. */
static void trials(struct team_choice *t, double share_us, double cores_us)
{
	for (int i = 0; i < TEAM_TRIES; i++) {
		int trial;
		int team = team_choose(t, CORES, SHARE, 0, &trial);

		cr_assert_eq(trial, i % 2);
		cr_assert_eq(team, trial ? CORES : SHARE);
		cr_assert_not(
		    team_measured(t, CORES, SHARE, team, trial, trial ? cores_us : share_us, 0));
	}
}

static int chosen(struct team_choice *t, uint64_t now)
{
	int trial;
	int team = team_choose(t, CORES, SHARE, now, &trial);

	cr_assert_eq(trial, -1, "no trial once a team is kept");
	return team;
}

Test(team, the_trials_keep_the_faster_team)
{
	struct team_choice fast = {0}, slow = {0};

	trials(&fast, 100, 60);
	cr_assert_eq(fast.team, CORES);
	cr_assert_eq(chosen(&fast, 0), CORES);
	trials(&slow, 10, 40);
	cr_assert_eq(slow.team, SHARE);
	cr_assert_eq(chosen(&slow, 0), SHARE);
	/* a kept share is never contended, however slow a run */
	cr_assert_not(team_measured(&slow, CORES, SHARE, SHARE, -1, 5000, 0));
	cr_assert_eq(chosen(&slow, 0), SHARE);
}

Test(team, a_contended_run_sends_the_runs_to_the_share_for_a_doubling_wait)
{
	struct team_choice t = {0};
	uint64_t now = 1000;

	trials(&t, 100, 60); /* contended: every core's average over 400 us */
	cr_assert_not(team_measured(&t, CORES, SHARE, CORES, -1, 60, now));
	cr_assert_not(team_measured(&t, CORES, SHARE, CORES, -1, 280, now),
	              "one slow run among fast ones is not contention (average 115)");
	cr_assert_eq(chosen(&t, now), CORES);
	cr_assert(team_measured(&t, CORES, SHARE, CORES, -1, 2800, now), "average 786");
	cr_assert_eq(t.backoff_ms, TEAM_WAIT_MS);
	cr_assert_eq(chosen(&t, now), SHARE);
	cr_assert_eq(chosen(&t, now + TEAM_WAIT_MS - 1), SHARE);
	now += TEAM_WAIT_MS;
	cr_assert_eq(chosen(&t, now), CORES, "every core again once the wait is over");
	cr_assert(team_measured(&t, CORES, SHARE, CORES, -1, 2800, now),
	          "the average starts afresh after a wait: the first run is it");
	cr_assert_eq(t.backoff_ms, 2 * TEAM_WAIT_MS, "the wait doubles while it goes on");
	cr_assert_eq(chosen(&t, now + 2 * TEAM_WAIT_MS - 1), SHARE);
	for (int i = 0; i < 20; i++)
		team_measured(&t, CORES, SHARE, CORES, -1, 2800, now);
	cr_assert_eq(t.backoff_ms, TEAM_WAIT_MAX_MS, "and stops at its cap");
	cr_assert_eq(chosen(&t, now + TEAM_WAIT_MAX_MS - 1), SHARE);
	now += TEAM_WAIT_MAX_MS;
	cr_assert_eq(chosen(&t, now), CORES);
	/* the share's own runs while waiting say nothing of every core's team */
	cr_assert_not(team_measured(&t, CORES, SHARE, SHARE, -1, 2800, now));
	cr_assert_not(team_measured(&t, CORES, SHARE, CORES, -1, 70, now));
	cr_assert_eq(t.backoff_ms, 0, "a run at full speed ends it");
	cr_assert(team_measured(&t, CORES, SHARE, CORES, -1, 2800, now), "average 752");
	cr_assert_eq(t.backoff_ms, TEAM_WAIT_MS, "and the next contention starts short");
}

/* Trials at time 0 that keep the share; then its retries of every core. */
Test(team, a_kept_share_tries_every_core_again_and_takes_it_when_it_wins)
{
	struct team_choice t = {0};
	int trial;

	trials(&t, 100, 400); /* every core lost (the compile worker beside it) */
	cr_assert_eq(t.team, SHARE);
	cr_assert_eq(chosen(&t, TEAM_RETRY_MS - 1), SHARE);
	for (int i = 0; i < TEAM_RETRY_RUNS; i++) {
		cr_assert_eq(team_choose(&t, CORES, SHARE, TEAM_RETRY_MS, &trial), CORES,
		             "a retry is %d runs of every core in a row", TEAM_RETRY_RUNS);
		cr_assert_eq(trial, 1, "each a trial of every core");
		cr_assert_not(team_measured(&t, CORES, SHARE, CORES, trial, 150, TEAM_RETRY_MS));
	}
	cr_assert_eq(t.team, SHARE, "a retry slower than the share's fastest changes nothing");
	cr_assert_eq(chosen(&t, TEAM_RETRY_MS), SHARE, "and it is over");
	cr_assert_eq(chosen(&t, 2 * TEAM_RETRY_MS - 1), SHARE);
	/* the team's first run after a second asleep is slow, the next wins */
	cr_assert_eq(team_choose(&t, CORES, SHARE, 2 * TEAM_RETRY_MS, &trial), CORES);
	cr_assert_not(team_measured(&t, CORES, SHARE, CORES, trial, 150, 2 * TEAM_RETRY_MS));
	cr_assert_eq(t.team, SHARE);
	cr_assert_eq(team_choose(&t, CORES, SHARE, 2 * TEAM_RETRY_MS, &trial), CORES);
	cr_assert_not(team_measured(&t, CORES, SHARE, CORES, trial, 60, 2 * TEAM_RETRY_MS));
	cr_assert_eq(t.team, CORES, "a retry run that wins keeps every core");
	cr_assert_eq(chosen(&t, 2 * TEAM_RETRY_MS), CORES);
	cr_assert_eq(chosen(&t, 10 * TEAM_RETRY_MS), CORES, "and retries no more");
}

Test(team, one_core_never_tries)
{
	struct team_choice t = {0};
	int trial;

	cr_assert_eq(team_choose(&t, 1, 1, 0, &trial), 1);
	cr_assert_eq(trial, -1);
	cr_assert_eq(t.tries, 0);
}
