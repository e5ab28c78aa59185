/*
 * test_shm.c - shared memory (docs/protocol.md "Shared memory"): a memfd
 * attached once per connection, tensors passed by reference into it, and
 * results written by the daemon into the area the request names.
 *
 * Correctness against sums computed here by hand (cumsum: carry + running
 * sums of x; its gradient: suffix sums of the cotangents), through the raw
 * wire (references built byte by byte, results read from our own mapping)
 * and through libtorchloop (staged and in-place tensors).  Every bad
 * descriptor and bad reference gets its own code, and the next request on
 * the same connection is still served.  Security: only sealed, writable
 * memfds are mapped; references of one connection never reach another's
 * region; stray descriptors are closed; a region dies with its connection.
 *
 * Compiles: two graphs (scan and grad of t13.cumsum, float64, carry [N],
 * T = 3) plus the t4-style small scan, shared through the run's cache.
 */
#include "harness.h"

#include "fdpass.h"
#include "frame.h"
#include "tree.h"
#include "writer.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

TestSuite(shm, .timeout = 900);

#define CUMSUM  "examples/bodies/cumsum.py"
#define ADAPTER "t13.cumsum"
#define N       16384 /* 128 KiB per float64 carry: over the client's threshold */
#define T       3
#define REGION  (4u << 20)

static const char *const ARGS[] = {"--no-probe", "--max-shm", "8388608", NULL};

struct fx {
	struct hd d;
	struct tl_client *c;
};

static void start(struct fx *f)
{
	hd_start(&f->d, NULL, ARGS);
	hd_wait_ready(&f->d, 120);
	f->c = hd_connect(&f->d);
	hd_register(f->c, ADAPTER, CUMSUM, "body", 8, T * N, 4);
}

static void stop(struct fx *f)
{
	tl_close(f->c);
	cr_assert_eq(hd_stop(&f->d), 0, "clean exit; log %s", f->d.log);
}

/* ---- memfds ---------------------------------------------------------------- */

struct region {
	int fd;
	uint8_t *p;
	size_t size;
};

/* A memfd of size bytes with the given seals added (0: none), mapped. */
static struct region mkregion(size_t size, int seals)
{
	struct region r = {.size = size};

	r.fd = memfd_create("t13", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	cr_assert_geq(r.fd, 0, "memfd_create: %s", strerror(errno));
	cr_assert_eq(ftruncate(r.fd, (off_t)size), 0);
	r.p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0);
	cr_assert_neq(r.p, MAP_FAILED);
	if (seals)
		cr_assert_eq(fcntl(r.fd, F_ADD_SEALS, seals), 0, "seals: %s", strerror(errno));
	return r;
}

static void rmregion(struct region *r)
{
	munmap(r->p, r->size);
	if (r->fd >= 0)
		close(r->fd);
}

/* ---- raw frames -------------------------------------------------------------- */

static void send_fd_frame(int sock, const uint8_t *frame, size_t len, int pass_fd)
{
	struct iovec iov = {(void *)frame, len};
	ssize_t k = fdpass_sendmsg(sock, &iov, 1, pass_fd);

	cr_assert_eq(k, (ssize_t)len, "sendmsg: %s", strerror(errno));
	if ((size_t)k < len)
		raw_send(sock, frame + k, len - (size_t)k);
}

/* Seals w and sends it, with pass_fd riding on the frame when >= 0. */
static void send_writer(int sock, struct writer *w, int pass_fd)
{
	struct proto_err err;
	size_t len;
	uint8_t *flat = writer_flatten(w, &len, PROTO_FRAME_MAX, &err);

	cr_assert_not_null(flat, "%s", err.message);
	send_fd_frame(sock, flat, len, pass_fd);
	free(flat);
	writer_destroy(w);
}

/* The reply's error code ("" for a result) and message. */
static void recv_code(int sock, char *code, char *message)
{
	long long id;

	cr_assert_eq(raw_recv(sock, code, 64, &id, message, 1024), 0,
	             "the daemon closed the connection");
}

static void expect(int sock, const char *want)
{
	char code[64], message[1024];

	recv_code(sock, code, message);
	cr_assert_str_eq(code, want, "wanted %s, got %s: %s", want[0] ? want : "a result", code,
	                 message);
}

static void attach_raw(int sock, uint64_t size, int pass_fd)
{
	struct writer w;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 1, "attach", 1);
	writer_key_u64(&w, "size", size);
	send_writer(sock, &w, pass_fd);
}

/* The next request is still served: hello on the same connection. */
static void still_serves(int sock)
{
	struct writer w;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 2, "hello", 1);
	writer_key_u64(&w, "protocol", PROTO_VERSION);
	send_writer(sock, &w, -1);
	expect(sock, "");
}

/* A PROTO_EXT_SHM leaf as given, even where it disagrees with the region
 * (float64, rank ndim). */
static void put_ref(struct writer *w, int ndim, const int64_t *shape, uint64_t off, uint64_t nbytes)
{
	tree_put_shm_ref(w, PROTO_DTYPE_F64, (uint32_t)ndim, shape, off, nbytes);
}

struct area {
	bool set;
	uint64_t offset, size, min_bytes;
};

/* scan of ADAPTER with carry [N] at c_off and inputs [T, N] at x_off. */
static void scan_raw(int sock, uint64_t c_off, uint64_t c_bytes, uint64_t x_off, struct area out)
{
	int64_t cs[] = {N}, xs[] = {T, N};
	struct writer w;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 3, "scan", 3 + out.set);
	writer_key_str(&w, "adapter", ADAPTER);
	writer_str(&w, "carry");
	put_ref(&w, 1, cs, c_off, c_bytes);
	writer_str(&w, "inputs");
	put_ref(&w, 2, xs, x_off, (uint64_t)T * N * 8);
	if (out.set) {
		writer_str(&w, "out");
		msgpack_pack_map(&w.pk, 3);
		writer_key_u64(&w, "offset", out.offset);
		writer_key_u64(&w, "size", out.size);
		writer_key_u64(&w, "min_bytes", out.min_bytes);
	}
	send_writer(sock, &w, -1);
}

static void fill_inputs(double *carry, double *xs)
{
	h_fill(carry, TL_FLOAT64, N, 131);
	h_fill(xs, TL_FLOAT64, (size_t)T * N, 132);
}

/* cumsum by hand: outputs[t] = carry + x[0] + ... + x[t]; carry = outputs[T-1]. */
static void check_cumsum(const double *carry0, const double *xs, const double *carry,
                         const double *ys)
{
	for (size_t i = 0; i < N; i++) {
		double acc = carry0[i];
		for (int t = 0; t < T; t++) {
			acc += xs[(size_t)t * N + i];
			cr_assert_float_eq(ys[(size_t)t * N + i], acc, 1e-12, "y[%d][%zu]", t, i);
		}
		cr_assert_float_eq(carry[i], acc, 1e-12, "carry[%zu]", i);
	}
}

/* The result's carry and outputs, references resolved against our mapping. */
static void decode_results(struct msg *m, const struct tree_region *reg, struct tree_node *carry,
                           struct tree_node *ys)
{
	const msgpack_object *res = msg_field(m, "result");
	struct proto_err err;

	cr_assert_not_null(res, "not a result");
	cr_assert_eq(
	    tree_decode_in(msg_obj_field(res, "carry"), m->up.zone, "carry", reg, carry, &err), 0,
	    "%s", err.message);
	cr_assert_eq(
	    tree_decode_in(msg_obj_field(res, "outputs"), m->up.zone, "outputs", reg, ys, &err), 0,
	    "%s", err.message);
}

static bool in_region(const struct region *r, const void *p)
{
	return (const uint8_t *)p >= r->p && (const uint8_t *)p < r->p + r->size;
}

/* ---- the happy paths ----------------------------------------------------------- */

/* Raw wire: references in, results written into our area; we read them from
 * our own mapping at the offsets the reply names. */
/* A scan's reply over the raw wire, its results decoded against the region. */
struct raw_reply {
	uint8_t *body;
	struct msg m;
	struct tree_node carry, ys;
	uint64_t out_needed; /* 0: the reply has none */
};

static void scan_reply(int sock, uint64_t c_bytes, uint64_t x_off, struct area out,
                       const struct tree_region *reg, struct raw_reply *rr)
{
	const msgpack_object *needed;

	scan_raw(sock, 0, c_bytes, x_off, out);
	cr_assert_eq(raw_recv_msg(sock, &rr->body, &rr->m), 0);
	cr_assert(!rr->m.is_error, "scan failed");
	decode_results(&rr->m, reg, &rr->carry, &rr->ys);
	needed = msg_obj_field(msg_field(&rr->m, "result"), "out_needed");
	rr->out_needed = needed ? needed->via.u64 : 0;
}

static void raw_reply_free(struct raw_reply *rr)
{
	msg_destroy(&rr->m);
	frame_free(rr->body);
}

Test(shm, raw_references_in_and_results_in_the_area)
{
	struct fx f;
	struct region r = mkregion(REGION, F_SEAL_SHRINK);
	uint64_t c_bytes = N * 8, x_off = 1 << 20, out_off = 2 << 20;
	const uint64_t all_out = N * 8 + T * N * 8;
	int sock;
	struct raw_reply rr;
	struct tree_region reg = {r.p, r.size};
	double *c0 = (double *)r.p, *x0 = (double *)(r.p + x_off);

	start(&f);
	sock = raw_connect(f.d.sock);
	attach_raw(sock, r.size, r.fd);
	expect(sock, "");
	fill_inputs(c0, x0);
	memset(r.p + out_off, 0xff, 1 << 20);
	scan_reply(sock, c_bytes, x_off, (struct area){true, out_off, 1 << 20, 0}, &reg, &rr);
	/* both results are references into the area, not bytes in the frame */
	cr_assert((const uint8_t *)rr.carry.tensor.data >= r.p + out_off &&
	          (const uint8_t *)rr.carry.tensor.data < r.p + out_off + (1 << 20));
	cr_assert((const uint8_t *)rr.ys.tensor.data >= r.p + out_off &&
	          (const uint8_t *)rr.ys.tensor.data < r.p + out_off + (1 << 20));
	cr_assert_eq(rr.out_needed, all_out, "out_needed %llu", (unsigned long long)rr.out_needed);
	check_cumsum(c0, x0, rr.carry.tensor.data, rr.ys.tensor.data);
	raw_reply_free(&rr);

	/* an area too small for all the outputs: they all come inline */
	scan_reply(sock, c_bytes, x_off, (struct area){true, out_off, c_bytes, 0}, &reg, &rr);
	cr_assert(!in_region(&r, rr.carry.tensor.data) && !in_region(&r, rr.ys.tensor.data),
	          "results are inline");
	cr_assert_eq(rr.out_needed, all_out, "out_needed %llu", (unsigned long long)rr.out_needed);
	check_cumsum(c0, x0, rr.carry.tensor.data, rr.ys.tensor.data);
	raw_reply_free(&rr);

	/* min_bytes over the outputs: written into the area, sent inline */
	memset(r.p + out_off, 0xff, 1 << 20);
	scan_reply(sock, c_bytes, x_off, (struct area){true, out_off, 1 << 20, 1 << 20}, &reg, &rr);
	cr_assert(!in_region(&r, rr.carry.tensor.data), "the carry is inline");
	check_cumsum(c0, x0, rr.carry.tensor.data, (const double *)(r.p + out_off + c_bytes));
	raw_reply_free(&rr);

	/* without an area, results come inline; references still work for inputs */
	scan_reply(sock, c_bytes, x_off, (struct area){0}, &reg, &rr);
	cr_assert_eq(rr.out_needed, 0, "no out_needed without an area");
	check_cumsum(c0, x0, rr.carry.tensor.data, rr.ys.tensor.data);
	raw_reply_free(&rr);

	cr_assert_eq(h_stat(f.c, "shm_regions"), 1);
	cr_assert_eq(h_stat(f.c, "shm_bytes"), REGION);
	close(sock);
	/* the region dies with its connection */
	for (int i = 0; i < 100 && h_stat(f.c, "shm_regions") != 0; i++)
		usleep(20000);
	cr_assert_eq(h_stat(f.c, "shm_regions"), 0);
	cr_assert_eq(h_stat(f.c, "shm_bytes"), 0);
	rmregion(&r);
	stop(&f);
}

/* libtorchloop: staged copies, buffers from tl_shm_alloc used in place,
 * results in the region until tl_reply_free, and the same answers inline. */
Test(shm, libtorchloop_scan_and_grad)
{
	struct fx f;
	struct tl_error err;
	struct tl_builder *b = tl_builder_new();
	struct tl_client *plain, *c;
	struct tl_reply *r1, *r2, *rg;
	int64_t cs[] = {N}, xs[] = {T, N};
	double *carry = aligned_alloc(64, N * 8), *x = aligned_alloc(64, (size_t)T * N * 8);
	double *cot_c = aligned_alloc(64, N * 8), *cot_y = aligned_alloc(64, (size_t)T * N * 8);
	double *in_c, *in_x;
	const double *gc, *gx;

	start(&f);
	plain = hd_connect(&f.d);
	c = hd_connect(&f.d);
	cr_assert_eq(tl_shm_attach(c, 8u << 20, &err), 0, "%s %s", err.code, err.message);
	cr_assert_eq(tl_shm_size(c), 8u << 20);
	cr_assert_eq(tl_shm_attach(c, 1 << 20, &err), -1);
	cr_assert_str_eq(err.code, "SHM_ALREADY_ATTACHED");
	fill_inputs(carry, x);

	/* staged: the caller's buffers are copied into the region */
	cr_assert_eq(tl_scan(c, ADAPTER, tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	                     tl_tensor(b, TL_FLOAT64, 2, xs, x), &r1, &err),
	             0, "%s %s", err.code, err.message);
	check_cumsum(carry, x, tl_tree_data(tl_reply_tree(r1, "carry")),
	             tl_tree_data(tl_reply_tree(r1, "outputs")));

	/* in place: buffers allocated in the region; r1 is still alive and valid */
	in_c = tl_shm_alloc(c, N * 8);
	in_x = tl_shm_alloc(c, (size_t)T * N * 8);
	cr_assert_not_null(in_c);
	cr_assert_not_null(in_x);
	cr_assert_eq((uintptr_t)in_c % 64, 0);
	memcpy(in_c, carry, N * 8);
	memcpy(in_x, x, (size_t)T * N * 8);
	in_c[0] += 1.0; /* a different answer, so r1 and r2 cannot share bytes unnoticed */
	cr_assert_eq(tl_scan(c, ADAPTER, tl_tensor(b, TL_FLOAT64, 1, cs, in_c),
	                     tl_tensor(b, TL_FLOAT64, 2, xs, in_x), &r2, &err),
	             0, "%s %s", err.code, err.message);
	check_cumsum(in_c, in_x, tl_tree_data(tl_reply_tree(r2, "carry")),
	             tl_tree_data(tl_reply_tree(r2, "outputs")));
	check_cumsum(carry, x, tl_tree_data(tl_reply_tree(r1, "carry")),
	             tl_tree_data(tl_reply_tree(r1, "outputs")));
	tl_reply_free(r1);
	tl_reply_free(r2);

	/* grad by hand: grad_carry = cot_c + sum_t cot_y[t];
	 * grad_inputs[t] = cot_c + sum_{s >= t} cot_y[s] */
	h_fill(cot_c, TL_FLOAT64, N, 133);
	h_fill(cot_y, TL_FLOAT64, (size_t)T * N, 134);
	cr_assert_eq(tl_grad(c, ADAPTER, tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	                     tl_tensor(b, TL_FLOAT64, 2, xs, x),
	                     tl_tensor(b, TL_FLOAT64, 1, cs, cot_c),
	                     tl_tensor(b, TL_FLOAT64, 2, xs, cot_y), &rg, &err),
	             0, "%s %s", err.code, err.message);
	gc = tl_tree_data(tl_reply_tree(rg, "grad_carry"));
	gx = tl_tree_data(tl_reply_tree(rg, "grad_inputs"));
	for (size_t i = 0; i < N; i++) {
		double acc = cot_c[i];
		for (int t = T - 1; t >= 0; t--) {
			acc += cot_y[(size_t)t * N + i];
			cr_assert_float_eq(gx[(size_t)t * N + i], acc, 1e-12,
			                   "grad_inputs[%d][%zu]", t, i);
		}
		cr_assert_float_eq(gc[i], acc, 1e-12, "grad_carry[%zu]", i);
	}
	/* the region outlives the client while a reply holds it */
	tl_close(c);
	cr_assert_float_eq(
	    gc[N - 1], cot_c[N - 1] + cot_y[N - 1] + cot_y[2 * N - 1] + cot_y[3 * (size_t)N - 1],
	    1e-12);
	tl_reply_free(rg);

	/* the plain client gets the same answer inline */
	cr_assert_eq(tl_scan(plain, ADAPTER, tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	                     tl_tensor(b, TL_FLOAT64, 2, xs, x), &r1, &err),
	             0);
	check_cumsum(carry, x, tl_tree_data(tl_reply_tree(r1, "carry")),
	             tl_tree_data(tl_reply_tree(r1, "outputs")));
	tl_reply_free(r1);
	tl_close(plain);
	free(carry);
	free(x);
	free(cot_c);
	free(cot_y);
	tl_builder_free(b);
	stop(&f);
}

/* ---- bad descriptors ------------------------------------------------------------ */

Test(shm, bad_descriptors_get_their_codes)
{
	struct fx f;
	int sock, pipefd[2], sp[2], ro, file;
	char path[600], rofd[64];
	struct region unsealed = mkregion(1 << 20, 0);
	struct region small = mkregion(1 << 20, F_SEAL_SHRINK);
	struct region big = mkregion(16u << 20, F_SEAL_SHRINK);
	int wfd;

	start(&f);
	sock = raw_connect(f.d.sock);

	attach_raw(sock, 4096, -1); /* no descriptor */
	expect(sock, "SHM_NO_FD");
	still_serves(sock);

	cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
	attach_raw(sock, 4096, sp[0]); /* a socket */
	expect(sock, "SHM_BAD_FD");
	still_serves(sock);

	cr_assert_eq(pipe(pipefd), 0);
	attach_raw(sock, 4096, pipefd[0]); /* a pipe */
	expect(sock, "SHM_BAD_FD");
	still_serves(sock);

	snprintf(path, sizeof path, "%s/plain-file", f.d.dir);
	file = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	cr_assert_geq(file, 0);
	cr_assert_eq(ftruncate(file, 1 << 20), 0);
	attach_raw(sock, 4096, file); /* a file, not private memory */
	expect(sock, "SHM_BAD_FD");
	still_serves(sock);

	attach_raw(sock, unsealed.size, unsealed.fd); /* could be shrunk under the daemon */
	expect(sock, "SHM_NOT_SEALED");
	still_serves(sock);

	/* write-sealed: the daemon could not write results */
	wfd = memfd_create("t13w", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	cr_assert_eq(ftruncate(wfd, 1 << 20), 0);
	cr_assert_eq(fcntl(wfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
	attach_raw(sock, 1 << 20, wfd);
	expect(sock, "SHM_BAD_FD");
	still_serves(sock);

	/* read-only descriptor of a good memfd */
	snprintf(rofd, sizeof rofd, "/proc/self/fd/%d", small.fd);
	ro = open(rofd, O_RDONLY | O_CLOEXEC);
	cr_assert_geq(ro, 0);
	attach_raw(sock, small.size, ro);
	expect(sock, "SHM_BAD_FD");
	still_serves(sock);

	attach_raw(sock, small.size * 2, small.fd); /* asks for more than the memfd has */
	expect(sock, "SHM_UNDERSIZED");
	still_serves(sock);

	attach_raw(sock, big.size, big.fd); /* over --max-shm (8 MiB) */
	expect(sock, "SHM_TOO_LARGE");
	still_serves(sock);

	attach_raw(sock, 0, small.fd);
	expect(sock, "INVALID_ARGUMENT");
	still_serves(sock);

	/* the good one, once; a second attach is refused */
	attach_raw(sock, small.size, small.fd);
	expect(sock, "");
	attach_raw(sock, small.size, small.fd);
	expect(sock, "SHM_ALREADY_ATTACHED");
	still_serves(sock);
	cr_assert_eq(h_stat(f.c, "shm_attaches"), 1);

	/* shrinking a sealed memfd fails in the client: the daemon's mapping is safe */
	cr_assert_eq(ftruncate(small.fd, 4096), -1);
	cr_assert_eq(errno, EPERM);
	close(sock);
	close(sp[0]);
	close(sp[1]);
	close(pipefd[0]);
	close(pipefd[1]);
	close(ro);
	close(file);
	close(wfd);
	rmregion(&unsealed);
	rmregion(&small);
	rmregion(&big);
	stop(&f);
}

/* A hello carrying a descriptor (here a pipe) on a connection with no region
 * yet: the descriptor is closed as a stray at once, never kept for the next
 * attach (which used to map it and get SHM_BAD_FD, closing its own memfd);
 * an attach sent right behind such a hello, before any reply, gets its own. */
static void hello_with_fd(int sock, int fd)
{
	struct writer w;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 5, "hello", 1);
	writer_key_u64(&w, "protocol", PROTO_VERSION);
	send_writer(sock, &w, fd);
}

Test(shm, a_descriptor_sent_with_another_frame_never_reaches_a_later_attach)
{
	struct fx f;
	struct region r = mkregion(1 << 20, F_SEAL_SHRINK);
	int sock, pipefd[2];
	uint64_t strays;

	start(&f);
	cr_assert_eq(pipe(pipefd), 0);
	sock = raw_connect(f.d.sock);
	strays = h_stat(f.c, "shm_stray_fds");
	hello_with_fd(sock, pipefd[0]);
	expect(sock, "");
	cr_assert_eq(h_stat(f.c, "shm_stray_fds"), strays + 1, "closed at once");
	attach_raw(sock, r.size, -1);
	expect(sock, "SHM_NO_FD"); /* not the hello's pipe */
	still_serves(sock);

	hello_with_fd(sock, pipefd[0]); /* pipelined: both frames before any reply */
	attach_raw(sock, r.size, r.fd);
	expect(sock, "");
	expect(sock, "");
	cr_assert_eq(h_stat(f.c, "shm_attaches"), 1);
	cr_assert_eq(h_stat(f.c, "shm_stray_fds"), strays + 2);
	still_serves(sock);
	close(sock);
	close(pipefd[0]);
	close(pipefd[1]);
	rmregion(&r);
	stop(&f);
}

/* ---- bad references -------------------------------------------------------------- */

Test(shm, bad_references_get_their_codes)
{
	struct fx f;
	struct region r = mkregion(REGION, F_SEAL_SHRINK);
	uint64_t cb = N * 8, xo = 1 << 20, oo = 2 << 20;
	int sock, bare;

	start(&f);
	bare = raw_connect(f.d.sock); /* no region */
	scan_raw(bare, 0, cb, xo, (struct area){0});
	expect(bare, "SHM_NOT_ATTACHED");
	still_serves(bare);

	sock = raw_connect(f.d.sock);
	attach_raw(sock, r.size, r.fd);
	expect(sock, "");
	fill_inputs((double *)r.p, (double *)(r.p + xo));

	scan_raw(sock, REGION - 64, cb, xo, (struct area){0}); /* runs past the end */
	expect(sock, "SHM_OUT_OF_BOUNDS");
	still_serves(sock);
	scan_raw(sock, UINT64_MAX - 63, cb, xo, (struct area){0}); /* offset + nbytes wraps */
	expect(sock, "SHM_OUT_OF_BOUNDS");
	still_serves(sock);
	scan_raw(sock, 8, cb, xo, (struct area){0}); /* aligned for doubles, not for 64 */
	expect(sock, "SHM_MISALIGNED");
	still_serves(sock);
	scan_raw(sock, 0, cb - 8, xo, (struct area){0}); /* nbytes disagrees with the shape */
	expect(sock, "BYTE_LENGTH_MISMATCH");
	still_serves(sock);

	/* output areas */
	scan_raw(sock, 0, cb, xo, (struct area){true, REGION - 4096, 8192, 0});
	expect(sock, "SHM_OUT_OF_BOUNDS");
	still_serves(sock);
	scan_raw(sock, 0, cb, xo, (struct area){true, oo + 32, 4096, 0});
	expect(sock, "SHM_MISALIGNED");
	still_serves(sock);
	scan_raw(sock, 0, cb, xo, (struct area){true, xo + 4096, 4096, 0}); /* inside inputs */
	expect(sock, "SHM_OVERLAP");
	still_serves(sock);
	scan_raw(sock, 0, cb, xo, (struct area){true, 0, 64, 0}); /* the carry's first bytes */
	expect(sock, "SHM_OVERLAP");
	still_serves(sock);

	/* an area on a connection without a region */
	{
		double c4[4] = {0}, x4[4] = {0};
		struct tree_node carry = {.kind = TREE_TENSOR}, inputs = {.kind = TREE_TENSOR};
		struct writer w;

		carry.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 1, {4}, 4, 32, c4};
		inputs.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 2, {1, 4}, 4, 32, x4};
		cr_assert_eq(writer_init(&w), 0);
		msg_begin_request(&w, 4, "scan", 4);
		writer_key_str(&w, "adapter", ADAPTER);
		writer_str(&w, "carry");
		tree_encode(&w, &carry);
		writer_str(&w, "inputs");
		tree_encode(&w, &inputs);
		writer_str(&w, "out");
		msgpack_pack_map(&w.pk, 2);
		writer_key_u64(&w, "offset", 0);
		writer_key_u64(&w, "size", 4096);
		send_writer(bare, &w, -1);
		expect(bare, "SHM_NOT_ATTACHED");
		still_serves(bare);
	}

	/* and a good one after all of that */
	scan_raw(sock, 0, cb, xo, (struct area){true, oo, 1 << 20, 0});
	expect(sock, "");
	close(sock);
	close(bare);
	rmregion(&r);
	stop(&f);
}

/* ---- isolation -------------------------------------------------------------------- */

static int count_fds(pid_t pid)
{
	char dir[64];
	DIR *d;
	struct dirent *e;
	int n = 0;

	snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
	d = opendir(dir);
	cr_assert_not_null(d);
	while ((e = readdir(d)) != NULL)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* A reference resolves only into the sender's own region; results go only
 * into the sender's area; descriptors nobody attaches are closed at once. */
Test(shm, connections_cannot_reach_each_other)
{
	struct fx f;
	struct region ra = mkregion(REGION, F_SEAL_SHRINK), rb = mkregion(1 << 20, F_SEAL_SHRINK);
	uint64_t cb = N * 8, xo = 1 << 20, oo = 2 << 20;
	int a, bsock, before, after;
	uint8_t zero[4096] = {0};

	start(&f);
	a = raw_connect(f.d.sock);
	bsock = raw_connect(f.d.sock);
	attach_raw(a, ra.size, ra.fd);
	expect(a, "");
	attach_raw(bsock, rb.size, rb.fd);
	expect(bsock, "");
	fill_inputs((double *)ra.p, (double *)(ra.p + xo));

	/* B names A's offsets: they lie outside B's (smaller) region */
	scan_raw(bsock, 0, cb, xo, (struct area){true, oo, 1 << 20, 0});
	expect(bsock, "SHM_OUT_OF_BOUNDS");
	still_serves(bsock);

	/* A's scan writes into A's area only */
	scan_raw(a, 0, cb, xo, (struct area){true, oo, 1 << 20, 0});
	expect(a, "");
	cr_assert_neq(memcmp(ra.p + oo, zero, sizeof zero), 0, "A's results are in A's area");
	for (size_t off = 0; off < rb.size; off += sizeof zero)
		cr_assert_eq(memcmp(rb.p + off, zero, sizeof zero), 0,
		             "B's region untouched at %zu", off);

	/* 50 stray descriptors on a hello: all closed, none kept */
	before = count_fds(f.d.pid);
	for (int i = 0; i < 50; i++) {
		struct region s = mkregion(4096, F_SEAL_SHRINK);
		struct writer w;

		cr_assert_eq(writer_init(&w), 0);
		msg_begin_request(&w, 5, "hello", 1);
		writer_key_u64(&w, "protocol", PROTO_VERSION);
		send_writer(a, &w, s.fd);
		expect(a, "");
		rmregion(&s);
	}
	after = count_fds(f.d.pid);
	cr_assert_leq(after, before, "the daemon kept descriptors: %d before, %d after", before,
	              after);
	cr_assert_geq(h_stat(f.c, "shm_stray_fds"), 50);

	/* the client closing its descriptor and mapping does not affect the daemon */
	rmregion(&rb);
	still_serves(bsock);
	close(a);
	close(bsock);
	rmregion(&ra);
	stop(&f);
}
