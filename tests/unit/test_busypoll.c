/*
 * test_busypoll.c - the adaptive busy-poll window (proto/busypoll.h), with
 * hand-computed windows: a wait that polling covered keeps the window, a
 * sleep that ended within 4x the maximum doubles it (from 10 µs after a
 * shrink to 0, never past the maximum), a longer sleep halves it, and below
 * 10 µs it is 0 (every wait sleeps) until a short sleep grows it again.
 * Stretched (the daemon's loop, the Python client), a window follows the
 * last short sleep's length and a quarter, up to 4x the maximum.
 */
#include "busypoll.h"

#include <criterion/criterion.h>

#define US 1000u

Test(busypoll, starts_at_the_maximum_and_keeps_it_while_polling_finds_the_bytes)
{
	struct busypoll b;

	busypoll_init(&b, 50 * US);
	cr_assert_eq(b.window_ns, 50 * US);
	for (int i = 0; i < 5; i++)
		busypoll_update(&b, true, 0);
	cr_assert_eq(b.window_ns, 50 * US);
}

Test(busypoll, long_sleeps_halve_the_window_down_to_zero)
{
	struct busypoll b;
	const uint64_t want[] = {25 * US, 12500, 0, 0};

	busypoll_init(&b, 50 * US);
	for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
		busypoll_update(&b, false, i % 2 ? 5000 * US : 201 * US); /* long graph runs */
		cr_assert_eq(b.window_ns, want[i], "after long sleep %zu: %llu ns", i + 1,
		             (unsigned long long)b.window_ns);
	}
}

Test(busypoll, short_sleeps_grow_it_back_to_the_maximum)
{
	struct busypoll b;
	const uint64_t want[] = {10 * US, 20 * US, 40 * US, 50 * US, 50 * US};

	busypoll_init(&b, 50 * US);
	b.window_ns = 0;
	for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
		busypoll_update(&b, false, i % 2 ? 50 * US : 200 * US); /* soon after the window */
		cr_assert_eq(b.window_ns, want[i], "after short sleep %zu: %llu ns", i + 1,
		             (unsigned long long)b.window_ns);
	}
}

Test(busypoll, a_maximum_of_zero_never_polls)
{
	struct busypoll b;

	busypoll_init(&b, 0);
	cr_assert_eq(b.window_ns, 0);
	busypoll_update(&b, false, 1);
	busypoll_update(&b, false, 1000 * US);
	cr_assert_eq(b.window_ns, 0);
}

Test(busypoll, a_stretched_window_covers_the_last_short_sleep_up_to_four_maximums)
{
	struct busypoll b, plain;
	/* sleeps of 120, 160, 40 and 199 µs (all within 4x 50 µs), then 300 µs */
	const uint64_t waited[] = {120 * US, 160 * US, 40 * US, 199 * US, 300 * US};
	const uint64_t want[] = {150 * US, 200 * US, 50 * US, 200 * US, 100 * US};

	busypoll_init(&b, 50 * US);
	busypoll_stretch(&b);
	busypoll_init(&plain, 50 * US);
	for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
		busypoll_update(&b, false, waited[i]);
		busypoll_update(&plain, false, waited[i]);
		cr_assert_eq(b.window_ns, want[i], "after sleep %zu: %llu ns", i + 1,
		             (unsigned long long)b.window_ns);
		cr_assert_leq(plain.window_ns, 50 * US, "unstretched, never past the maximum");
	}
	busypoll_update(&b, true, 0);
	cr_assert_eq(b.window_ns, 100 * US, "a wait that polling covered keeps it");
}
