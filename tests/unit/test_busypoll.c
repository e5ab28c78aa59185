/*
 * test_busypoll.c - the adaptive busy-poll window (proto/busypoll.h), with
 * hand-computed windows: a wait that polling covered keeps the window, a
 * sleep that ended within 4x the maximum doubles it (from 10 µs after a
 * shrink to 0, never past the maximum), a longer sleep halves it, and below
 * 10 µs it is 0 (every wait sleeps) until a short sleep grows it again.
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
