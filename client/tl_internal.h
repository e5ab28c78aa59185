/*
 * tl_internal.h - what libtorchloop's files share (torchloop.c: errors,
 * connection, transport, the small requests; tl_trees.c: building and
 * reading trees; tl_scan.c: shared memory, scan, grad, compile; tl_json.c:
 * results as JSON).  Not installed: callers see torchloop.h.
 */
#ifndef TORCHLOOP_TL_INTERNAL_H
#define TORCHLOOP_TL_INTERNAL_H

#include "torchloop.h"

#include "busypoll.h"
#include "msg.h"
#include "shmalloc.h"
#include "tree.h"
#include "writer.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/un.h>

/* Replies are read through this buffer: one read(2) takes a header and a
 * small body (or a progress event and the reply); larger bodies are read
 * straight into their aligned buffer. */
#define TL_RBUF 16384

/* What the daemon said an op's outputs need in the region (out_needed), so
 * the next request of the same adapter and op names an area that fits. */
#define TL_HINTS 16
struct out_hint {
	char adapter[64];
	int kind; /* tl_scan.c hint_kind: scan, grad, their saved-pair forms */
	uint64_t needed;
};

struct tl_client {
	int fd;
	int timeout_ms;
	uint32_t rb_off, rb_len;
	uint8_t rbuf[TL_RBUF];
	uint64_t next_id;
	tl_progress_fn progress;
	void *user;
	struct shm_region *shm; /* attached region, or NULL */
	uint64_t shm_threshold;
	struct out_hint hints[TL_HINTS];
	unsigned next_hint;
	struct busypoll poll; /* waits for replies poll first (tl_set_busy_poll) */
	bool poll_reply;      /* this request's reply is worth polling for */
	uint64_t polled;      /* reads that polling served (tl_polled_reads) */
	/* tl_set_reconnect: sending a request again on a new connection */
	char path[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
	int reconnect_ms; /* 0: never */
	bool retryable;   /* this request gives the same result run twice */
	bool broken;      /* the connection broke (EOF, reset, EPIPE) */
	uint64_t got;     /* bytes of this request's reply read so far */
	uint64_t resent;  /* requests sent again (tl_resent) */
};

struct tl_builder {
	msgpack_zone *zone;
};

/* The result trees a reply may carry (tl_trees.c tlc_read_trees). */
#define TL_REPLY_TREES 5

struct tl_reply {
	uint8_t *body;
	struct msg msg;
	struct tree_node trees[TL_REPLY_TREES];
	const char *names[TL_REPLY_TREES];
	int n;
	struct shm_region *shm; /* holds a reference while area is in use */
	uint64_t area;          /* the output area's block, or UINT64_MAX */
};

#define NODE(t)  ((struct tree_node *)(t))
#define CNODE(t) ((const struct tree_node *)(t))

/* err filled (code, leaf path, message); returns -1.  err may be NULL. */
int tlc_fail(struct tl_error *err, const char *code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void tlc_ok(struct tl_error *err);
/* Starts request op with nfields fields after the envelope (*id: its id). */
int tlc_begin(struct tl_client *c, struct writer *w, const char *op, uint32_t nfields, uint64_t *id,
              struct tl_error *err);
/* Sends w (with pass_fd, or -1) and reads up to the reply to id; *out: the
 * reply (NULL: not wanted), an error reply turned into err. */
int tlc_roundtrip_fd(struct tl_client *c, struct writer *w, int pass_fd, uint64_t id,
                     struct tl_reply **out, struct tl_error *err);
/* A request of op with at most a `name` field (NULL: none), sent and its
 * reply read as tlc_roundtrip's. */
int tlc_call(struct tl_client *c, const char *op, const char *name, struct tl_reply **out,
             struct tl_error *err);
/* As tlc_roundtrip_fd without a descriptor; destroys w whatever happens. */
int tlc_roundtrip(struct tl_client *c, struct writer *w, uint64_t id, struct tl_reply **out,
                  struct tl_error *err);
/* After a successful scan/grad: decode the result's trees (views). */
int tlc_read_trees(struct tl_reply *r, struct tl_error *err);

#endif
