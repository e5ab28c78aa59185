/*
 * tl_json.c - libtorchloop's results as JSON (list, describe, stats: tl_call_json).
 */
#include "tl_internal.h"

#include "busypoll.h"
#include "frame.h"
#include "msg.h"
#include "shapes.h"
#include "shmalloc.h"
#include "tree.h"
#include "writer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
/* ---- JSON of a result (list, describe, stats) ------------------------------------- */

struct jbuf {
	char *p;
	size_t len, cap;
};

static void jput(struct jbuf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->cap) {
		size_t cap = (b->cap + n + 1) * 2;
		char *p = realloc(b->p, cap);
		if (p == NULL)
			return;
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void jstr(struct jbuf *b, const char *s, size_t n)
{
	jput(b, "\"", 1);
	for (size_t i = 0; i < n; i++) {
		unsigned char ch = (unsigned char)s[i];
		char esc[8];
		if (ch == '"' || ch == '\\') {
			esc[0] = '\\';
			esc[1] = (char)ch;
			jput(b, esc, 2);
		} else if (ch < 0x20) {
			snprintf(esc, sizeof esc, "\\u%04x", ch);
			jput(b, esc, 6);
		} else {
			jput(b, (const char *)&s[i], 1);
		}
	}
	jput(b, "\"", 1);
}

static void jvalue(struct jbuf *b, const msgpack_object *o)
{
	char num[64];

	switch (o->type) {
	case MSGPACK_OBJECT_NIL:
		jput(b, "null", 4);
		return;
	case MSGPACK_OBJECT_BOOLEAN:
		jput(b, o->via.boolean ? "true" : "false", o->via.boolean ? 4 : 5);
		return;
	case MSGPACK_OBJECT_POSITIVE_INTEGER:
		jput(b, num,
		     (size_t)snprintf(num, sizeof num, "%llu", (unsigned long long)o->via.u64));
		return;
	case MSGPACK_OBJECT_NEGATIVE_INTEGER:
		jput(b, num, (size_t)snprintf(num, sizeof num, "%lld", (long long)o->via.i64));
		return;
	case MSGPACK_OBJECT_FLOAT32:
	case MSGPACK_OBJECT_FLOAT64:
		jput(b, num,
		     (size_t)snprintf(num, sizeof num, isfinite(o->via.f64) ? "%.17g" : "null",
		                      o->via.f64));
		return;
	case MSGPACK_OBJECT_STR:
		jstr(b, o->via.str.ptr, o->via.str.size);
		return;
	case MSGPACK_OBJECT_ARRAY:
		jput(b, "[", 1);
		for (uint32_t i = 0; i < o->via.array.size; i++) {
			if (i)
				jput(b, ",", 1);
			jvalue(b, &o->via.array.ptr[i]);
		}
		jput(b, "]", 1);
		return;
	case MSGPACK_OBJECT_MAP:
		jput(b, "{", 1);
		for (uint32_t i = 0; i < o->via.map.size; i++) {
			const msgpack_object *k = &o->via.map.ptr[i].key;
			if (i)
				jput(b, ",", 1);
			if (k->type == MSGPACK_OBJECT_STR)
				jstr(b, k->via.str.ptr, k->via.str.size);
			else
				jstr(b, "?", 1);
			jput(b, ":", 1);
			jvalue(b, &o->via.map.ptr[i].val);
		}
		jput(b, "}", 1);
		return;
	default:
		jput(b, "null", 4);
		return;
	}
}

int tl_call_json(struct tl_client *c, const char *op, const char *name, char **json,
                 struct tl_error *err)
{
	struct tl_reply *r;
	struct jbuf b = {0};

	if (tlc_call(c, op, name, &r, err) != 0)
		return -1;
	jvalue(&b, msg_field(&r->msg, "result"));
	tl_reply_free(r);
	if (b.p == NULL)
		return tlc_fail(err, "IO", NULL, "out of memory");
	*json = b.p;
	return 0;
}
