/*
 * remote_uv.h - hiredis' async context on the daemon's libuv loop, with a
 * bound on the bytes a reply may hold while it is being read (remote_uv.c).
 */
#ifndef TORCHLOOP_REMOTE_UV_H
#define TORCHLOOP_REMOTE_UV_H

#include <stddef.h>
#include <uv.h>

struct redisAsyncContext;

/* Called (loop thread) when the bytes the reader holds pass the bound after
 * a read: the callee must free the context (redisAsyncFree), which closes
 * the connection and answers its pending commands with NULL. */
typedef void (*remote_uv_breach_cb)(struct redisAsyncContext *ac, size_t held);

/* Attaches ac to loop (as hiredis' redisLibuvAttach); REDIS_OK or REDIS_ERR. */
int remote_uv_attach(struct redisAsyncContext *ac, uv_loop_t *loop, size_t max_held,
                     remote_uv_breach_cb breach);

#endif
