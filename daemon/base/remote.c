/*
 * remote.c - the remote tier's Redis connection (remote.h).
 *
 * One hiredis async context on the daemon's loop (hiredis' libuv adapter),
 * connected on first use and again after a fault, at most once per
 * RECONNECT_MS.  Every command has a timer: past --remote-timeout its
 * callback gets REMOTE_FAILED and the connection is dropped (so a slow or
 * wedged Redis costs one timeout, not one per request); hiredis' own
 * callback for it, which comes later or with the disconnect, is ignored.
 *
 * Keys: tl:a:<cache key> holds a sealed blob (remote_blob.c), with a TTL;
 * tl:l:<cache key> is a compile lease (SET NX PX), whose value names the
 * node (host:pid) so only its holder renews or releases it.
 *
 * Loop thread.
 */
#include "remote.h"

#include "log.h"
#include "remote_uv.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#pragma GCC diagnostic ignored "-Wshadow"
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#pragma GCC diagnostic pop

#define RECONNECT_MS 1000
/* what a reply may hold beyond --remote-max-object: its header, small replies behind it */
#define REPLY_SLACK (64u << 10)
#define KEY_MAX     (sizeof "tl:a:" - 1 + CACHE_KEY_HEX) /* prefix, key, NUL */

struct remote {
	uv_loop_t *loop;
	redisAsyncContext *ac;
	bool connected;
	uint64_t last_connect; /* uv_now of the last try */
	char host[256], path[256];
	int port, db;
	char auth[256];
	uint8_t secret[REMOTE_SECRET_MAX];
	size_t secret_len;
	struct remote_opts o;
	char node[96];
	bool failing; /* the last command failed: health says degraded */
	char last_error[160];
	struct remote_stats stats;
};

/* One command in flight: its timer, and whether its callback already ran. */
struct cmd {
	struct remote *r;
	uv_timer_t timer;
	bool answered, timer_closed, hiredis_done;
	void (*on_reply)(struct cmd *c, redisReply *reply); /* NULL reply: failed */
	remote_fetch_cb fetch;
	remote_done_cb done;
	void *arg;
	char key[KEY_MAX];
	int step; /* fetch: 0 STRLEN, 1 GET */
};

static void fault(struct remote *r, const char *fmt, const char *detail)
{
	r->failing = true;
	r->stats.errors++;
	snprintf(r->last_error, sizeof r->last_error, fmt, detail ? detail : "");
	log_line(LOG_WARN, 0, NULL, "remote cache: %s", r->last_error);
}

static void on_connect(const redisAsyncContext *ac, int status)
{
	struct remote *r = ac->data;

	if (status != REDIS_OK) {
		fault(r, "cannot connect: %s", ac->errstr);
		if (r->ac == ac) { /* hiredis frees it, without on_disconnect */
			r->ac = NULL;
			r->connected = false;
		}
		return;
	}
	r->connected = true;
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
	struct remote *r = ac->data;

	(void)status;
	if (r->ac == ac) {
		r->ac = NULL;
		r->connected = false;
	}
}

/* A reply grew past --remote-max-object while being read (remote_uv.c):
 * the connection goes; its commands fail (a fetch is a miss: compiled here). */
static void on_breach(redisAsyncContext *ac, size_t held)
{
	struct remote *r = ac->data;
	char what[24];

	r->stats.reply_too_large++;
	snprintf(what, sizeof what, "%zu", held);
	fault(r, "a reply passed --remote-max-object while being read (%s bytes): dropped", what);
	if (r->ac == ac) {
		r->ac = NULL;
		r->connected = false;
	}
	redisAsyncFree(ac);
}

static int connect_now(struct remote *r)
{
	uint64_t now = uv_now(r->loop);
	redisAsyncContext *ac;

	if (r->ac)
		return 0;
	if (r->last_connect && now - r->last_connect < RECONNECT_MS)
		return -1; /* the last try was a moment ago: fail fast */
	if (r->last_connect)
		r->stats.reconnects++;
	r->last_connect = now;
	ac = r->path[0] ? redisAsyncConnectUnix(r->path) : redisAsyncConnect(r->host, r->port);
	if (ac == NULL || ac->err) {
		fault(r, "cannot connect: %s", ac ? ac->errstr : "out of memory");
		if (ac)
			redisAsyncFree(ac);
		return -1;
	}
	ac->data = r;
	if (remote_uv_attach(ac, r->loop, r->o.max_object + REPLY_SLACK, on_breach) != REDIS_OK) {
		redisAsyncFree(ac);
		fault(r, "cannot attach to the loop%s", "");
		return -1;
	}
	redisAsyncSetConnectCallback(ac, on_connect);
	redisAsyncSetDisconnectCallback(ac, on_disconnect);
	r->ac = ac;
	if (r->auth[0])
		redisAsyncCommand(ac, NULL, NULL, "AUTH %s", r->auth);
	if (r->db)
		redisAsyncCommand(ac, NULL, NULL, "SELECT %d", r->db);
	return 0;
}

static void cmd_closed(uv_handle_t *h)
{
	struct cmd *c = h->data;

	c->timer_closed = true;
	if (c->hiredis_done)
		free(c);
}

/* The command is over for its caller: stop its timer (freed once hiredis is
 * done with it too). */
static void cmd_answer(struct cmd *c, redisReply *reply)
{
	c->answered = true;
	uv_timer_stop(&c->timer);
	uv_close((uv_handle_t *)&c->timer, cmd_closed);
	c->on_reply(c, reply);
}

static void on_timeout(uv_timer_t *t)
{
	struct cmd *c = t->data;
	struct remote *r = c->r;

	r->stats.timeouts++;
	fault(r, "a command took over --remote-timeout%s", "");
	cmd_answer(c, NULL);
	if (r->ac) { /* wedged: drop it; hiredis answers what is pending with NULL */
		redisAsyncContext *ac = r->ac;
		r->ac = NULL;
		r->connected = false;
		redisAsyncFree(ac);
	}
}

static void on_hiredis(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct cmd *c = privdata;
	redisReply *rep = reply;

	(void)ac;
	c->hiredis_done = true;
	if (!c->answered) {
		if (rep == NULL)
			fault(c->r, "connection lost%s", "");
		else if (rep->type == REDIS_REPLY_ERROR)
			fault(c->r, "Redis said: %s", rep->str);
		else
			c->r->failing = false;
		cmd_answer(c, rep && rep->type != REDIS_REPLY_ERROR ? rep : NULL);
	}
	if (c->timer_closed)
		free(c);
}

/* Sends one command (argv) for c; on a failure to send, c's callback runs now. */
static void cmd_send(struct cmd *c, int argc, const char **argv, const size_t *lens)
{
	struct remote *r = c->r;

	uv_timer_init(r->loop, &c->timer);
	c->timer.data = c;
	if (connect_now(r) != 0 ||
	    redisAsyncCommandArgv(r->ac, on_hiredis, c, argc, argv, lens) != REDIS_OK) {
		r->failing = true;
		r->stats.errors++;
		c->hiredis_done = true;
		cmd_answer(c, NULL);
		return;
	}
	uv_timer_start(&c->timer, on_timeout, (uint64_t)r->o.timeout_ms, 0);
}

static struct cmd *cmd_new(struct remote *r, const char *prefix, const char *key,
                           void (*on_reply)(struct cmd *c, redisReply *reply))
{
	struct cmd *c = calloc(1, sizeof *c);

	if (c == NULL)
		return NULL;
	c->r = r;
	c->on_reply = on_reply;
	snprintf(c->key, sizeof c->key, "%s%s", prefix, key);
	return c;
}

/* ---- fetch -------------------------------------------------------------- */

static void fetch_reply(struct cmd *c, redisReply *reply)
{
	struct remote *r = c->r;

	if (reply == NULL) {
		c->fetch(c->arg, REMOTE_FAILED, NULL, 0);
		return;
	}
	if (c->step == 0) { /* STRLEN: absent (0), too large, or GET it */
		long long n = reply->type == REDIS_REPLY_INTEGER ? reply->integer : -1;
		if (n <= 0 || (uint64_t)n > r->o.max_object) {
			if (n > 0)
				r->stats.too_large++;
			else
				r->stats.misses++;
			c->fetch(c->arg, n < 0 ? REMOTE_FAILED : REMOTE_NONE, NULL, 0);
			return;
		}
		struct cmd *next = cmd_new(r, "", c->key, fetch_reply);
		if (next == NULL) {
			c->fetch(c->arg, REMOTE_FAILED, NULL, 0);
			return;
		}
		next->fetch = c->fetch;
		next->arg = c->arg;
		next->step = 1;
		cmd_send(next, 2, (const char *[]){"GET", next->key},
		         (size_t[]){3, strlen(next->key)});
		return;
	}
	if (reply->type != REDIS_REPLY_STRING || reply->len == 0) {
		r->stats.misses++; /* expired between the two commands */
		c->fetch(c->arg, REMOTE_NONE, NULL, 0);
		return;
	}
	uint8_t *copy = malloc(reply->len);
	if (copy == NULL) {
		c->fetch(c->arg, REMOTE_FAILED, NULL, 0);
		return;
	}
	memcpy(copy, reply->str, reply->len);
	r->stats.bytes_in += reply->len;
	c->fetch(c->arg, REMOTE_OK, copy, reply->len);
}

void remote_fetch(struct remote *r, const char *key, remote_fetch_cb cb, void *arg)
{
	struct cmd *c = cmd_new(r, "tl:a:", key, fetch_reply);

	if (c == NULL) {
		cb(arg, REMOTE_FAILED, NULL, 0);
		return;
	}
	c->fetch = cb;
	c->arg = arg;
	cmd_send(c, 2, (const char *[]){"STRLEN", c->key}, (size_t[]){6, strlen(c->key)});
}

/* ---- leases and publishing ---------------------------------------------- */

static void done_reply(struct cmd *c, redisReply *reply)
{
	enum remote_result res = REMOTE_FAILED;

	if (reply && reply->type == REDIS_REPLY_STATUS)
		res = REMOTE_OK; /* SET ... NX: "OK" */
	else if (reply && reply->type == REDIS_REPLY_NIL)
		res = REMOTE_NONE; /* SET ... NX: held by another */
	else if (reply && reply->type == REDIS_REPLY_INTEGER)
		res = reply->integer > 0 ? REMOTE_OK : REMOTE_NONE; /* EXISTS */
	if (c->done)
		c->done(c->arg, res);
}

/* argv[key_at] is set to the command's key. */
static void send_done(struct remote *r, const char *key, remote_done_cb cb, void *arg, int key_at,
                      int argc, const char **argv)
{
	struct cmd *c = cmd_new(r, "tl:l:", key, done_reply);
	size_t lens[6];

	if (c == NULL) {
		if (cb)
			cb(arg, REMOTE_FAILED);
		return;
	}
	c->done = cb;
	c->arg = arg;
	argv[key_at] = c->key;
	for (int i = 0; i < argc; i++)
		lens[i] = strlen(argv[i]);
	cmd_send(c, argc, argv, lens);
}

void remote_lease(struct remote *r, const char *key, remote_done_cb cb, void *arg)
{
	char ms[24];

	snprintf(ms, sizeof ms, "%lld", (long long)r->o.lease_ms);
	send_done(r, key, cb, arg, 1, 6, (const char *[]){"SET", NULL, r->node, "NX", "PX", ms});
}

void remote_lease_held(struct remote *r, const char *key, remote_done_cb cb, void *arg)
{
	send_done(r, key, cb, arg, 1, 2, (const char *[]){"EXISTS", NULL});
}

/* Ours only: a lease another node took over after ours expired is left alone. */
static const char RENEW_LUA[] = "if redis.call('get', KEYS[1]) == ARGV[1] then "
                                "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end";
static const char RELEASE_LUA[] = "if redis.call('get', KEYS[1]) == ARGV[1] then "
                                  "return redis.call('del', KEYS[1]) else return 0 end";

void remote_lease_renew(struct remote *r, const char *key)
{
	char ms[24];

	snprintf(ms, sizeof ms, "%lld", (long long)r->o.lease_ms);
	send_done(r, key, NULL, NULL, 3, 6,
	          (const char *[]){"EVAL", RENEW_LUA, "1", NULL, r->node, ms});
}

void remote_lease_release(struct remote *r, const char *key)
{
	send_done(r, key, NULL, NULL, 3, 5,
	          (const char *[]){"EVAL", RELEASE_LUA, "1", NULL, r->node});
}

struct remote_keeper {
	uv_timer_t timer;
	struct remote *r;
	char key[CACHE_KEY_HEX];
};

static void keeper_closed(uv_handle_t *h)
{
	free(h->data);
}

static void on_renew(uv_timer_t *t)
{
	struct remote_keeper *k = t->data;

	remote_lease_renew(k->r, k->key);
}

struct remote_keeper *remote_keep_lease(struct remote *r, const char *key)
{
	struct remote_keeper *k = malloc(sizeof *k);
	uint64_t every = (uint64_t)r->o.lease_ms / 3;

	if (k == NULL)
		return NULL;
	k->r = r;
	snprintf(k->key, sizeof k->key, "%s", key);
	uv_timer_init(r->loop, &k->timer);
	k->timer.data = k;
	uv_timer_start(&k->timer, on_renew, every, every);
	return k;
}

void remote_keeper_stop(struct remote_keeper *k)
{
	if (k == NULL)
		return;
	uv_timer_stop(&k->timer);
	uv_close((uv_handle_t *)&k->timer, keeper_closed);
}

void remote_count_refusal(struct remote *r, enum remote_refusal why)
{
	uint64_t *counter[] = {[BLOB_OK] = &r->stats.errors,
	                       [BLOB_TRUNCATED] = &r->stats.truncated,
	                       [BLOB_WRONG_KEY] = &r->stats.wrong_key,
	                       [BLOB_BAD_MAC] = &r->stats.hmac_rejected,
	                       [BLOB_TOO_LARGE] = &r->stats.too_large};

	(*counter[why])++;
}

static void publish_reply(struct cmd *c, redisReply *reply)
{
	if (reply != NULL)
		c->r->stats.publishes++;
}

void remote_publish(struct remote *r, const char *key, uint8_t *blob, size_t len)
{
	struct cmd *c;
	char ms[24];

	if (len > r->o.max_object) {
		r->stats.publish_skipped++;
		free(blob);
		return;
	}
	c = cmd_new(r, "tl:a:", key, publish_reply);
	if (c != NULL) {
		snprintf(ms, sizeof ms, "%lld", (long long)r->o.ttl_s * 1000);
		r->stats.bytes_out += len;
		cmd_send(c, 5, (const char *[]){"SET", c->key, (const char *)blob, "PX", ms},
		         (size_t[]){3, strlen(c->key), len, 2, strlen(ms)});
	}
	free(blob); /* hiredis copied it into its output buffer */
	remote_lease_release(r, key);
}

/* ---- the tier ----------------------------------------------------------- */

/* redis://HOST[:PORT][/DB] or unix:///PATH[?db=N] */
static int parse_url(struct remote *r, const char *url)
{
	const char *rest;
	char *end;

	r->port = 6379;
	if (strncmp(url, "unix://", 7) == 0) {
		const char *q = strstr(url + 7, "?db=");
		size_t n = q ? (size_t)(q - (url + 7)) : strlen(url + 7);
		if (n == 0 || n >= sizeof r->path || url[7] != '/')
			return -1;
		memcpy(r->path, url + 7, n);
		r->path[n] = '\0';
		r->db = q ? (int)strtol(q + 4, &end, 10) : 0;
		return q && (*end || r->db < 0) ? -1 : 0;
	}
	if (strncmp(url, "redis://", 8) != 0)
		return -1;
	rest = url + 8;
	size_t n = strcspn(rest, ":/");
	if (n == 0 || n >= sizeof r->host)
		return -1;
	memcpy(r->host, rest, n);
	r->host[n] = '\0';
	rest += n;
	if (*rest == ':') {
		r->port = (int)strtol(rest + 1, &end, 10);
		if (end == rest + 1 || r->port <= 0 || r->port > 65535)
			return -1;
		rest = end;
	}
	if (*rest == '/' && rest[1]) {
		r->db = (int)strtol(rest + 1, &end, 10);
		if (*end || r->db < 0)
			return -1;
	} else if (*rest && strcmp(rest, "/") != 0)
		return -1;
	return 0;
}

struct remote *remote_open(uv_loop_t *loop, const struct remote_opts *o, char *why, size_t why_size,
                           int *bad)
{
	struct remote *r;
	char host[64] = "";
	size_t auth_len;

	*bad = 0;
	why[0] = '\0';
	if (o->url == NULL || o->url[0] == '\0')
		return NULL;
	r = calloc(1, sizeof *r);
	if (r == NULL) {
		snprintf(why, why_size, "out of memory");
		return *bad = -1, NULL;
	}
	r->loop = loop;
	r->o = *o;
	if (parse_url(r, o->url) != 0) {
		snprintf(why, why_size,
		         "--remote-cache %s: not redis://HOST[:PORT][/DB] or "
		         "unix:///PATH[?db=N]",
		         o->url);
		goto bad;
	}
	if (o->auth_file && o->auth_file[0] &&
	    remote_blob_read_secret(o->auth_file, r->auth, sizeof r->auth, &auth_len, why,
	                            why_size) != 0)
		goto bad;
	if (o->secret_file == NULL || o->secret_file[0] == '\0') {
		snprintf(why, why_size,
		         "off: no --remote-secret-file (a blob is accepted only with "
		         "a valid HMAC under the shared secret, and only a node that has it may "
		         "publish)");
		free(r);
		return NULL;
	}
	if (remote_blob_read_secret(o->secret_file, (char *)r->secret, sizeof r->secret,
	                            &r->secret_len, why, why_size) != 0)
		goto bad;
	gethostname(host, sizeof host - 1);
	snprintf(r->node, sizeof r->node, "%s:%d", host, (int)getpid());
	return r;
bad:
	free(r);
	*bad = -1;
	return NULL;
}

void remote_close(struct remote *r)
{
	if (r == NULL)
		return;
	if (r->ac) {
		redisAsyncContext *ac = r->ac;
		r->ac = NULL;
		redisAsyncFree(ac); /* what is pending is answered REMOTE_FAILED */
	}
	free(r);
}

const struct remote_stats *remote_stats(const struct remote *r)
{
	return &r->stats;
}

struct remote_stats *remote_counters(struct remote *r)
{
	return &r->stats;
}

const char *remote_state(const struct remote *r)
{
	return r->failing ? "degraded" : "ok";
}

const char *remote_last_error(const struct remote *r)
{
	return r->last_error;
}

const uint8_t *remote_secret(const struct remote *r, size_t *len)
{
	*len = r->secret_len;
	return r->secret;
}

uint64_t remote_max_object(const struct remote *r)
{
	return r->o.max_object;
}
