/*
 * bench_c.c - the C side of `make bench` (tests/bench/bench.py drives it).
 *
 *   bench_c inproc SO N T ITERS        the AOTI artifact run in this process (floor),
 *                                      results written into buffers allocated once
 *   bench_c daemon SOCK ADAPTER N T ITERS [inline|staged|inplace]
 *                                      the daemon through libtorchloop: tensors
 *                                      on the socket (inline, the default), or
 *                                      through shared memory, copied into the
 *                                      region per call (staged) or allocated
 *                                      there by the caller (inplace)
 *   bench_c clients SOCK ADAPTER N T PROCS ITERS
 *                                      PROCS client processes, ITERS scans each
 *   bench_c ping SOCK ITERS            health round trips: the protocol's floor
 *   bench_c sockpair BYTES ITERS [poll] [runner]
 *                                      round trips of BYTES over a socketpair to
 *                                      an epoll echo process: the kernel's floor;
 *                                      poll: both sides poll instead of sleeping;
 *                                      runner: the echo hands each request to a
 *                                      second thread and back first
 *   bench_c memcpy BYTES ITERS         memcpy bandwidth of BYTES
 *
 * Scans are cumulative sums: carry [N], inputs [T, N], float64.  Each mode
 * prints one JSON line: p50/p99 in microseconds, or a throughput.
 */
#include "engine.h"
#include "torchloop.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static void report(const char *mode, double *t, int n, double bytes)
{
	qsort(t, (size_t)n, sizeof *t, cmp);
	printf(
	    "{\"mode\": \"%s\", \"n\": %d, \"p50_us\": %.3f, \"p99_us\": %.3f, \"bytes\": %.0f}\n",
	    mode, n, t[n / 2], t[(int)(n * 0.99)], bytes);
}

static double *alloc_data(size_t n)
{
	double *p = aligned_alloc(64, ((n * 8 + 63) / 64) * 64);

	for (size_t i = 0; i < n; i++)
		p[i] = (double)(i % 97) * 0.01;
	return p;
}

static int inproc(const char *so, long n, long steps, int iters)
{
	struct engine_graph *g;
	struct engine_result res;
	struct proto_err err;
	double *c = alloc_data((size_t)n), *x = alloc_data((size_t)(n * steps));
	double *t = malloc(sizeof *t * (size_t)iters);
	struct engine_tensor in[2] = {
	    {PROTO_DTYPE_F64, 1, {n}, c, (uint64_t)n * 8},
	    {PROTO_DTYPE_F64, 2, {steps, n}, x, (uint64_t)(n * steps) * 8}};

	/* cumsum's results have the shapes of its inputs: carry [N], outputs [T, N] */
	uint8_t *out = aligned_alloc(64, (engine_out_layout(in, 2, NULL) + 127) & ~(uint64_t)63);

	if (engine_load(so, 1, &g, &err) != 0) {
		fprintf(stderr, "%s\n", err.message);
		return 1;
	}
	for (int i = -20; i < iters; i++) {
		double t0 = now_us();
		if (engine_run(g, in, 2, in, in, out, &res, &err) != 0) {
			fprintf(stderr, "%s\n", err.message);
			return 1;
		}
		engine_result_free(&res);
		if (i >= 0)
			t[i] = now_us() - t0;
	}
	report("inproc", t, iters, 0);
	engine_unload(g);
	free(out);
	return 0;
}

enum shm_mode { SHM_OFF, SHM_STAGED, SHM_INPLACE };

static int scans_shm(const char *sock, const char *adapter, long n, long steps, int iters,
                     double *t, enum shm_mode shm)
{
	struct tl_client *c;
	struct tl_error err;
	struct tl_builder *b = tl_builder_new();
	double *carry = alloc_data((size_t)n), *x = alloc_data((size_t)(n * steps));
	int64_t cs[] = {n}, xs[] = {steps, n};
	struct tl_tree *ct, *xt;

	if (tl_connect(sock, 5000, &c, &err) != 0) {
		fprintf(stderr, "%s\n", err.message);
		return 1;
	}
	if (shm != SHM_OFF) {
		/* inputs + outputs + room: 4 x (carry + inputs), at least 16 MiB */
		size_t bytes = (size_t)(n + n * steps) * 8 * 4;
		if (tl_shm_attach(c, bytes < (16u << 20) ? 16u << 20 : bytes, &err) != 0) {
			fprintf(stderr, "%s: %s\n", err.code, err.message);
			return 1;
		}
		tl_shm_set_threshold(c, 1); /* every tensor by reference: the mode under test */
	}
	if (shm == SHM_INPLACE) {
		double *rc = tl_shm_alloc(c, (size_t)n * 8),
		       *rx = tl_shm_alloc(c, (size_t)(n * steps) * 8);
		memcpy(rc, carry, (size_t)n * 8);
		memcpy(rx, x, (size_t)(n * steps) * 8);
		free(carry);
		free(x);
		carry = NULL;
		x = NULL;
		ct = tl_tensor(b, TL_FLOAT64, 1, cs, rc);
		xt = tl_tensor(b, TL_FLOAT64, 2, xs, rx);
	} else {
		ct = tl_tensor(b, TL_FLOAT64, 1, cs, carry);
		xt = tl_tensor(b, TL_FLOAT64, 2, xs, x);
	}
	for (int i = -20; i < iters; i++) {
		struct tl_reply *r;
		double t0 = now_us();
		if (tl_scan(c, adapter, ct, xt, &r, &err) != 0) {
			fprintf(stderr, "%s: %s\n", err.code, err.message);
			return 1;
		}
		tl_reply_free(r);
		if (i >= 0 && t)
			t[i] = now_us() - t0;
	}
	tl_close(c);
	tl_builder_free(b);
	free(carry);
	free(x);
	return 0;
}

static int scans(const char *sock, const char *adapter, long n, long steps, int iters, double *t)
{
	return scans_shm(sock, adapter, n, steps, iters, t, SHM_OFF);
}

static int clients(const char *sock, const char *adapter, long n, long steps, int procs, int iters)
{
	double t0 = now_us(), wall;
	int failed = 0;

	for (int p = 0; p < procs; p++)
		if (fork() == 0)
			_exit(scans(sock, adapter, n, steps, iters, NULL));
	for (int p = 0; p < procs; p++) {
		int status;
		wait(&status);
		failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
	}
	wall = (now_us() - t0) * 1e-6;
	printf("{\"mode\": \"clients\", \"procs\": %d, \"scans\": %d, \"seconds\": %.3f, "
	       "\"scans_per_s\": %.1f, \"failed\": %d}\n",
	       procs, procs * (iters + 20), wall, procs * (iters + 20) / wall, failed);
	return failed != 0;
}

static int ping(const char *sock, int iters)
{
	struct tl_client *c;
	struct tl_error err;
	double *t = malloc(sizeof *t * (size_t)iters);
	int ready;

	if (tl_connect(sock, 5000, &c, &err) != 0) {
		fprintf(stderr, "%s\n", err.message);
		return 1;
	}
	for (int i = -20; i < iters; i++) {
		double t0 = now_us();
		if (tl_health(c, &ready, &err) != 0) {
			fprintf(stderr, "%s: %s\n", err.code, err.message);
			return 1;
		}
		if (i >= 0)
			t[i] = now_us() - t0;
	}
	tl_close(c);
	report("ping", t, iters, 0);
	return 0;
}

/* The echo's hand-off thread ("runner"): woken through a condition
 * variable, it answers through an eventfd, as torchloopd's runner thread
 * hands a run with an OpenMP team back to the loop (daemon/base/runner.c). */
struct handoff {
	pthread_mutex_t lock;
	pthread_cond_t wake;
	bool pending;
	int done_fd;
};

static void *handoff_main(void *arg)
{
	struct handoff *h = arg;
	uint64_t one = 1;

	pthread_mutex_lock(&h->lock);
	for (;;) {
		while (!h->pending)
			pthread_cond_wait(&h->wake, &h->lock);
		h->pending = false;
		if (write(h->done_fd, &one, sizeof one) != sizeof one)
			break;
	}
	pthread_mutex_unlock(&h->lock);
	return NULL;
}

/* echo: epoll_wait (timeout 0 when polling), read, write, like the daemon's
 * loop; with a runner, each request goes to it and back before the reply. */
static void echo(int fd, char *buf, long bytes, bool poll, bool runner)
{
	struct handoff h = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, -1};
	struct epoll_event ev = {.events = EPOLLIN};
	int ep = epoll_create1(0);
	ssize_t n = 0;
	pthread_t t;

	h.done_fd = eventfd(0, EFD_NONBLOCK);
	ev.data.fd = fd;
	epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
	ev.data.fd = h.done_fd;
	epoll_ctl(ep, EPOLL_CTL_ADD, h.done_fd, &ev);
	if (runner && pthread_create(&t, NULL, handoff_main, &h) != 0)
		_exit(1);
	for (;;) {
		uint64_t k;

		if (epoll_wait(ep, &ev, 1, poll ? 0 : -1) != 1)
			continue;
		if (ev.data.fd == h.done_fd) {
			if (read(h.done_fd, &k, sizeof k) != sizeof k ||
			    write(fd, buf, (size_t)n) != n)
				_exit(0);
			continue;
		}
		n = read(fd, buf, (size_t)bytes);
		if (n <= 0 || (!runner && write(fd, buf, (size_t)n) != n))
			_exit(0);
		if (runner) {
			pthread_mutex_lock(&h.lock);
			h.pending = true;
			pthread_cond_signal(&h.wake);
			pthread_mutex_unlock(&h.lock);
		}
	}
}

/* Round trips of BYTES to the echo process; poll: both sides poll (the
 * client recv with MSG_DONTWAIT, the echo epoll_wait with no timeout), as
 * torchloopd and its clients do around a small inline run; else both sleep. */
static int sockpair(long bytes, int iters, bool poll, bool runner)
{
	int sv[2];
	char *buf = calloc(1, (size_t)bytes);
	double *t = malloc(sizeof *t * (size_t)iters);
	pid_t pid;

	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
		return 1;
	pid = fork();
	if (pid == 0) {
		close(sv[0]);
		echo(sv[1], buf, bytes, poll, runner);
		_exit(0);
	}
	close(sv[1]);
	for (int i = -20 - iters / 10; i < iters; i++) {
		double t0 = now_us();
		ssize_t got = 0;
		if (write(sv[0], buf, (size_t)bytes) != bytes)
			return 1;
		while (got < bytes) {
			ssize_t n =
			    recv(sv[0], buf + got, (size_t)(bytes - got), poll ? MSG_DONTWAIT : 0);
			if (n == 0 || (n < 0 && errno != EAGAIN))
				return 1;
			got += n > 0 ? n : 0;
		}
		if (i >= 0)
			t[i] = now_us() - t0;
	}
	close(sv[0]);
	waitpid(pid, NULL, 0);
	report(runner ? (poll ? "sockpair_runner_poll" : "sockpair_runner")
	              : (poll ? "sockpair_poll" : "sockpair"),
	       t, iters, (double)bytes);
	return 0;
}

static int bench_memcpy(long bytes, int iters)
{
	char *a = malloc((size_t)bytes), *b = malloc((size_t)bytes);
	double *t = malloc(sizeof *t * (size_t)iters);

	memset(a, 1, (size_t)bytes);
	memset(b, 2, (size_t)bytes);
	for (int i = 0; i < iters; i++) {
		double t0 = now_us();
		memcpy(b, a, (size_t)bytes);
		t[i] = now_us() - t0;
		a[i % bytes] = b[(i * 7) % bytes];
	}
	report("memcpy", t, iters, (double)bytes);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 6 && strcmp(argv[1], "inproc") == 0)
		return inproc(argv[2], atol(argv[3]), atol(argv[4]), atoi(argv[5]));
	if ((argc == 7 || argc == 8) && strcmp(argv[1], "daemon") == 0) {
		int iters = atoi(argv[6]);
		double *t = malloc(sizeof *t * (size_t)iters);
		long n = atol(argv[4]), steps = atol(argv[5]);
		const char *mode = argc == 8 ? argv[7] : "inline";
		enum shm_mode shm = strcmp(mode, "staged") == 0    ? SHM_STAGED
		                    : strcmp(mode, "inplace") == 0 ? SHM_INPLACE
		                                                   : SHM_OFF;
		if (scans_shm(argv[2], argv[3], n, steps, iters, t, shm) != 0)
			return 1;
		report(mode, t, iters, (double)(n + 2 * n * steps + n) * 8);
		return 0;
	}
	if (argc == 8 && strcmp(argv[1], "clients") == 0)
		return clients(argv[2], argv[3], atol(argv[4]), atol(argv[5]), atoi(argv[6]),
		               atoi(argv[7]));
	if (argc == 4 && strcmp(argv[1], "ping") == 0)
		return ping(argv[2], atoi(argv[3]));
	if (argc >= 4 && argc <= 6 && strcmp(argv[1], "sockpair") == 0) {
		bool poll = false, runner = false;

		for (int i = 4; i < argc; i++) {
			poll |= strcmp(argv[i], "poll") == 0;
			runner |= strcmp(argv[i], "runner") == 0;
		}
		return sockpair(atol(argv[2]), atoi(argv[3]), poll, runner);
	}
	if (argc == 4 && strcmp(argv[1], "memcpy") == 0)
		return bench_memcpy(atol(argv[2]), atoi(argv[3]));
	fprintf(stderr, "usage: see the comment at the top of tests/bench/bench_c.c\n");
	return 2;
}
