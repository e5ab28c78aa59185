/*
 * team.c - a specialization's OpenMP team per run (team.h).  Loop thread.
 */
#include "team.h"

int team_choose(struct team_choice *t, int cores, int share, uint64_t now_ms, int *trial)
{
	*trial = -1;
	if (t->team > 0 || cores <= share)
		return t->team > share && now_ms >= t->calm_at ? t->team : share;
	*trial = (int)(t->tries++ % 2);
	return *trial ? cores : share;
}

static void tried(struct team_choice *t, int cores, int share, int trial, double us)
{
	if (t->best_us[trial] == 0 || us < t->best_us[trial])
		t->best_us[trial] = us;
	if (t->tries >= TEAM_TRIES && t->best_us[0] > 0 && t->best_us[1] > 0)
		t->team = t->best_us[1] < t->best_us[0] ? cores : share;
}

bool team_measured(struct team_choice *t, int cores, int share, int team, int trial, double us,
                   uint64_t now_ms)
{
	if (trial >= 0) {
		if (t->team == 0)
			tried(t, cores, share, trial, us);
		return false;
	}
	if (team <= share || t->best_us[0] <= 0)
		return false;
	if (us <= 2 * t->best_us[0]) {
		t->backoff_ms = 0;
		return false;
	}
	t->backoff_ms = t->backoff_ms ? 2 * t->backoff_ms : TEAM_WAIT_MS;
	if (t->backoff_ms > TEAM_WAIT_MAX_MS)
		t->backoff_ms = TEAM_WAIT_MAX_MS;
	t->calm_at = now_ms + t->backoff_ms;
	return true;
}
