/*
 * runner.c - the one thread that runs graphs with an OpenMP team (runner.h).
 */
#include "runner.h"

#include "log.h"

#include <stddef.h>

static void *runner_main(void *arg)
{
	struct runner *r = arg;

	pthread_mutex_lock(&r->lock);
	for (;;) {
		struct runner_item *it;

		while (r->queue == NULL && !r->stop)
			pthread_cond_wait(&r->wake, &r->lock);
		if (r->queue == NULL)
			break; /* stopping, and nothing left to run */
		it = r->queue;
		r->queue = it->next;
		if (r->queue == NULL)
			r->queue_tail = &r->queue;
		pthread_mutex_unlock(&r->lock);
		it->work(it);
		pthread_mutex_lock(&r->lock);
		it->next = NULL;
		*r->ran_tail = it;
		r->ran_tail = &it->next;
		uv_async_send(&r->async);
	}
	pthread_mutex_unlock(&r->lock);
	return NULL;
}

static void join(struct runner *r)
{
	pthread_mutex_lock(&r->lock);
	r->stop = true;
	pthread_cond_signal(&r->wake);
	pthread_mutex_unlock(&r->lock);
	pthread_join(r->thread, NULL);
	pthread_mutex_destroy(&r->lock);
	pthread_cond_destroy(&r->wake);
	uv_close((uv_handle_t *)&r->async, NULL);
	r->started = false;
}

static void on_ran(uv_async_t *a)
{
	struct runner *r = a->data;
	struct runner_item *it;

	pthread_mutex_lock(&r->lock);
	it = r->ran;
	r->ran = NULL;
	r->ran_tail = &r->ran;
	pthread_mutex_unlock(&r->lock);
	while (it) {
		struct runner_item *next = it->next;
		r->inflight--;
		it->done(it);
		it = next;
	}
	if (r->inflight == 0 && r->started) {
		uv_unref((uv_handle_t *)&r->async);
		if (r->closing)
			join(r);
	}
}

int runner_start(struct runner *r, uv_loop_t *loop)
{
	int rc;

	*r = (struct runner){0};
	r->queue_tail = &r->queue;
	r->ran_tail = &r->ran;
	if (uv_async_init(loop, &r->async, on_ran) != 0)
		return -1;
	r->async.data = r;
	uv_unref((uv_handle_t *)&r->async);
	pthread_mutex_init(&r->lock, NULL);
	pthread_cond_init(&r->wake, NULL);
	rc = pthread_create(&r->thread, NULL, runner_main, r);
	if (rc != 0) {
		log_error("graph runner thread: pthread_create failed (%d)", rc);
		pthread_mutex_destroy(&r->lock);
		pthread_cond_destroy(&r->wake);
		uv_close((uv_handle_t *)&r->async, NULL);
		return -1;
	}
	r->started = true;
	return 0;
}

void runner_submit(struct runner *r, struct runner_item *it)
{
	if (r->inflight++ == 0)
		uv_ref((uv_handle_t *)&r->async);
	it->next = NULL;
	pthread_mutex_lock(&r->lock);
	*r->queue_tail = it;
	r->queue_tail = &it->next;
	pthread_cond_signal(&r->wake);
	pthread_mutex_unlock(&r->lock);
}

void runner_close(struct runner *r)
{
	if (!r->started || r->closing)
		return;
	r->closing = true;
	if (r->inflight == 0)
		join(r);
}
