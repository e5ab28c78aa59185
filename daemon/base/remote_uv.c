/*
 * remote_uv.c - hiredis' async context on the daemon's loop: the adapter
 * hiredis ships (adapters/libuv.h), plus one bound.  hiredis 0.14 has no
 * limit on a reply being read (maxbulklen came in 1.0): its reader keeps
 * every byte of an unfinished bulk string, so a Redis (or anything posing
 * as one) that announces "$600000000" and streams would grow the daemon by
 * that much before the reply is even complete.  Here, after each read (at
 * most 16 KiB: redisBufferRead), the bytes the reader holds are compared
 * with the bound and, past it, the owner's breach callback drops the
 * connection: what the daemon holds for a reply stays within the bound plus
 * one read.
 *
 * One struct remote_uv per context, freed in its poll handle's close
 * callback (hiredis calls cleanup when it frees the context).  Loop thread.
 */
#include "remote_uv.h"

#include <stdlib.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#pragma GCC diagnostic pop

struct remote_uv {
	redisAsyncContext *ac; /* NULL once hiredis freed it */
	uv_poll_t handle;
	int events;
	size_t max_held;
	remote_uv_breach_cb breach;
};

/* Bytes of replies received and not yet handed out. */
static size_t held(const redisAsyncContext *ac)
{
	const redisReader *rd = ac->c.reader;

	return rd && rd->buf && rd->len > rd->pos ? rd->len - rd->pos : 0;
}

static void on_poll(uv_poll_t *h, int status, int events)
{
	struct remote_uv *p = h->data;

	if (status != 0)
		return;
	if (p->ac != NULL && (events & UV_READABLE)) {
		redisAsyncHandleRead(p->ac);
		if (p->ac != NULL && held(p->ac) > p->max_held) {
			p->breach(p->ac, held(p->ac)); /* frees the context */
			return;
		}
	}
	if (p->ac != NULL && (events & UV_WRITABLE))
		redisAsyncHandleWrite(p->ac);
}

static void update(struct remote_uv *p, int add, int del)
{
	p->events = (p->events | add) & ~del;
	if (p->events)
		uv_poll_start(&p->handle, p->events, on_poll);
	else
		uv_poll_stop(&p->handle);
}

static void add_read(void *data)
{
	update(data, UV_READABLE, 0);
}
static void del_read(void *data)
{
	update(data, 0, UV_READABLE);
}
static void add_write(void *data)
{
	update(data, UV_WRITABLE, 0);
}
static void del_write(void *data)
{
	update(data, 0, UV_WRITABLE);
}

static void on_close(uv_handle_t *h)
{
	free(h->data);
}

static void cleanup(void *data)
{
	struct remote_uv *p = data;

	p->ac = NULL;
	uv_close((uv_handle_t *)&p->handle, on_close);
}

int remote_uv_attach(redisAsyncContext *ac, uv_loop_t *loop, size_t max_held,
                     remote_uv_breach_cb breach)
{
	struct remote_uv *p;

	if (ac->ev.data != NULL)
		return REDIS_ERR;
	p = calloc(1, sizeof *p);
	if (p == NULL)
		return REDIS_ERR;
	if (uv_poll_init(loop, &p->handle, ac->c.fd) != 0) {
		free(p);
		return REDIS_ERR;
	}
	p->ac = ac;
	p->max_held = max_held;
	p->breach = breach;
	p->handle.data = p;
	ac->ev.addRead = add_read;
	ac->ev.delRead = del_read;
	ac->ev.addWrite = add_write;
	ac->ev.delWrite = del_write;
	ac->ev.cleanup = cleanup;
	ac->ev.data = p;
	return REDIS_OK;
}
