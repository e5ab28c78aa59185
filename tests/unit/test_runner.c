/*
 * test_runner.c - the graph runner thread (daemon/base/runner.c): items run in
 * order on one thread that is not the loop's, each item's done is called on
 * the loop, the loop stays alive while items are out, and closing with items
 * still out lets them finish before the thread is joined and the handle
 * closed (the loop can then be closed).
 */
#include "runner.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define ITEMS 200

struct probe {
	struct runner_item item;
	int index;
	pthread_t worked_on, done_on;
	int work_seq, done_seq;
	long sleep_ms;
};

static atomic_int work_seq;
static int done_seq;

static void probe_work(struct runner_item *it)
{
	struct probe *p = (struct probe *)it;

	if (p->sleep_ms) {
		struct timespec ts = {0, p->sleep_ms * 1000000L};
		nanosleep(&ts, NULL);
	}
	p->worked_on = pthread_self();
	p->work_seq = atomic_fetch_add(&work_seq, 1);
}

static void probe_done(struct runner_item *it)
{
	struct probe *p = (struct probe *)it;

	p->done_on = pthread_self();
	p->done_seq = done_seq++;
}

static void submit_all(struct runner *r, struct probe *p, int n, long sleep_ms)
{
	atomic_store(&work_seq, 0);
	done_seq = 0;
	for (int i = 0; i < n; i++) {
		p[i] = (struct probe){.index = i, .sleep_ms = sleep_ms, .done_seq = -1};
		p[i].item.work = probe_work;
		p[i].item.done = probe_done;
		runner_submit(r, &p[i].item);
	}
}

Test(runner, runs_items_in_order_on_its_thread_and_reports_on_the_loop)
{
	static struct probe p[ITEMS];
	struct runner r;
	uv_loop_t loop;
	pthread_t self = pthread_self();

	cr_assert_eq(uv_loop_init(&loop), 0);
	cr_assert_eq(runner_start(&r, &loop), 0);
	submit_all(&r, p, ITEMS, 0);
	/* the runner's handle holds the loop until every done has been called */
	uv_run(&loop, UV_RUN_DEFAULT);
	cr_assert_eq(done_seq, ITEMS, "uv_run returned with items still out");
	for (int i = 0; i < ITEMS; i++) {
		cr_assert_eq(p[i].work_seq, i, "item %d ran as number %d", i, p[i].work_seq);
		cr_assert_eq(p[i].done_seq, i, "item %d reported as number %d", i, p[i].done_seq);
		cr_assert(pthread_equal(p[i].done_on, self), "done is called on the loop thread");
		cr_assert(!pthread_equal(p[i].worked_on, self), "work ran on the loop thread");
		cr_assert(pthread_equal(p[i].worked_on, p[0].worked_on), "work ran on two threads");
	}
	/* idle: the loop is not held */
	cr_assert_eq(uv_run(&loop, UV_RUN_NOWAIT), 0);
	runner_close(&r);
	uv_run(&loop, UV_RUN_DEFAULT);
	cr_assert_eq(uv_loop_close(&loop), 0, "the runner's handle is still open");
}

Test(runner, close_with_items_out_finishes_them_first)
{
	static struct probe p[5];
	struct runner r;
	uv_loop_t loop;

	cr_assert_eq(uv_loop_init(&loop), 0);
	cr_assert_eq(runner_start(&r, &loop), 0);
	submit_all(&r, p, 5, 20);
	runner_close(&r);
	cr_assert(r.started, "joined with items still out");
	uv_run(&loop, UV_RUN_DEFAULT);
	cr_assert_eq(done_seq, 5);
	for (int i = 0; i < 5; i++)
		cr_assert_eq(p[i].done_seq, i);
	cr_assert(!r.started, "the thread was not joined once the items were done");
	cr_assert_eq(uv_loop_close(&loop), 0, "the runner's handle is still open");
}

Test(runner, close_of_a_runner_never_started_does_nothing)
{
	struct runner r = {0};

	runner_close(&r);
	runner_close(&r);
	cr_assert(!r.started);
}
