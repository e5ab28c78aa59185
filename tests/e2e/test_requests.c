/*
 * test_requests.c - the request path: inline runs, pipelined scans past
 * the write-queue cap (backpressure), a broken frame after good ones.
 *
 * Most tests reuse one cheap specialization (t4.cumsum, float64, T=3,
 * carry [4]; fixture.h) so the file compiles only a handful of graphs per run.
 */
#include "fixture.h"
#include "harness.h"

#include "frame.h"
#include "params.h"
#include "tree.h"
#include "writer.h"
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(requests, .timeout = 900);

/* ---- the request path: inline runs, pipelining, backpressure --------------------- */

/* The bytes of one scan request frame (header included) for t4.cumsum. */
static uint8_t *scan_frame_bytes(struct fixture *f, uint64_t id, size_t *len)
{
	struct tree_node carry = {.kind = TREE_TENSOR}, inputs = {.kind = TREE_TENSOR};
	struct writer w;
	struct iovec iov[16];
	struct proto_err err;
	uint8_t *out;
	int n;

	carry.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 1, {4}, 0, 0, f->carry};
	inputs.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 2, {3, 4}, 0, 0, f->xs};
	cr_assert_eq(tree_tensor_sizes(&carry.tensor), 0);
	cr_assert_eq(tree_tensor_sizes(&inputs.tensor), 0);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, id, "scan", 3);
	writer_key_str(&w, "adapter", "t4.cumsum");
	writer_str(&w, "carry");
	tree_encode(&w, &carry);
	writer_str(&w, "inputs");
	tree_encode(&w, &inputs);
	n = writer_finish(&w, iov, 16, PROTO_FRAME_MAX, &err);
	cr_assert_gt(n, 0, "%s", err.message);
	*len = 0;
	for (int i = 0; i < n; i++)
		*len += iov[i].iov_len;
	out = malloc(*len);
	for (size_t i = 0, at = 0; i < (size_t)n; at += iov[i].iov_len, i++)
		memcpy(out + at, iov[i].iov_base, iov[i].iov_len);
	writer_destroy(&w);
	return out;
}

/* Checks one raw scan reply by hand (carry + running sums); returns its id. */
static uint64_t check_scan_reply(struct fixture *f, int fd)
{
	uint8_t *body;
	struct msg m;
	struct tree_node fin;
	struct proto_err err;
	const double *got;

	uint64_t id;

	cr_assert_eq(raw_recv_msg(fd, &body, &m), 0, "a reply is missing");
	cr_assert(!m.is_error && m.has_id, "error reply (%d) or no id", m.is_error);
	id = m.id;
	cr_assert_eq(tree_decode(msg_obj_field(msg_field(&m, "result"), "carry"), m.up.zone,
	                         "carry", &fin, &err),
	             0, "%s", err.message);
	got = fin.tensor.data;
	for (int k = 0; k < 4; k++)
		cr_assert_float_eq(got[k], f->carry[k] + f->xs[k] + f->xs[4 + k] + f->xs[8 + k],
		                   1e-12);
	msg_destroy(&m);
	frame_free(body);
	return id;
}

/*
 * Thousands of small scans pipelined on one connection whose client does not
 * read: the replies pile up past --write-queue-cap, the daemon stops reading
 * that connection (with requests still staged from its last read) and serves
 * others; once the client drains its replies every one arrives whole, once,
 * with the right numbers (replies may overtake each other: match by id).  The graph is µs-scale, so
 * after its first runs it runs on the loop thread (stats.inline_runs).
 */
Test(requests, pipelined_scans_past_the_write_queue_cap_pause_then_all_arrive)
{
	/* --inline-run-us at its maximum: whether these µs-scale runs stay on the
	 * loop must not depend on how fast this machine (or ASan) runs them */
	static const char *const args[] = {"--no-probe", "--socket-mode",
	                                   "0666",       "--write-queue-cap",
	                                   "1048576",    "--max-inflight",
	                                   "4096",       "--inline-run-us",
	                                   "100000",     NULL};
	enum { N_REQ = 12000 };
	struct fixture f;
	size_t one;
	uint8_t *frame;
	int fd;
	pid_t writer;
	uint64_t breaches0;
	static bool seen[N_REQ + 1];

	setup(&f, args);
	scan_ok(&f, f.c);
	breaches0 = h_stat(f.c, "limit_breaches");
	fd = raw_connect(f.d.sock);
	frame = scan_frame_bytes(&f, 1, &one);
	writer = fork();
	if (writer == 0) { /* blocks once the daemon stops reading; ids 1..N_REQ */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		for (uint64_t id = 1; id <= N_REQ; id++) {
			free(frame);
			frame = scan_frame_bytes(&f, id, &one);
			raw_send(fd, frame, one);
		}
		_exit(0);
	}
	for (int i = 0; i < 600 && h_stat(f.c, "limit_breaches") == breaches0; i++)
		usleep(50 * 1000);
	cr_assert_gt(h_stat(f.c, "limit_breaches"), breaches0,
	             "the write queue passed its cap and the connection's reads paused");
	scan_ok(&f, f.c); /* other connections are served meanwhile */
	for (int i = 0; i < N_REQ; i++) {
		uint64_t id = check_scan_reply(&f, fd);
		cr_assert(id >= 1 && id <= N_REQ && !seen[id], "id %llu unexpected or repeated",
		          (unsigned long long)id);
		seen[id] = true;
	}
	cr_assert_eq(waitpid(writer, NULL, 0), writer);
	cr_assert_gt(h_stat(f.c, "inline_runs"), N_REQ / 2, "µs-scale runs stay on the loop");
	close(fd);
	free(frame);
	scan_ok(&f, f.c);
	teardown(&f);
}

/* --inline-run-us 0 keeps every run on the pool; the numbers are the same. */
Test(requests, inline_runs_can_be_switched_off)
{
	static const char *const args[] = {"--no-probe", "--inline-run-us", "0", NULL};
	struct fixture f;

	setup(&f, args);
	for (int i = 0; i < 20; i++)
		scan_ok(&f, f.c);
	cr_assert_eq(h_stat(f.c, "inline_runs"), 0);
	teardown(&f);
}

/* stats' counted map holds all it says: the counters, then the nested parts */
static void stats_has_every_key(struct fixture *f)
{
	json_t *j = h_call_json(f->c, "stats", NULL);

	cr_assert(json_is_integer(json_object_get(j, "contended_runs")), "stats.contended_runs");
	cr_assert(json_is_integer(json_object_get(j, "busy")), "stats.busy");
	cr_assert(json_is_object(json_object_get(j, "lanes")), "stats.lanes");
	cr_assert(json_is_object(json_object_get(j, "error_codes")), "stats.error_codes");
	cr_assert(json_is_array(json_object_get(j, "adapters")), "stats.adapters");
	json_decref(j);
}

/*
 * --threads 1: a run's OpenMP team is every core the daemon may use, so on a
 * machine of two or more every run goes to the one graph runner
 * (stats.runner_runs), none to the pool (docs/architecture.md, "Threads and
 * ownership"); the numbers are the hand-computed ones all the same (scan_ok).  On one
 * core the team is one thread and the runs stay on the pool: the test says
 * so and checks that instead.
 */
Test(requests, runs_with_an_openmp_team_go_to_the_graph_runner)
{
	static const char *const args[] = {"--no-probe", "--inline-run-us", "0", "--threads", "1",
	                                   NULL};
	struct fixture f;
	cpu_set_t set;
	int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
	uint64_t before;

	setup(&f, args);
	before = h_stat(f.c, "runner_runs");
	for (int i = 0; i < 20; i++)
		scan_ok(&f, f.c);
	if (cpus >= 2) {
		cr_assert_geq(h_stat(f.c, "runner_runs") - before, 20,
		              "runs of a team left the runner");
	} else {
		h_not_checked("runs_with_an_openmp_team_go_to_the_graph_runner: ONE CPU, the "
		              "runner is not used (teams of one thread): checking that instead");
		cr_assert_eq(h_stat(f.c, "runner_runs"), 0);
	}
	cr_assert_eq(h_stat(f.c, "inline_runs"), 0);
	stats_has_every_key(&f);
	teardown(&f);
}

/*
 * Frames staged from one read: two good requests, then a header announcing a
 * frame over --max-frame, all in one write.  Both requests are answered, then
 * FRAME_TOO_LARGE (no id), then the connection closes; others are served.
 */
Test(requests, a_broken_frame_after_good_ones_in_one_read_answers_them_then_closes)
{
	static const char h1[] = "\x82\xa2id\x01\xa2op\xa6"
	                         "health",
	                  h2[] = "\x82\xa2id\x02\xa2op\xa6"
	                         "health";
	uint8_t bytes[2 * (4 + sizeof h1) + 4], *p = bytes;
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	setup(&f, NULL);
	frame_put_header(p, sizeof h1 - 1);
	memcpy(p + 4, h1, sizeof h1 - 1);
	p += 4 + sizeof h1 - 1;
	frame_put_header(p, sizeof h2 - 1);
	memcpy(p + 4, h2, sizeof h2 - 1);
	p += 4 + sizeof h2 - 1;
	frame_put_header(p, 0x7fffffff); /* over the default 64 MiB max-frame */
	p += 4;
	fd = raw_connect(f.d.sock);
	raw_send(fd, bytes, (size_t)(p - bytes));
	for (long long want = 1; want <= 2; want++) {
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
		cr_assert_str_eq(code, "", "%s", msg);
		cr_assert_eq(id, want);
	}
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "FRAME_TOO_LARGE", "%s", msg);
	cr_assert_eq(id, -1);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1, "closed after");
	close(fd);
	scan_ok(&f, f.c);
	teardown(&f);
}

/*
 * Busy polling (--busy-poll-us, proto/busypoll.h; docs/operations.md): once
 * every request is answered the loop polls for the next one before it
 * sleeps, so requests one client sends back to back are found by polling
 * (stats.busy_polled); with --busy-poll-us 0 none is.  The numbers are the
 * hand-computed ones either way (scan_ok).  On one core the daemon never
 * polls: the test says so and checks that instead.
 */
Test(requests, back_to_back_requests_are_found_by_the_polling_loop)
{
	static const char *const on[] = {"--no-probe", "--busy-poll-us", "1000", NULL};
	static const char *const off[] = {"--no-probe", "--busy-poll-us", "0", NULL};
	struct fixture f;
	cpu_set_t set;
	int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;

	setup(&f, on);
	for (int i = 0; i < 200; i++)
		scan_ok(&f, f.c);
	if (cpus >= 2) {
		cr_assert_gt(h_stat(f.c, "busy_polled"), 0, "no request was found by polling");
	} else {
		h_not_checked("back_to_back_requests_are_found_by_the_polling_loop: ONE CPU, "
		              "the loop never polls: checking that instead");
		cr_assert_eq(h_stat(f.c, "busy_polled"), 0);
	}
	teardown(&f);
	setup(&f, off);
	for (int i = 0; i < 20; i++)
		scan_ok(&f, f.c);
	cr_assert_eq(h_stat(f.c, "busy_polled"), 0);
	teardown(&f);
}

/*
 * The client's side (client/torchloop.c, BUSYPOLL_MAX_REQUEST): libtorchloop
 * polls for the replies of requests under 256 KiB of tensors only -- a larger
 * request's graph may run with an OpenMP team on every core, which a polling
 * client would take one from.  Small scans back to back are served by polling
 * (tl_polled_reads); scans of 2 x 160 KiB never are, whatever the timing.
 * On one core the client never polls: the test says so and checks that.
 */
Test(requests, the_client_polls_only_for_the_replies_of_requests_under_256_kib)
{
	enum { N = 20480 }; /* carry [N] + inputs [1, N], float64: 320 KiB */
	static const char *const on[] = {"--no-probe", "--busy-poll-us", "1000", NULL};
	static double carry[N], xs[N];
	int64_t cs[] = {N}, xshape[] = {1, N};
	struct fixture f;
	struct tl_reply *r;
	struct tl_error err;
	struct tl_tree *ct, *xt;
	cpu_set_t set;
	int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
	uint64_t small, before;

	setup(&f, on);
	tl_set_busy_poll(f.c, 1000);
	before = tl_polled_reads(f.c);
	for (int i = 0; i < 200; i++)
		scan_ok(&f, f.c);
	small = tl_polled_reads(f.c) - before;
	if (cpus >= 2) {
		cr_assert_gt(small, 0, "no reply to a small scan was served by polling");
	} else {
		h_not_checked("the_client_polls_only_for_the_replies_of_requests_under_256_kib: "
		              "ONE CPU, the client never polls: checking that instead");
		cr_assert_eq(small, 0);
	}

	hd_register(f.c, "big.cumsum", CUMSUM, "body", 1, N, 2);
	h_fill(carry, TL_FLOAT64, N, 21);
	h_fill(xs, TL_FLOAT64, N, 22);
	ct = tl_tensor(f.b, TL_FLOAT64, 1, cs, carry);
	xt = tl_tensor(f.b, TL_FLOAT64, 2, xshape, xs);
	before = tl_polled_reads(f.c);
	for (int i = 0; i < 20; i++) {
		const double *y, *fin;

		cr_assert_eq(tl_scan(f.c, "big.cumsum", ct, xt, &r, &err), 0, "%s %s", err.code,
		             err.message);
		y = tl_tree_data(tl_reply_tree(r, "outputs"));
		fin = tl_tree_data(tl_reply_tree(r, "carry"));
		for (int k = 0; k < N; k += 997) {
			cr_assert_float_eq(y[k], carry[k] + xs[k], 1e-12);
			cr_assert_float_eq(fin[k], carry[k] + xs[k], 1e-12);
		}
		tl_reply_free(r);
	}
	cr_assert_eq(tl_polled_reads(f.c), before, "a reply to a 320 KiB request was polled for");
	scan_ok(&f, f.c);
	teardown(&f);
}
