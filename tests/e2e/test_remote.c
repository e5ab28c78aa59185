/*
 * test_remote.c - the remote cache tier (--remote-cache): daemons on
 * separate local caches share compiled graphs through a real redis-server
 * (started here on a private Unix socket, stopped after).
 *
 * The graph is the cumulative sum (checked by hand) at a T of each test's
 * own, so every test's keys are new; the daemons share Inductor's cache, so
 * a local compile of a graph another daemon built is quick.
 */
#include "harness.h"
#include "remote.h"

#include <dirent.h>
#include <hiredis/hiredis.h>
#include <jansson.h>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CUMSUM "examples/bodies/cumsum.py"
#define SECRET "a shared secret of this test"
#define PASS   "the redis password of this test"

/* ---- redis-server --------------------------------------------------------- */

struct redis {
	pid_t pid;
	char dir[512], sock[600], url[640], secret[600], auth[600];
};

static redisContext *redis_cli(const struct redis *r)
{
	redisContext *c = redisConnectUnix(r->sock);
	redisReply *rep;

	cr_assert(c != NULL && c->err == 0, "cannot connect to %s", r->sock);
	rep = redisCommand(c, "AUTH %s", PASS);
	cr_assert(rep && rep->type == REDIS_REPLY_STATUS, "AUTH");
	freeReplyObject(rep);
	return c;
}

static void redis_up(struct redis *r)
{
	char log[700];

	snprintf(log, sizeof log, "%s/redis.log", r->dir);
	unlink(r->sock);
	r->pid = fork();
	cr_assert_neq(r->pid, -1);
	if (r->pid == 0) {
		int null = open("/dev/null", O_WRONLY);
		/* gone with the test, whatever happens to it; not holding its output open */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		dup2(null, 1);
		dup2(null, 2);
		execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", r->sock,
		       "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--logfile",
		       log, "--requirepass", PASS, (char *)NULL);
		_exit(127);
	}
	for (int k = 0; k < 100; k++) {
		redisContext *c = redisConnectUnix(r->sock);
		redisReply *rep = c && !c->err ? redisCommand(c, "PING") : NULL;
		bool up = rep != NULL; /* NOAUTH: it answers */
		if (rep)
			freeReplyObject(rep);
		if (c)
			redisFree(c);
		if (up)
			return;
		usleep(50000);
	}
	cr_assert_fail("redis-server did not start on %s (installed by make setup); log %s",
	               r->sock, log);
}

static void redis_down(struct redis *r)
{
	if (r->pid > 0) {
		kill(r->pid, SIGTERM);
		waitpid(r->pid, NULL, 0);
		r->pid = 0;
	}
}

/* A credentials file: text, mode 0600. */
static void write_private(const char *path, const char *text)
{
	h_write_file(path, "%s", text);
	chmod(path, 0600);
}

static void redis_start(struct redis *r)
{
	h_tmpdir(r->dir, sizeof r->dir, "redis");
	snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
	snprintf(r->url, sizeof r->url, "unix://%s", r->sock);
	snprintf(r->secret, sizeof r->secret, "%s/secret", r->dir);
	write_private(r->secret, SECRET "\n");
	/* every test's Redis wants a password: the daemons read it from a file */
	snprintf(r->auth, sizeof r->auth, "%s/auth", r->dir);
	write_private(r->auth, PASS "\n");
	redis_up(r);
}

/* Keys matching pattern, and the first of them in first (if any). */
static size_t redis_keys(const struct redis *r, const char *pattern, char *first, size_t size)
{
	redisContext *c = redis_cli(r);
	redisReply *rep = redisCommand(c, "KEYS %s", pattern);
	size_t n = rep && rep->type == REDIS_REPLY_ARRAY ? rep->elements : 0;

	if (n && first)
		snprintf(first, size, "%s", rep->element[0]->str);
	freeReplyObject(rep);
	redisFree(c);
	return n;
}

/* How many times Redis ran cmd (INFO commandstats; a script's commands count). */
static long redis_calls(const struct redis *r, const char *cmd)
{
	redisContext *c = redis_cli(r);
	redisReply *rep = redisCommand(c, "INFO commandstats");
	char needle[64];
	const char *at;
	long n = 0;

	cr_assert(rep && rep->type == REDIS_REPLY_STRING, "INFO commandstats");
	snprintf(needle, sizeof needle, "cmdstat_%s:calls=", cmd);
	at = strstr(rep->str, needle);
	if (at)
		n = atol(at + strlen(needle));
	freeReplyObject(rep);
	redisFree(c);
	return n;
}

static void redis_set(const struct redis *r, const char *key, const void *val, size_t len)
{
	redisContext *c = redis_cli(r);
	redisReply *rep = redisCommand(c, "SET %s %b", key, val, len);

	cr_assert(rep && rep->type == REDIS_REPLY_STATUS, "SET %s", key);
	freeReplyObject(rep);
	redisFree(c);
}

/* ---- daemons -------------------------------------------------------------- */

struct node {
	struct hd d;
	struct tl_client *c;
	char cache[512];
};

static void node_up(struct node *n, const struct redis *r, const char *const *more)
{
	const char *args[24] = {"--no-probe", "--remote-cache",
	                        r->url,       "--remote-secret-file",
	                        r->secret,    "--remote-auth-file",
	                        r->auth,      "--remote-timeout",
	                        "500",        NULL};
	int k = 9;
	char inductor[700];

	/* one Inductor cache for every daemon: another node's graph recompiles quickly */
	snprintf(inductor, sizeof inductor, "%s/inductor", h_shared_cache());
	setenv("TORCHINDUCTOR_CACHE_DIR", inductor, 0);
	for (; more && *more && k < 22; more++)
		args[k++] = *more;
	args[k] = NULL;
	h_tmpdir(n->cache, sizeof n->cache, "node");
	hd_start(&n->d, n->cache, args);
	hd_wait_ready(&n->d, 120);
	n->c = hd_connect(&n->d);
	hd_register(n->c, "r.cumsum", CUMSUM, "body", 128, 1 << 16, 8);
}

static void node_down(struct node *n)
{
	tl_close(n->c);
	cr_assert_eq(hd_stop(&n->d), 0, "clean exit; log %s", n->d.log);
}

/* stats' remote counter (or -1 when the tier is off) */
static double remote_stat(struct tl_client *c, const char *name)
{
	struct tl_error err;
	char *text;
	json_t *j, *v;
	double out;

	cr_assert_eq(tl_call_json(c, "stats", NULL, &text, &err), 0, "%s", err.message);
	j = json_loads(text, 0, NULL);
	v = json_object_get(json_object_get(j, "remote"), name);
	out = v ? json_number_value(v) : -1;
	json_decref(j);
	free(text);
	return out;
}

static const char *health_remote(struct tl_client *c, char *out, size_t size)
{
	struct tl_error err;
	char *text;
	json_t *j;

	cr_assert_eq(tl_call_json(c, "health", NULL, &text, &err), 0, "%s", err.message);
	j = json_loads(text, 0, NULL);
	snprintf(out, size, "%s", json_string_value(json_object_get(j, "remote")));
	cr_assert(json_is_true(json_object_get(j, "ready")), "a remote fault never unreadies");
	json_decref(j);
	free(text);
	return out;
}

/* The cumulative sum over T steps of a [4] carry, checked by hand. */
static int cumsum(struct tl_client *c, int64_t T, struct tl_error *err)
{
	double carry[4], xs[4 * 16];
	int64_t cs[] = {4}, xsh[] = {T, 4};
	struct tl_builder *b = tl_builder_new();
	struct tl_reply *r;
	int rc;

	h_fill(carry, TL_FLOAT64, 4, (uint64_t)T);
	h_fill(xs, TL_FLOAT64, (size_t)(4 * T), (uint64_t)T + 1);
	rc = tl_scan(c, "r.cumsum", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	             tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, err);
	if (rc == 0) {
		const double *y = tl_tree_data(tl_reply_tree(r, "outputs"));
		const double *fin = tl_tree_data(tl_reply_tree(r, "carry"));
		for (int k = 0; k < 4; k++) {
			double acc = carry[k];
			for (int s = 0; s < T; s++) {
				acc += xs[4 * s + k];
				cr_assert_float_eq(y[4 * s + k], acc, 1e-12);
			}
			cr_assert_float_eq(fin[k], acc, 1e-12);
		}
		tl_reply_free(r);
	}
	tl_builder_free(b);
	return rc;
}

static void cumsum_ok(struct tl_client *c, int64_t T)
{
	struct tl_error err;

	cr_assert_eq(cumsum(c, T, &err), 0, "T=%lld: %s %s", (long long)T, err.code, err.message);
}

static void await_stat(struct tl_client *c, const char *name, double at_least, int timeout_s)
{
	for (int k = 0; k < timeout_s * 20; k++) {
		if (remote_stat(c, name) >= at_least)
			return;
		usleep(50000);
	}
	cr_assert_fail("remote %s stayed below %g", name, at_least);
}

/* `torchloop stats --prometheus` of n prints the line want. */
static void prometheus_says(const struct node *n, const char *want)
{
	char cmd[2048], log[700];

	snprintf(log, sizeof log, "%s/prometheus.txt", n->d.dir);
	snprintf(cmd, sizeof cmd, "%s/%s/torchloop --socket %s stats --prometheus | grep -qx '%s'",
	         h_root(), h_build(), n->d.sock, want);
	cr_assert_eq(h_run((const char *[]){"sh", "-c", cmd, NULL}, log), 0, "no line '%s'", want);
}

/* ---- tests ---------------------------------------------------------------- */

Test(remote, a_second_node_loads_what_the_first_compiled_without_compiling)
{
	struct redis r;
	struct node a, b;
	char key[128];

	redis_start(&r);
	node_up(&a, &r, NULL);
	cumsum_ok(a.c, 3);
	cr_assert_eq(hd_counter(a.c, "r.cumsum", "compiles"), 1);
	await_stat(a.c, "publishes", 1, 30);
	cr_assert_eq(redis_keys(&r, "tl:a:*", key, sizeof key), 1);
	cr_assert_eq(strlen(key), strlen("tl:a:") + CACHE_KEY_HEX - 1, "the whole cache key: %s",
	             key);
	cr_assert_eq(redis_keys(&r, "tl:l:*", NULL, 0), 0, "the lease was released");
	node_up(&b, &r, NULL);
	cumsum_ok(b.c, 3);
	cr_assert_eq(hd_counter(b.c, "r.cumsum", "compiles"), 0, "no compile on the second node");
	cr_assert_eq(remote_stat(b.c, "hits"), 1);
	cr_assert_gt(remote_stat(b.c, "bytes_in"), 0);
	prometheus_says(&b, "torchloopd_remote_hits_total 1");
	node_down(&b);
	node_down(&a);
	redis_down(&r);
}

/* A scan in a thread of its own, on a connection of its own (a client is
 * one thread's). */
struct asked {
	const char *sock;
	int64_t T;
	int rc;
	struct tl_error err;
};

static void *ask(void *arg)
{
	struct asked *q = arg;
	struct tl_client *c;

	q->rc = tl_connect(q->sock, 5000, &c, &q->err);
	if (q->rc == 0) {
		q->rc = cumsum(c, q->T, &q->err);
		tl_close(c);
	}
	return NULL;
}

Test(remote, two_nodes_asked_for_a_new_graph_at_once_compile_it_once)
{
	struct redis r;
	struct node a, b;
	struct asked qa, qb;
	pthread_t ta, tb;

	redis_start(&r);
	node_up(&a, &r, NULL);
	node_up(&b, &r, NULL);
	qa = (struct asked){a.d.sock, 4, -1, {{0}}};
	qb = (struct asked){b.d.sock, 4, -1, {{0}}};
	pthread_create(&ta, NULL, ask, &qa);
	pthread_create(&tb, NULL, ask, &qb);
	pthread_join(ta, NULL);
	pthread_join(tb, NULL);
	cr_assert_eq(qa.rc, 0, "%s", qa.err.message);
	cr_assert_eq(qb.rc, 0, "%s", qb.err.message);
	cr_assert_eq(hd_counter(a.c, "r.cumsum", "compiles") +
	                 hd_counter(b.c, "r.cumsum", "compiles"),
	             1, "one compile between them (the lease)");
	cr_assert_eq(remote_stat(a.c, "lease_waits") + remote_stat(b.c, "lease_waits"), 1);
	cr_assert_eq(remote_stat(a.c, "hits") + remote_stat(b.c, "hits"), 1);
	node_down(&b);
	node_down(&a);
	redis_down(&r);
}

/* Sends sig to every child of parent (its compile workers). */
static int signal_children(pid_t parent, int sig)
{
	DIR *dp = opendir("/proc");
	struct dirent *e;
	int n = 0;

	while (dp && (e = readdir(dp)) != NULL) {
		char path[300], buf[512], *p;
		long ppid = 0;
		FILE *fp;
		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
		fp = fopen(path, "r");
		if (fp && fgets(buf, sizeof buf, fp) && (p = strrchr(buf, ')')) != NULL)
			sscanf(p + 2, "%*c %ld", &ppid);
		if (fp)
			fclose(fp);
		if (ppid == parent && kill((pid_t)atoi(e->d_name), sig) == 0)
			n++;
	}
	if (dp)
		closedir(dp);
	return n;
}

static double seconds_since(const struct timespec *t0)
{
	struct timespec t1;

	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) / 1e9;
}

Test(remote, a_lease_holder_killed_mid_compile_is_taken_over_within_the_lease_time)
{
	const char *lease[] = {"--remote-lease-ms", "1500", NULL};
	struct redis r;
	struct node a, b;
	struct asked qa, qb;
	pthread_t ta, tb;
	struct timespec t0;
	long renewed;

	redis_start(&r);
	node_up(&a, &r, lease);
	node_up(&b, &r, lease);
	qa = (struct asked){a.d.sock, 5, -1, {{0}}};
	pthread_create(&ta, NULL, ask, &qa);
	for (int k = 0; k < 1500 && redis_keys(&r, "tl:l:*", NULL, 0) == 0; k++)
		usleep(10000);
	/* node a holds the lease and compiles: its workers frozen, it keeps renewing */
	cr_assert_gt(signal_children(a.d.pid, SIGSTOP), 0);
	cr_assert_eq(redis_keys(&r, "tl:l:*", NULL, 0), 1, "node a holds the lease");
	qb = (struct asked){b.d.sock, 5, -1, {{0}}};
	pthread_create(&tb, NULL, ask, &qb);
	await_stat(b.c, "lease_waits", 1, 30);
	/* longer than the lease: a renews it (its script's PEXPIRE, a third of the
	 * lease apart) 5 times, 2 s from the first to the last; b keeps waiting */
	renewed = redis_calls(&r, "pexpire");
	for (int k = 0; k < 1200 && redis_calls(&r, "pexpire") < renewed + 5; k++)
		usleep(100 * 1000);
	cr_assert_geq(redis_calls(&r, "pexpire"), renewed + 5,
	              "a did not renew its lease 5 times within 120 s");
	cr_assert_eq(redis_keys(&r, "tl:l:*", NULL, 0), 1, "a still holds the lease");
	cr_assert_eq(remote_stat(b.c, "lease_takeovers"), 0);
	kill(a.d.pid, SIGKILL); /* its lease is no longer renewed (its workers die with it) */
	waitpid(a.d.pid, NULL, 0);
	a.d.pid = 0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	/* counted only when b's own lease request wins after waiting (not by a
	 * compile after --compile-timeout); the expiry takes at most the 1.5 s
	 * lease plus b's 250 ms poll, and the bound leaves room for a loaded
	 * machine (a tighter one failed in CI) while staying far below the
	 * compile timeout */
	await_stat(b.c, "lease_takeovers", 1, 10);
	cr_assert_lt(seconds_since(&t0), 4 * 1.5, "taken over once the lease expired");
	pthread_join(tb, NULL);
	cr_assert_eq(qb.rc, 0, "%s", qb.err.message);
	cr_assert_eq(hd_counter(b.c, "r.cumsum", "compiles"), 1);
	pthread_join(ta, NULL); /* its daemon died under it */
	cr_assert_neq(qa.rc, 0);
	tl_close(a.c);
	node_down(&b);
	redis_down(&r);
}

/* Plants blob under key, then a fresh node scans: refused, counted, compiled. */
static void refused(const struct redis *r, const char *key, const void *blob, size_t len,
                    const char *counter, const char *const *more)
{
	struct node n;

	redis_set(r, key, blob, len);
	node_up(&n, r, more);
	cumsum_ok(n.c, 6);
	cr_assert_eq(remote_stat(n.c, counter), 1, "%s", counter);
	cr_assert_eq(remote_stat(n.c, "hits"), 0);
	cr_assert_eq(hd_counter(n.c, "r.cumsum", "compiles"), 1, "compiled locally");
	node_down(&n);
}

Test(remote, forged_cut_misplaced_unloadable_and_oversized_blobs_are_refused_and_compiled_locally)
{
	const char *small[] = {"--remote-max-object", "1048576", NULL};
	struct redis r;
	struct node a;
	char key[128];
	redisContext *c;
	redisReply *rep;
	uint8_t *blob, *other, *big;
	size_t len, other_len;
	struct remote_meta m = {1, 1, 1, 1.0, "unroll", "unroll", "", (const uint8_t *)"\xc0", 1};

	redis_start(&r);
	node_up(&a, &r, NULL);
	cumsum_ok(a.c, 6);
	await_stat(a.c, "publishes", 1, 30);
	node_down(&a);
	cr_assert_eq(redis_keys(&r, "tl:a:*", key, sizeof key), 1);
	c = redis_cli(&r);
	rep = redisCommand(c, "GET %s", key);
	cr_assert(rep && rep->type == REDIS_REPLY_STRING);
	len = (size_t)rep->len;
	blob = malloc(len);
	memcpy(blob, rep->str, len);
	freeReplyObject(rep);
	redisFree(c);

	blob[len - 1] ^= 0x5a; /* one byte of the artifact changed: the HMAC fails */
	refused(&r, key, blob, len, "hmac_rejected", NULL);
	blob[len - 1] ^= 0x5a;
	refused(&r, key, blob, len / 2, "truncated", NULL);
	/* a blob sealed (with the right secret) for another key, stored under this one */
	other = remote_blob_seal((const uint8_t *)SECRET, strlen(SECRET), "0123456789abcdef", &m,
	                         blob, len, &other_len);
	refused(&r, key, other, other_len, "wrong_key", NULL);
	/* sealed right, for this key, but not an artifact this node can load */
	free(other);
	other = remote_blob_seal((const uint8_t *)SECRET, strlen(SECRET), key + 5, &m,
	                         (const uint8_t *)"not an ELF", 10, &other_len);
	refused(&r, key, other, other_len, "errors", NULL);
	/* garbage: not even a string under the key (STRLEN: WRONGTYPE) */
	c = redis_cli(&r);
	freeReplyObject(redisCommand(c, "DEL %s", key));
	freeReplyObject(redisCommand(c, "RPUSH %s x", key));
	redisFree(c);
	{
		struct node n;
		node_up(&n, &r, NULL);
		cumsum_ok(n.c, 6);
		cr_assert_geq(remote_stat(n.c, "errors"), 1, "the garbage is an error");
		cr_assert_eq(hd_counter(n.c, "r.cumsum", "compiles"), 1, "compiled locally");
		node_down(&n);
	}
	c = redis_cli(&r);
	freeReplyObject(redisCommand(c, "DEL %s", key));
	redisFree(c);
	big = calloc(1, 2 << 20);
	memcpy(big, blob, len < (2u << 20) ? len : (2u << 20));
	refused(&r, key, big, 2 << 20, "too_large", small);
	free(big);
	free(other);
	free(blob);
	redis_down(&r);
}

Test(remote, redis_wedged_or_stopped_mid_run_scans_go_on_and_publishing_resumes_when_back)
{
	struct redis r;
	struct node a;
	char state[32];
	double published;

	redis_start(&r);
	node_up(&a, &r, NULL);
	cumsum_ok(a.c, 7);
	await_stat(a.c, "publishes", 1, 30);
	kill(r.pid, SIGSTOP); /* wedged: every command runs into --remote-timeout (500 ms) */
	cumsum_ok(a.c, 10);
	cr_assert_geq(remote_stat(a.c, "timeouts"), 1);
	cr_assert_str_eq(health_remote(a.c, state, sizeof state), "degraded");
	kill(r.pid, SIGCONT);
	redis_down(&r);
	cumsum_ok(a.c, 8); /* the remote tier fails: compiled locally, served */
	cr_assert_geq(remote_stat(a.c, "errors"), 1);
	cr_assert_str_eq(health_remote(a.c, state, sizeof state), "degraded");
	redis_up(&r);
	usleep(1100 * 1000);                       /* past the reconnect pause */
	published = remote_stat(a.c, "publishes"); /* T=10's SET may have landed after SIGCONT */
	cumsum_ok(a.c, 9);
	await_stat(a.c, "publishes", published + 1, 30);
	cr_assert_eq(redis_keys(&r, "tl:a:*", NULL, 0), 1, "T=9's blob (Redis came back empty)");
	cr_assert_str_eq(health_remote(a.c, state, sizeof state), "ok");
	cr_assert_geq(remote_stat(a.c, "reconnects"), 1);
	node_down(&a);
	redis_down(&r);
}

/* ---- a Redis that lies about a blob's size --------------------------------- */

static bool log_says(const char *path, const char *needle);

/*
 * A socket this test serves as "Redis": STRLEN answers small (or 0: a miss,
 * while `lie` is off), and GET announces a bulk string of LIE_BYTES, then
 * streams zeros until the daemon hangs up, sampling the daemon's RSS as it
 * goes.  Everything else: +OK, or :0/:1.  One connection at a time.
 */
#define LIE_BYTES (256u << 20)

struct liar {
	struct redis r; /* its paths, for node_up; no redis-server */
	int lfd, stop[2];
	pthread_t th;
	volatile bool lie;
	volatile pid_t daemon;
	size_t streamed;   /* bytes of the lying GET sent before the daemon hung up */
	long peak_rss_kib; /* the daemon's, sampled while streaming */
};

/* One command (an array of bulk strings) from buf[0..len): its name in
 * name, its byte length, or 0 while incomplete. */
static size_t resp_command(const char *buf, size_t len, char *name, size_t size)
{
	const char *p = buf, *end = buf + len, *nl;
	long n, k;

	if (len < 4 || *p != '*' || (nl = memchr(p, '\n', len)) == NULL)
		return 0;
	n = strtol(p + 1, NULL, 10);
	p = nl + 1;
	for (long i = 0; i < n; i++) {
		if (p >= end || *p != '$' || (nl = memchr(p, '\n', (size_t)(end - p))) == NULL)
			return 0;
		k = strtol(p + 1, NULL, 10);
		if (end - (nl + 1) < k + 2)
			return 0;
		if (i == 0)
			snprintf(name, size, "%.*s", (int)(k < (long)size ? k : (long)size - 1),
			         nl + 1);
		p = nl + 1 + k + 2;
	}
	return (size_t)(p - buf);
}

static void liar_stream(struct liar *l, int fd)
{
	static char zeros[1 << 16];
	char head[32];
	int n = snprintf(head, sizeof head, "$%u\r\n", LIE_BYTES);

	l->streamed = 0;
	if (send(fd, head, (size_t)n, MSG_NOSIGNAL) != n)
		return;
	while (l->streamed < LIE_BYTES) {
		ssize_t w = send(fd, zeros, sizeof zeros, MSG_NOSIGNAL);
		long rss;
		if (w <= 0)
			return; /* the daemon hung up */
		l->streamed += (size_t)w;
		rss = h_rss_kib(l->daemon);
		if (rss > l->peak_rss_kib)
			l->peak_rss_kib = rss;
	}
}

static const char *liar_answer(struct liar *l, const char *cmd)
{
	if (strcasecmp(cmd, "STRLEN") == 0)
		return l->lie ? ":100\r\n" : ":0\r\n";
	if (strcasecmp(cmd, "EXISTS") == 0)
		return ":0\r\n";
	if (strcasecmp(cmd, "EVAL") == 0)
		return ":1\r\n";
	return "+OK\r\n"; /* AUTH, SELECT, SET (lease and publish) */
}

static void liar_serve(struct liar *l, int fd)
{
	size_t cap = 1 << 20, len = 0, used;
	char *buf = malloc(cap), cmd[32];
	ssize_t n;

	while ((n = read(fd, buf + len, cap - len)) > 0) {
		len += (size_t)n;
		while ((used = resp_command(buf, len, cmd, sizeof cmd)) > 0) {
			memmove(buf, buf + used, len - used);
			len -= used;
			if (strcasecmp(cmd, "GET") == 0 && l->lie) {
				liar_stream(l, fd);
				free(buf);
				return;
			}
			const char *a = liar_answer(l, cmd);
			if (send(fd, a, strlen(a), MSG_NOSIGNAL) < 0)
				break;
		}
		if (len == cap)
			buf = realloc(buf, cap *= 2); /* a published blob */
	}
	free(buf);
}

static void *liar_run(void *arg)
{
	struct liar *l = arg;

	for (;;) {
		struct pollfd p[2] = {{l->lfd, POLLIN, 0}, {l->stop[0], POLLIN, 0}};
		int fd;
		if (poll(p, 2, -1) < 0 || p[1].revents)
			return NULL;
		fd = accept(l->lfd, NULL, NULL);
		if (fd >= 0) {
			liar_serve(l, fd);
			close(fd);
		}
	}
}

static void liar_start(struct liar *l)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};

	memset(l, 0, sizeof *l);
	h_tmpdir(l->r.dir, sizeof l->r.dir, "liar");
	snprintf(l->r.sock, sizeof l->r.sock, "%s/redis.sock", l->r.dir);
	snprintf(l->r.url, sizeof l->r.url, "unix://%s", l->r.sock);
	snprintf(l->r.secret, sizeof l->r.secret, "%s/secret", l->r.dir);
	write_private(l->r.secret, SECRET "\n");
	snprintf(l->r.auth, sizeof l->r.auth, "%s/auth", l->r.dir);
	write_private(l->r.auth, PASS "\n");
	snprintf(a.sun_path, sizeof a.sun_path, "%s", l->r.sock);
	l->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
	cr_assert_eq(bind(l->lfd, (struct sockaddr *)&a, sizeof a), 0);
	cr_assert_eq(listen(l->lfd, 4), 0);
	cr_assert_eq(pipe(l->stop), 0);
	pthread_create(&l->th, NULL, liar_run, l);
}

static void liar_stop(struct liar *l)
{
	cr_assert_eq(write(l->stop[1], "x", 1), 1);
	pthread_join(l->th, NULL);
	close(l->lfd);
	close(l->stop[0]);
	close(l->stop[1]);
}

/* VmHWM of pid in KiB, after writing "5" to its clear_refs resets it (when
 * that is allowed): -1 if unreadable. */
static long hwm_kib(pid_t pid)
{
	return h_status_kib(pid, "VmHWM");
}

static bool reset_hwm(pid_t pid)
{
	char path[64];
	FILE *f;
	bool ok;

	snprintf(path, sizeof path, "/proc/%d/clear_refs", (int)pid);
	f = fopen(path, "w");
	ok = f != NULL && fputs("5", f) >= 0;
	if (f)
		ok = fclose(f) == 0 && ok;
	return ok;
}

Test(remote, a_get_that_streams_past_the_max_object_is_cut_while_read_and_compiled_locally)
{
	/* a 1 MiB cap, and a timeout long enough that only the cap can stop the read */
	const char *more[] = {"--remote-max-object", "1048576", "--remote-timeout", "30000", NULL};
	const long bound_kib = 48 << 10; /* the cap, one read, the T=4 graph loaded and run */
	struct liar l;
	struct node n;
	long before_kib, hwm;
	bool hwm_reset;

	liar_start(&l);
	node_up(&n, &l.r, more);
	l.daemon = n.d.pid;
	cumsum_ok(n.c, 3); /* a miss: compiled here, loaded, run (the daemon warmed up) */
	cr_assert_eq(remote_stat(n.c, "misses"), 1);
	l.lie = true;
	before_kib = h_rss_kib(n.d.pid);
	hwm_reset = reset_hwm(n.d.pid);
	l.peak_rss_kib = before_kib;
	cumsum_ok(n.c, 4); /* STRLEN 100, then GET streams 256 MiB: cut, compiled here */
	hwm = hwm_reset ? hwm_kib(n.d.pid) : -1;
	cr_assert_lt(l.streamed, (size_t)32 << 20,
	             "the daemon hung up early: %zu bytes of the 256 MiB were sent", l.streamed);
	cr_assert_lt(l.peak_rss_kib - before_kib, bound_kib, "RSS grew %ld KiB while streaming",
	             l.peak_rss_kib - before_kib);
	if (hwm_reset)
		cr_assert_lt(hwm - before_kib, bound_kib, "peak RSS grew %ld KiB",
		             hwm - before_kib);
	else
		fprintf(stderr,
		        "WARNING: /proc/%d/clear_refs not writable: peak RSS only sampled\n",
		        (int)n.d.pid);
	cr_assert_eq(remote_stat(n.c, "reply_too_large"), 1);
	cr_assert_eq(remote_stat(n.c, "hits"), 0);
	cr_assert_eq(hd_counter(n.c, "r.cumsum", "compiles"), 2, "compiled locally");
	cr_assert(log_says(n.d.log, "while being read"), "logged: %s", n.d.log);
	cumsum_ok(n.c, 4); /* the next request: served from memory */
	cumsum_ok(n.c, 3);
	node_down(&n);
	liar_stop(&l);
}

static bool log_says(const char *path, const char *needle)
{
	FILE *f = fopen(path, "r");
	char line[512];
	bool said = false;

	while (f && fgets(line, sizeof line, f))
		said = said || strstr(line, needle) != NULL;
	if (f)
		fclose(f);
	return said;
}

Test(remote, without_the_secret_the_tier_is_off_and_the_daemon_says_so)
{
	const char *args[] = {"--no-probe", "--remote-cache", "unix:///nonexistent/redis.sock",
	                      NULL};
	const char *bad[] = {"--no-probe",           "--remote-cache", "http://example",
	                     "--remote-secret-file", "/dev/null",      NULL};
	struct hd d;
	struct tl_client *c;
	char state[32];
	bool exited = false;
	int status = 0;

	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	cr_assert_str_eq(health_remote(c, state, sizeof state), "off");
	cr_assert_eq(remote_stat(c, "hits"), -1, "no remote counters");
	cr_assert(log_says(d.log, "no --remote-secret-file"), "the log says why it is off: %s",
	          d.log);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	hd_start(&d, NULL, bad); /* a wrong URL fails the start, saying why */
	for (int k = 0; k < 1200 && !exited; k++) {
		exited = waitpid(d.pid, &status, WNOHANG) == d.pid;
		usleep(50000);
	}
	cr_assert(exited && WIFEXITED(status) && WEXITSTATUS(status) == 1, "log %s", d.log);
	d.pid = 0;
	cr_assert(log_says(d.log, "not redis://HOST"), "the log says what is wrong: %s", d.log);
}
