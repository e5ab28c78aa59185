/*
 * test_codes.c - every error code of proto/protocol.h reaches a client over
 * the socket in some end-to-end test.  WHERE names, for each code, the test
 * that sends what produces it; the first test fails when a code has no row,
 * or a row names a test that does not exist or a file that never names the
 * code.  The codes no other suite produced have their tests here, each
 * checking that the daemon serves the next request:
 *
 *   - malformed trees in a scan and a frame of too many msgpack objects;
 *   - a reply cut inside its frame by a proxy (FRAME_TRUNCATED, never the
 *     clean close a cut at the frame boundary is);
 *   - an artifact the worker's check refuses (UNSAFE_ARTIFACT: the worker's
 *     test hook TORCHLOOP_TEST_EXEC_STACK marks it executable-stack);
 *   - a cache directory broken under the daemon (INTERNAL), then a cached
 *     artifact that does not load (ENGINE_ERROR: set aside, and the next
 *     request served from a good entry).
 *
 * Compiles: one (the refused artifact), and t4.cumsum's T=3 graph, shared.
 */
#include "fixture.h"
#include "harness.h"

#include "protocol.h"
#include "tree.h"
#include "writer.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <jansson.h>
#include <msgpack.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(codes, .timeout = 600);

/* ---- every code has a test ---------------------------------------------------------- */

static const struct where {
	const char *code, *file, *test;
} WHERE[] = {
    {"FRAME_TOO_LARGE", "test_ops.c",
     "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"FRAME_TRUNCATED", "test_codes.c", "a_reply_cut_inside_its_frame_is_frame_truncated"},
    {"FRAME_TIMEOUT", "test_reliability.c",
     "a_frame_that_stops_arriving_is_closed_after_the_frame_timeout"},
    {"MSGPACK_INVALID", "test_ops.c",
     "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"MSGPACK_COUNT_TOO_LARGE", "test_ops.c",
     "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"OBJECT_LIMIT", "test_codes.c", "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"NOT_A_MAP", "test_ops.c", "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"BAD_ENVELOPE", "test_ops.c", "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"UNKNOWN_OP", "test_ops.c", "hostile_frames_get_their_code_and_only_broken_framing_closes"},
    {"VERSION_MISMATCH", "test_ops.c", "a_protocol_mismatch_is_refused_naming_both_versions"},
    {"DEPTH_EXCEEDED", "test_codes.c",
     "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"TOO_MANY_LEAVES", "test_codes.c",
     "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"KEY_TOO_LONG", "test_codes.c", "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"DUPLICATE_KEY", "test_reliability.c",
     "compile_refuses_duplicate_keys_and_names_the_cause_once"},
    {"NON_STRING_KEY", "test_codes.c",
     "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"UNKNOWN_TYPE", "test_codes.c", "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"BAD_DTYPE", "test_codes.c", "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"BAD_SHAPE", "test_codes.c", "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"SHAPE_OVERFLOW", "test_codes.c",
     "malformed_trees_get_their_code_and_the_connection_serves_on"},
    {"BYTE_LENGTH_MISMATCH", "test_shm.c", "bad_references_get_their_codes"},
    {"INVALID_ARGUMENT", "test_ops.c", "register_validation_uses_the_reference_messages"},
    {"BAD_REQUEST", "test_codes.c", "text_that_is_not_utf8_is_bad_request_and_no_worker_sees_it"},
    {"INVALID_NAME", "test_ops.c", "register_validation_uses_the_reference_messages"},
    {"INVALID_BOUNDS", "test_ops.c", "register_validation_uses_the_reference_messages"},
    {"NOT_FOUND", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"DTYPE_MISMATCH", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"NO_INPUTS", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"BAD_RANK", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"LENGTH_MISMATCH", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"BATCH_MISMATCH", "test_dynamic.c",
     "batch_errors_get_their_code_and_path_and_the_daemon_serves_on"},
    {"TOO_MANY_STEPS", "test_ops.c", "each_bad_scan_gets_its_code_and_leaf_path"},
    {"TOO_MANY_ELEMENTS", "test_chunk.c",
     "stacked_outputs_over_max_elements_are_refused_and_the_next_scan_served"},
    {"SPEC_MISMATCH", "test_capture.py", "test_a_scan_unlike_its_captured_graph_is_spec_mismatch"},
    {"COTANGENT_MISMATCH", "test_grad.c", "mismatched_cotangents_get_their_code_and_leaf_path"},
    {"SAVED_MISMATCH", "test_saved.py",
     "test_a_bad_saved_grad_gets_its_code_and_the_daemon_serves_on"},
    {"SHM_NO_FD", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_ALREADY_ATTACHED", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_BAD_FD", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_NOT_SEALED", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_UNDERSIZED", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_TOO_LARGE", "test_shm.c", "bad_descriptors_get_their_codes"},
    {"SHM_NOT_ATTACHED", "test_shm.c", "bad_references_get_their_codes"},
    {"SHM_OUT_OF_BOUNDS", "test_shm.c", "bad_references_get_their_codes"},
    {"SHM_MISALIGNED", "test_shm.c", "bad_references_get_their_codes"},
    {"SHM_OVERLAP", "test_shm.c", "bad_references_get_their_codes"},
    {"RECOMPILE_BUDGET_EXHAUSTED", "test_ops.c",
     "the_budget_is_per_adapter_and_replacement_resets_it"},
    {"BODY_ERROR", "test_compile_path.c", "a_failing_body_gets_its_code_and_the_daemon_serves_on"},
    {"GRAPH_BREAK", "test_compile_path.c", "a_failing_body_gets_its_code_and_the_daemon_serves_on"},
    {"BAD_GRAPH", "test_capture.py", "test_the_daemon_still_serves_after_every_refusal"},
    {"UNSUPPORTED_OP", "test_compile_path.c",
     "a_failing_body_gets_its_code_and_the_daemon_serves_on"},
    {"CARRY_MISMATCH", "test_compile_path.c",
     "a_failing_body_gets_its_code_and_the_daemon_serves_on"},
    {"PROXY_EXECUTOR_REQUIRED", "test_reliability.c",
     "a_graph_that_needs_the_proxy_executor_is_refused_at_compile_time"},
    {"UNSAFE_ARTIFACT", "test_codes.c", "an_artifact_the_check_refuses_is_unsafe_artifact"},
    {"BATCH_SPECIALIZED", "test_dynamic.c",
     "a_body_that_fixes_the_batch_size_is_refused_with_BATCH_SPECIALIZED"},
    {"MISCOMPILE", "test_compile_path.c",
     "an_artifact_that_disagrees_with_the_eager_scan_is_refused"},
    {"COMPILE_FAILED", "test_reliability.c",
     "a_full_disk_fails_the_compile_with_its_cause_and_is_not_remembered"},
    {"COMPILE_TIMEOUT", "test_reliability.c",
     "a_timeout_kills_the_worker_and_everything_it_started"},
    {"WORKER_CRASHED", "test_reliability.c",
     "a_body_that_kills_the_worker_twice_is_refused_until_re_registered"},
    {"ARTIFACT_CORRUPT", "test_reliability.c", "tampered_cache_entries_are_refused_and_rebuilt"},
    {"INDEX_OUT_OF_RANGE", "test_index.c",
     "an_index_out_of_range_fails_the_request_and_the_daemon_serves_on"},
    {"LINALG_ERROR", "test_reliability.c",
     "a_linear_solve_in_a_step_runs_and_a_singular_one_fails_the_run"},
    {"ENGINE_ERROR", "test_codes.c",
     "a_broken_cache_is_internal_and_an_unloadable_entry_engine_error"},
    {"PERMISSION_DENIED", "test_service.c",
     "admin_ops_from_another_uid_are_refused_but_scans_work"},
    {"BUSY", "test_reliability.c", "one_uid_cannot_take_every_connection"},
    {"SHUTTING_DOWN", "test_service.c", "sigterm_with_requests_in_flight_sends_no_truncated_reply"},
    {"INTERNAL", "test_codes.c", "a_broken_cache_is_internal_and_an_unloadable_entry_engine_error"},
};

/* The row's file names the code (quoted) and defines the named test. */
static void check_row(const struct where *w)
{
	char path[1024], quoted[80], def[300];
	bool py = strstr(w->file, ".py") != NULL;
	char *text;

	snprintf(path, sizeof path, "%s/tests/%s/%s", h_root(), py ? "python" : "e2e", w->file);
	text = h_slurp(path);
	snprintf(def, sizeof def, py ? "def %s(" : ", %s)", w->test);
	cr_assert_not_null(strstr(text, def), "%s: no test %s (the row of %s)", w->file, w->test,
	                   w->code);
	snprintf(quoted, sizeof quoted, "\"%s\"", w->code);
	cr_assert_not_null(strstr(text, quoted), "%s never names %s", w->file, w->code);
	free(text);
}

Test(codes, every_error_code_has_a_test_that_sends_what_produces_it)
{
#define NAME(e, s, d) s,
	static const char *const codes[] = {PROTO_ERRORS(NAME)};
#undef NAME
	size_t n = sizeof WHERE / sizeof WHERE[0];

	for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
		const struct where *w = NULL;
		if (strcmp(codes[i], "OK") == 0)
			continue;
		for (size_t k = 0; k < n && w == NULL; k++)
			if (strcmp(WHERE[k].code, codes[i]) == 0)
				w = &WHERE[k];
		cr_assert_not_null(
		    w, "%s (proto/protocol.h) has no row in WHERE: which test sends it?", codes[i]);
		check_row(w);
	}
	cr_assert_eq(n, sizeof codes / sizeof codes[0] - 1, "a row of WHERE names no code");
}

/* ---- malformed trees ---------------------------------------------------------------- */

typedef void (*pack_fn)(msgpack_packer *pk);

static void too_deep(msgpack_packer *pk)
{
	for (int i = 0; i <= PROTO_MAX_TREE_DEPTH; i++)
		msgpack_pack_array(pk, 1);
	msgpack_pack_nil(pk);
}

static void too_many_leaves(msgpack_packer *pk)
{
	msgpack_pack_array(pk, PROTO_MAX_LEAVES + 1);
	for (int i = 0; i <= PROTO_MAX_LEAVES; i++)
		msgpack_pack_nil(pk);
}

static void too_many_objects(msgpack_packer *pk)
{
	msgpack_pack_array(pk, PROTO_MAX_OBJECTS);
	for (int i = 0; i < PROTO_MAX_OBJECTS; i++)
		msgpack_pack_nil(pk);
}

static void long_key(msgpack_packer *pk)
{
	char key[PROTO_MAX_KEY_BYTES + 1];

	memset(key, 'k', sizeof key);
	msgpack_pack_map(pk, 1);
	msgpack_pack_str_with_body(pk, key, sizeof key);
	msgpack_pack_nil(pk);
}

static void int_key(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 1);
	msgpack_pack_int(pk, 1);
	msgpack_pack_nil(pk);
}

static void an_integer(msgpack_packer *pk)
{
	msgpack_pack_int(pk, 5);
}

static void unknown_ext(msgpack_packer *pk)
{
	msgpack_pack_ext(pk, 0, 9);
}

/* A tensor leaf: the 4-byte header, ndim little-endian dims, nbytes of data. */
static void tensor(msgpack_packer *pk, uint8_t dtype, uint8_t ndim, const uint64_t *dims,
                   size_t nbytes)
{
	uint8_t buf[4 + 8 * 16 + 64] = {dtype, ndim, 0, 0};
	size_t n = 4;

	for (uint8_t i = 0; i < ndim; i++, n += 8)
		for (int b = 0; b < 8; b++)
			buf[n + (size_t)b] = (uint8_t)(dims[i] >> (8 * b));
	msgpack_pack_ext(pk, n + nbytes, PROTO_EXT_TENSOR);
	msgpack_pack_ext_body(pk, buf, n + nbytes);
}

static void bad_dtype(msgpack_packer *pk)
{
	tensor(pk, 7, 1, (const uint64_t[]){4}, 32);
}

static void rank_nine(msgpack_packer *pk)
{
	tensor(pk, PROTO_DTYPE_F64, PROTO_MAX_NDIM + 1,
	       (const uint64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 4}, 32);
}

static void overflow(msgpack_packer *pk)
{
	tensor(pk, PROTO_DTYPE_F64, 2, (const uint64_t[]){1ull << 40, 1ull << 40}, 0);
}

static const struct tree_case {
	const char *what, *code;
	pack_fn carry;
} TREES[] = {
    {"17 nested lists", "DEPTH_EXCEEDED", too_deep},
    {"4097 None leaves", "TOO_MANY_LEAVES", too_many_leaves},
    {"65536 msgpack objects", "OBJECT_LIMIT", too_many_objects},
    {"a 257-byte dict key", "KEY_TOO_LONG", long_key},
    {"a dict key 1", "NON_STRING_KEY", int_key},
    {"an integer leaf", "UNKNOWN_TYPE", an_integer},
    {"ext type 9", "UNKNOWN_TYPE", unknown_ext},
    {"dtype code 7", "BAD_DTYPE", bad_dtype},
    {"rank 9", "BAD_SHAPE", rank_nine},
    {"2^40 x 2^40 elements", "SHAPE_OVERFLOW", overflow},
};

/* A scan of t4.cumsum whose carry is what tc packs (inputs: a good [3, 4]). */
static uint8_t *bad_scan_frame(const struct tree_case *tc, size_t *len)
{
	static double xs[12];
	struct tree_node xn = {.kind = TREE_TENSOR};
	struct writer w;
	struct proto_err err;
	uint8_t *out;

	xn.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 2, {3, 4}, 0, 0, xs};
	cr_assert_eq(tree_tensor_sizes(&xn.tensor), 0);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 21, "scan", 3);
	writer_key_str(&w, "adapter", "t4.cumsum");
	writer_str(&w, "carry");
	tc->carry(&w.pk);
	writer_str(&w, "inputs");
	tree_encode(&w, &xn);
	out = writer_flatten(&w, len, PROTO_FRAME_MAX, &err);
	cr_assert_not_null(out, "%s", err.message);
	writer_destroy(&w);
	return out;
}

Test(codes, malformed_trees_get_their_code_and_the_connection_serves_on)
{
	static const char health[] = "\x82\xa2id\x09\xa2op\xa6"
	                             "health";
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	fd = setup_raw(&f, NULL);
	for (size_t i = 0; i < sizeof TREES / sizeof TREES[0]; i++) {
		size_t len;
		uint8_t *frame = bad_scan_frame(&TREES[i], &len);

		raw_send(fd, frame, len);
		free(frame);
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0,
		             "%s: no reply", TREES[i].what);
		cr_assert_str_eq(code, TREES[i].code, "%s: %s", TREES[i].what, msg);
		raw_send_frame(fd, health, sizeof health - 1);
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
		cr_assert_str_eq(code, "", "%s: the connection still serves: %s", TREES[i].what,
		                 msg);
	}
	close(fd);
	scan_ok(&f, f.c);
	teardown(&f);
}

/* ---- text that is not UTF-8 ------------------------------------------------------------ */

/* A register whose body_graph (graph) or body_file (source) holds bytes that
 * are not UTF-8: an invalid lead byte in a graph's string, an overlong "/"
 * in a path.  Each killed the compile worker once. */
static uint8_t *bad_text_frame(uint64_t id, bool graph, size_t *len)
{
	static const char graph_text[] = "{\"format\": \"torchloop-graph\", \"kw\": \"\xff\xfe\"}";
	static const char file[] = "/tmp/\xc0\xaf"
	                           "body.py";
	struct writer w;
	struct proto_err err;
	uint8_t *out;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, id, "register", graph ? 2 : 3);
	writer_key_str(&w, "name", graph ? "g.0123456789abcdef0123456789abcdef01234567" : "u.src");
	writer_str(&w, graph ? "body_graph" : "body_source");
	if (graph) {
		msgpack_pack_str(&w.pk, sizeof graph_text - 1);
		msgpack_pack_str_body(&w.pk, graph_text, sizeof graph_text - 1);
	} else {
		writer_str(&w, "def body(c, x):\n    return c, c\n");
		writer_str(&w, "body_file");
		msgpack_pack_str(&w.pk, sizeof file - 1);
		msgpack_pack_str_body(&w.pk, file, sizeof file - 1);
	}
	out = writer_flatten(&w, len, PROTO_FRAME_MAX, &err);
	cr_assert_not_null(out, "%s", err.message);
	writer_destroy(&w);
	return out;
}

/* Six bad registers pipelined on one connection, then a health: each
 * register's code and message (naming its field), then the health's code,
 * as "CODE|field-named" lines in out.  Returns -1 when the connection failed. */
static int send_bad_text(const char *sock, char out[7][64])
{
	static const char health[] = "\x82\xa2id\x09\xa2op\xa6"
	                             "health";
	char code[64], msg[1024];
	long long id;
	int fd = raw_connect(sock);

	for (int k = 0; k < 6; k++) {
		size_t len;
		uint8_t *frame = bad_text_frame((uint64_t)k + 1, k % 2 == 0, &len);
		raw_send(fd, frame, len);
		free(frame);
	}
	raw_send_frame(fd, health, sizeof health - 1);
	for (int k = 0; k < 7; k++) {
		if (raw_recv(fd, code, sizeof code, &id, msg, sizeof msg) != 0)
			return -1;
		snprintf(out[k], 64, "%s|%d", code,
		         k == 6 || strstr(msg, k % 2 == 0 ? "body_graph" : "body_file") != NULL);
	}
	close(fd);
	return 0;
}

Test(codes, text_that_is_not_utf8_is_bad_request_and_no_worker_sees_it)
{
	struct fixture f;
	char got[7][64];
	int fds[2];
	uint64_t restarts;
	bool as_nobody = getuid() == 0;

	setup(&f, NULL);
	chmod(f.d.dir, 0755);
	restarts = h_stat(f.c, "worker_restarts");
	if (!as_nobody)
		fprintf(stderr,
		        "WARNING: not root: the non-UTF-8 registers are sent as uid %d "
		        "(an admin), not as a second uid\n",
		        (int)getuid());
	cr_assert_eq(pipe(fds), 0);
	if (fork() == 0) {
		char out[7][64];
		if (as_nobody && (setgid(65534) != 0 || setuid(65534) != 0))
			_exit(2);
		if (send_bad_text(f.d.sock, out) != 0 ||
		    write(fds[1], out, sizeof out) != (ssize_t)sizeof out)
			_exit(3);
		_exit(0);
	}
	close(fds[1]);
	cr_assert_eq(read(fds[0], got, sizeof got), (ssize_t)sizeof got,
	             "the uid-65534 child got no answers");
	close(fds[0]);
	wait(NULL);
	for (int k = 0; k < 6; k++)
		cr_assert_str_eq(got[k], "BAD_REQUEST|1", "register %d (%s)", k + 1,
		                 k % 2 == 0 ? "body_graph" : "body_file");
	cr_assert_str_eq(got[6], "|1", "the connection serves on");
	/* no worker died or was replaced: it never saw the text */
	cr_assert_eq(h_stat(f.c, "worker_restarts"), restarts);
	/* a new definition: checked by the worker, which serves on */
	hd_register(f.c, "t4.after", CUMSUM, "body", 12, 64, 3);
	scan_ok(&f, f.c);
	cr_assert_eq(h_stat(f.c, "worker_restarts"), restarts);
	teardown(&f);
}

/* ---- a reply cut inside its frame ------------------------------------------------------ */

/* Between one client and the daemon: passes requests on, and the daemon's
 * first reply frame up to `cut` bytes, then closes both sides. */
struct proxy {
	char path[300];
	const char *daemon;
	size_t cut;
	int lfd, cfd, dfd;
	pthread_t th, up;
};

static int full_read(int fd, uint8_t *p, size_t n)
{
	while (n > 0) {
		ssize_t k = read(fd, p, n);
		if (k <= 0)
			return -1;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

static void *proxy_up(void *arg) /* client -> daemon */
{
	struct proxy *p = arg;
	uint8_t buf[65536];
	ssize_t k;

	while ((k = read(p->cfd, buf, sizeof buf)) > 0)
		if (send(p->dfd, buf, (size_t)k, MSG_NOSIGNAL) != k)
			break;
	return NULL;
}

static void *proxy_run(void *arg)
{
	struct proxy *p = arg;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	uint8_t head[4], *frame;
	uint32_t len;

	p->cfd = accept(p->lfd, NULL, NULL);
	p->dfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof sa.sun_path, "%s", p->daemon);
	if (p->cfd < 0 || connect(p->dfd, (struct sockaddr *)&sa, sizeof sa) != 0)
		return NULL;
	pthread_create(&p->up, NULL, proxy_up, p);
	if (full_read(p->dfd, head, 4) == 0) {
		len = (uint32_t)head[0] << 24 | (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 |
		      head[3];
		frame = malloc(4 + (size_t)len);
		memcpy(frame, head, 4);
		if (frame && full_read(p->dfd, frame + 4, len) == 0)
			send(p->cfd, frame, p->cut < 4 + (size_t)len ? p->cut : 4 + (size_t)len,
			     MSG_NOSIGNAL);
		free(frame);
	}
	shutdown(p->cfd, SHUT_RDWR);
	shutdown(p->dfd, SHUT_RDWR);
	pthread_join(p->up, NULL);
	close(p->cfd);
	close(p->dfd);
	return NULL;
}

/* One scan through a proxy cutting its reply after `cut` bytes: its error. */
static void scan_through_cut(struct fixture *f, size_t cut, struct tl_error *err)
{
	struct proxy p = {.daemon = f->d.sock, .cut = cut};
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct tl_client *c;
	struct tl_reply *r;
	char dir[256];

	h_tmpdir(dir, sizeof dir, "proxy");
	snprintf(p.path, sizeof p.path, "%s/sock", dir);
	snprintf(sa.sun_path, sizeof sa.sun_path, "%s", p.path);
	p.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	cr_assert_eq(bind(p.lfd, (struct sockaddr *)&sa, sizeof sa), 0, "%s", strerror(errno));
	cr_assert_eq(listen(p.lfd, 4), 0);
	pthread_create(&p.th, NULL, proxy_run, &p);
	cr_assert_eq(tl_connect(p.path, 5000, &c, err), 0, "%s", err->message);
	cr_assert_eq(tl_scan(c, "t4.cumsum", f->carry_t, f->inputs_t, &r, err), -1,
	             "a reply cut after %zu bytes was read whole", cut);
	tl_close(c);
	pthread_join(p.th, NULL);
	close(p.lfd);
}

Test(codes, a_reply_cut_inside_its_frame_is_frame_truncated)
{
	struct fixture f;
	struct tl_error err;

	setup(&f, NULL);
	scan_ok(&f, f.c); /* loaded: the proxied scans get their reply at once */
	scan_through_cut(&f, 2, &err);
	cr_assert_str_eq(err.code, "FRAME_TRUNCATED", "inside the header: %s", err.message);
	scan_through_cut(&f, 4 + 9, &err);
	cr_assert_str_eq(err.code, "FRAME_TRUNCATED", "inside the body: %s", err.message);
	scan_through_cut(&f, 0, &err);
	cr_assert_str_eq(err.code, "IO", "a close between frames is not a cut frame: %s",
	                 err.message);
	scan_ok(&f, f.c);
	teardown(&f);
}

/* ---- the daemon's own failures -------------------------------------------------------- */

/* A source no earlier run compiled: its graph is built here. */
static void unique_cumsum(char *out, size_t size)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	snprintf(out, size,
	         "import torch\n\ndef body(c, x):\n    c = c + x\n    return c, c\n"
	         "# run %ld.%09ld pid %d\n",
	         (long)ts.tv_sec, ts.tv_nsec, (int)getpid());
}

Test(codes, an_artifact_the_check_refuses_is_unsafe_artifact)
{
	struct fixture f;
	struct tl_error err;
	struct tl_reply *r;
	char src[256];
	struct tl_adapter_def def = {"codes.unsafe", src, NULL, "body", NULL, 4, 64, 3};

	unique_cumsum(src, sizeof src);
	setenv("TORCHLOOP_TEST_EXEC_STACK", "1", 1); /* the worker's hook (build.py) */
	setup(&f, NULL);
	unsetenv("TORCHLOOP_TEST_EXEC_STACK");
	cr_assert_eq(tl_register(f.c, &def, &err), 0, "%s", err.message);
	for (int k = 0; k < 2; k++) {
		cr_assert_eq(tl_scan(f.c, "codes.unsafe", f.carry_t, f.inputs_t, &r, &err), -1);
		cr_assert_str_eq(err.code, "UNSAFE_ARTIFACT", "%s", err.message);
		cr_assert_not_null(strstr(err.message, "executable stack"), "%s", err.message);
	}
	cr_assert_eq(hd_counter(f.c, "codes.unsafe", "failed_specs"), 1, "remembered");
	cr_assert_eq(hd_counter(f.c, "codes.unsafe", "cache_misses"), 1, "built once");
	scan_ok(&f, f.c);
	teardown(&f);
}

/* Copies objects/KEY.meta from src to dst with lib as its artifact (sha256
 * and size rewritten to match), or, with lib "-", src's entry as it is. */
static const char ENTRY_PY[] =
    "import hashlib, msgpack, shutil, sys\n"
    "src, dst, key, lib = sys.argv[1:5]\n"
    "if lib == '-':\n"
    "    for ext in ('so', 'meta'):\n"
    "        shutil.copyfile(f'{src}/{key}.{ext}', f'{dst}/{key}.{ext}')\n"
    "    sys.exit(0)\n"
    "m = msgpack.unpackb(open(f'{src}/{key}.meta', 'rb').read())\n"
    "data = open(lib, 'rb').read()\n"
    "open(f'{dst}/{key}.so', 'wb').write(data)\n"
    "m['sha256'], m['size'] = hashlib.sha256(data).hexdigest(), len(data)\n"
    "open(f'{dst}/{key}.meta', 'wb').write(msgpack.packb(m))\n";

static void entry_py(const char *src, const char *dst, const char *key, const char *lib)
{
	char py[1100];
	const char *argv[] = {py, "-c", ENTRY_PY, src, dst, key, lib, NULL};

	snprintf(py, sizeof py, "%s/.venv/bin/python", h_root());
	cr_assert_eq(h_run(argv, NULL), 0, "python helper failed");
}

static void t4_key(struct tl_client *c, char key[65])
{
	json_t *j = h_call_json(c, "describe", "t4.cumsum");
	json_t *sp = json_array_get(json_object_get(j, "specializations"), 0);

	snprintf(key, 65, "%s", json_string_value(json_object_get(sp, "key")));
	json_decref(j);
	cr_assert_eq(strlen(key), 64);
}

static int count_entries(const char *path)
{
	DIR *dir = opendir(path);
	struct dirent *e;
	int n = 0;

	cr_assert_not_null(dir, "%s: %s", path, strerror(errno));
	while ((e = readdir(dir)) != NULL)
		n += e->d_name[0] != '.';
	closedir(dir);
	return n;
}

/*
 * A private cache holding t4.cumsum's T=3 entry, whose objects/ is replaced
 * by a file under the running daemon: the lookup fails, INTERNAL, not
 * remembered.  objects/ back, with a shared library that is no AOTI model in
 * the entry (sha256 and size match): ENGINE_ERROR, the entry set aside.  The
 * good entry back: served from it, with no compile.
 */
Test(codes, a_broken_cache_is_internal_and_an_unloadable_entry_engine_error)
{
	struct fixture f;
	struct tl_error err;
	struct tl_reply *r;
	char cache[512], objects[600], away[600], quarantine[600], shared[600], key[65];
	Dl_info lib;

	setup(&f, NULL); /* the shared cache: t4.cumsum's entry and key */
	scan_ok(&f, f.c);
	t4_key(f.c, key);
	teardown(&f);
	cr_assert(dladdr((void *)json_object_get, &lib) && lib.dli_fname, "no jansson path");
	h_tmpdir(cache, sizeof cache, "codes-cache");
	snprintf(objects, sizeof objects, "%s/objects", cache);
	snprintf(away, sizeof away, "%s/objects.away", cache);
	snprintf(quarantine, sizeof quarantine, "%s/quarantine", cache);
	snprintf(shared, sizeof shared, "%s/objects", h_shared_cache());
	cr_assert_eq(mkdir(objects, 0700), 0);
	entry_py(shared, objects, key, lib.dli_fname);

	hd_start(&f.d, cache, NO_PROBE);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	hd_register(f.c, "t4.cumsum", CUMSUM, "body", 12, 64, 3);
	fixture_trees(&f);
	cr_assert_eq(rename(objects, away), 0);
	fclose(fopen(objects, "we"));
	cr_assert_eq(tl_scan(f.c, "t4.cumsum", f.carry_t, f.inputs_t, &r, &err), -1);
	cr_assert_str_eq(err.code, "INTERNAL", "%s", err.message);
	cr_assert_not_null(strstr(err.message, "Not a directory"), "the cause: %s", err.message);
	cr_assert_eq(unlink(objects), 0);
	cr_assert_eq(rename(away, objects), 0);

	cr_assert_eq(tl_scan(f.c, "t4.cumsum", f.carry_t, f.inputs_t, &r, &err), -1);
	cr_assert_str_eq(err.code, "ENGINE_ERROR", "%s", err.message);
	cr_assert_eq(count_entries(quarantine), 2, "the entry (.so, .meta) was set aside");
	entry_py(shared, objects, key, "-");
	scan_ok(&f, f.c);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "compiles"), 0);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "failed_specs"), 0, "neither was remembered");
	teardown(&f);
}
