/*
 * team.c - a specialization's OpenMP team per run (team.h).  Loop thread.
 */
#include "team.h"

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

int team_choose(struct team_choice *t, int cores, int share, uint64_t now_ms, int *trial)
{
	*trial = -1;
	if (cores <= share)
		return share;
	if (t->team == 0) {
		*trial = (int)(t->tries++ % 2);
		return *trial ? cores : share;
	}
	if (t->team == share) {
		if (t->retry_left == 0) {
			if (now_ms < t->retry_at)
				return share;
			t->retry_at = now_ms + TEAM_RETRY_MS;
			t->retry_left = TEAM_RETRY_RUNS;
		}
		t->retry_left--;
		*trial = 1;
		return cores;
	}
	return now_ms >= t->calm_at ? t->team : share;
}

static void tried(struct team_choice *t, int cores, int share, int trial, double us,
                  uint64_t now_ms)
{
	if (t->team == share) { /* a kept share's retry of every core */
		if (trial == 1 && us < t->best_us[0]) {
			t->team = cores;
			t->best_us[1] = us;
		}
		return;
	}
	if (t->best_us[trial] == 0 || us < t->best_us[trial])
		t->best_us[trial] = us;
	if (t->tries >= TEAM_TRIES && t->best_us[0] > 0 && t->best_us[1] > 0) {
		t->team = t->best_us[1] < t->best_us[0] ? cores : share;
		t->retry_at = now_ms + TEAM_RETRY_MS;
	}
}

bool team_measured(struct team_choice *t, int cores, int share, int team, int trial, double us,
                   uint64_t now_ms)
{
	if (trial >= 0) {
		if (t->team != cores)
			tried(t, cores, share, trial, us, now_ms);
		return false;
	}
	if (team <= share || t->best_us[0] <= 0)
		return false;
	t->cores_ema_us = t->cores_ema_us > 0 ? 0.75 * t->cores_ema_us + 0.25 * us : us;
	if (t->cores_ema_us <= TEAM_CONTENDED * t->best_us[0]) {
		t->backoff_ms = 0;
		return false;
	}
	t->cores_ema_us = 0; /* the next runs of every core start it afresh */
	t->backoff_ms = t->backoff_ms ? 2 * t->backoff_ms : TEAM_WAIT_MS;
	if (t->backoff_ms > TEAM_WAIT_MAX_MS)
		t->backoff_ms = TEAM_WAIT_MAX_MS;
	t->calm_at = now_ms + t->backoff_ms;
	return true;
}
