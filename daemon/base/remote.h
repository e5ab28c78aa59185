/*
 * remote.h - the second cache tier: compiled artifacts shared between the
 * daemons of many nodes through Redis (--remote-cache), behind the local
 * cache (docs/operations.md, "Running on many nodes").
 *
 *   remote.c       the Redis connection on the daemon's loop (hiredis' libuv
 *                  adapter), a timeout on every command, reconnects, counters
 *   remote_blob.c  what is stored: an artifact and its metadata, sealed with
 *                  HMAC-SHA256 over (key, bytes) under a shared secret
 *
 * Every remote call may fail (Redis down, slow, full, restarted, returning
 * garbage): the caller then compiles locally.  A fault never fails a scan;
 * it is counted and health reports the tier degraded.
 *
 * Loop thread, except remote_blob_* (pure; the pool seals and opens blobs).
 */
#ifndef TORCHLOOP_REMOTE_H
#define TORCHLOOP_REMOTE_H

#include "cache.h"
#include "protocol.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define REMOTE_SECRET_MAX 256
#define REMOTE_MAC_LEN    32

struct remote_opts {
	const char *url;         /* redis://HOST:PORT/DB or unix:///PATH[?db=N] */
	const char *secret_file; /* the shared HMAC secret; none: the tier is off */
	const char *auth_file;   /* Redis AUTH password, or NULL */
	int64_t timeout_ms;      /* every command */
	uint64_t max_object;     /* larger blobs are neither fetched nor published */
	int64_t ttl_s;           /* a published blob's lifetime */
	int64_t lease_ms;        /* a compile lease's lifetime (renewed while compiling) */
};

/* The tier's counters: stats' "remote" map and the Prometheus text
 * (torchloopd_remote_<name>_total) read this table. */
#define REMOTE_STATS(X)                                                                            \
	X(hits, "blobs fetched, verified and loaded instead of a compile")                         \
	X(misses, "keys the remote tier did not have")                                             \
	X(publishes, "artifacts published after a local compile")                                  \
	X(publish_skipped, "artifacts not published (over --remote-max-object)")                   \
	X(bytes_in, "blob bytes fetched")                                                          \
	X(bytes_out, "blob bytes published")                                                       \
	X(lease_waits, "compiles waited for because another node held the key's lease")            \
	X(lease_takeovers, "leases taken over after their holder went away")                       \
	X(hmac_rejected, "blobs refused: the HMAC does not verify")                                \
	X(wrong_key, "blobs refused: sealed for another key")                                      \
	X(truncated, "blobs refused: cut or malformed")                                            \
	X(too_large, "blobs refused: over --remote-max-object")                                    \
	X(reply_too_large,                                                                         \
	  "replies that passed --remote-max-object while being read (connection dropped)")         \
	X(errors, "remote commands that failed (the daemon compiled locally)")                     \
	X(timeouts, "remote commands over --remote-timeout")                                       \
	X(reconnects, "connections to Redis made again")

struct remote_stats {
#define REMOTE_STAT_FIELD(name, help) uint64_t name;
	REMOTE_STATS(REMOTE_STAT_FIELD)
#undef REMOTE_STAT_FIELD
};

struct remote;
struct remote_keeper;

/* Why a fetched blob was refused (remote_blob_open). */
enum remote_refusal { BLOB_OK, BLOB_TRUNCATED, BLOB_WRONG_KEY, BLOB_BAD_MAC, BLOB_TOO_LARGE };

/*
 * The tier as configured: NULL with *why filled when it is off (no URL: why
 * is ""; no secret: the daemon says so at start) or the configuration is
 * wrong (a bad URL, an unreadable file: -1 in *bad).
 */
struct remote *remote_open(uv_loop_t *loop, const struct remote_opts *o, char *why, size_t why_size,
                           int *bad);
void remote_close(struct remote *r);
const struct remote_stats *remote_stats(const struct remote *r);
struct remote_stats *remote_counters(struct remote *r);
/* "ok", or "degraded" while the last command failed (or not connected). */
const char *remote_state(const struct remote *r);
const char *remote_last_error(const struct remote *r);
const uint8_t *remote_secret(const struct remote *r, size_t *len);
uint64_t remote_max_object(const struct remote *r);

/* Each callback runs exactly once, on the loop. */
enum remote_result { REMOTE_OK, REMOTE_NONE, REMOTE_FAILED };

/* GET of key's blob: REMOTE_OK with the raw bytes (owned by the callee from
 * then on: free()), REMOTE_NONE (absent, or over max_object: counted), or
 * REMOTE_FAILED. */
typedef void (*remote_fetch_cb)(void *arg, enum remote_result res, uint8_t *blob, size_t len);
void remote_fetch(struct remote *r, const char *key, remote_fetch_cb cb, void *arg);

/* SET NX PX of key's compile lease: REMOTE_OK (ours), REMOTE_NONE (another
 * node holds it), REMOTE_FAILED. */
typedef void (*remote_done_cb)(void *arg, enum remote_result res);
void remote_lease(struct remote *r, const char *key, remote_done_cb cb, void *arg);
/* Whether key's lease is held (REMOTE_OK) or gone (REMOTE_NONE). */
void remote_lease_held(struct remote *r, const char *key, remote_done_cb cb, void *arg);
/* Renewed for another lease time / given up (ours only); fire and forget. */
void remote_lease_renew(struct remote *r, const char *key);
void remote_lease_release(struct remote *r, const char *key);
/* key's lease renewed every third of --remote-lease-ms until stopped (NULL:
 * out of memory; the lease may then expire under its holder). */
struct remote_keeper *remote_keep_lease(struct remote *r, const char *key);
void remote_keeper_stop(struct remote_keeper *k);
/* A fetched blob refused (counted by why; BLOB_OK: it verified but did not
 * commit or load here, an error). */
void remote_count_refusal(struct remote *r, enum remote_refusal why);
/* SET PX ttl of key's sealed blob (taken: freed when sent); fire and
 * forget, then the lease released. */
void remote_publish(struct remote *r, const char *key, uint8_t *blob, size_t len);

/* ---- blobs (remote_blob.c) --------------------------------------------- */

/* The first line of a credentials file (the shared secret's, a systemd
 * LoadCredential= path) into out: 0, or -1 with why. */
int remote_blob_read_secret(const char *path, char *out, size_t size, size_t *len, char *why,
                            size_t why_size);

/* What travels with the artifact: what a compile reply carries. */
struct remote_meta {
	uint32_t n_inputs, n_outputs, step_ops;
	double compile_seconds;
	char strategy[16], lowered[16], note[256];
	const uint8_t *y_spec;
	size_t y_spec_len;
};

/* The sealed blob of key's artifact (so bytes), malloc'ed; NULL on no memory. */
uint8_t *remote_blob_seal(const uint8_t *secret, size_t secret_len, const char *key,
                          const struct remote_meta *meta, const uint8_t *so, size_t so_len,
                          size_t *out_len);
/* Opens blob as key's: BLOB_OK with meta and the .so's bytes pointing into
 * blob; else why it is refused (err filled). */
enum remote_refusal remote_blob_open(const uint8_t *secret, size_t secret_len, const char *key,
                                     const uint8_t *blob, size_t len, uint64_t max_object,
                                     struct remote_meta *meta, const uint8_t **so, size_t *so_len,
                                     struct proto_err *err);

#endif
