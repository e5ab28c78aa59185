/*
 * test_oom.c - malloc fault injection over the out-of-memory branches.
 *
 * The allocations our own code makes (malloc, calloc, realloc, aligned_alloc
 * called from proto/ and daemon/ objects) are wrapped at link time
 * (-Wl,--wrap, Makefile); each test runs an operation again and again,
 * failing its 1st, 2nd, ... allocation in turn, until a run makes no more
 * allocations to fail.  Every injected failure must end in the operation's
 * own error -- INTERNAL, "out of memory" or "cannot allocate" -- never a
 * crash, and leave nothing allocated (make sanitize runs this file under
 * ASan with LeakSanitizer); the run with no failure must succeed.
 * libmsgpackc's and libtorch's allocations are not ours and are not wrapped.
 */
#include "daemon.h"
#include "frame.h"
#include "helpers.h"
#include "msg.h"
#include "graphs.h"
#include "tree.h"
#include "writer.h"

#include <criterion/criterion.h>
#include <errno.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif
#include <stdlib.h>
#include <string.h>

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);

static long countdown = -1; /* allocations left before the one that fails */
static long injected;       /* failures injected since arm() */

static bool fail_now(void)
{
	if (countdown < 0)
		return false;
	if (countdown-- > 0)
		return false;
	injected++;
	errno = ENOMEM;
	return true;
}

void *__wrap_malloc(size_t n)
{
	return fail_now() ? NULL : __real_malloc(n);
}

void *__wrap_calloc(size_t n, size_t size)
{
	return fail_now() ? NULL : __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t n)
{
	return fail_now() ? NULL : __real_realloc(p, n);
}

void *__wrap_aligned_alloc(size_t align, size_t n)
{
	return fail_now() ? NULL : __real_aligned_alloc(align, n);
}

/* The k-th allocation from now (0: the next) fails. */
static void arm(long k)
{
	countdown = k;
	injected = 0;
}

/* Stops injecting; says whether a failure was injected since arm(). */
static bool disarm(void)
{
	countdown = -1;
	return injected > 0;
}

/* The outcome of an armed operation: a failure must be an injected one,
 * reported as out of memory.  Returns whether the operation succeeded (the
 * caller then checks its result). */
static bool outcome(bool failed, bool hit, const struct proto_err *err, long k)
{
	if (!failed)
		return true;
	cr_assert(hit, "allocation %ld: %s", k, err->message);
	cr_assert_eq(err->code, PROTO_E_INTERNAL, "allocation %ld: %s (%s)", k,
	             proto_code_name(err->code), err->message);
	cr_assert(strstr(err->message, "out of memory") || strstr(err->message, "cannot allocate"),
	          "allocation %ld: %s", k, err->message);
	return false;
}

/* Under ASan (make sanitize): nothing unreachable is left, checked now, so
 * that a leak fails this test (LeakSanitizer's own report at exit would come
 * after Criterion has recorded a pass). */
static void assert_no_leaks(void)
{
#if defined(__SANITIZE_ADDRESS__)
	cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "LeakSanitizer found leaks (above)");
#endif
}

/* Runs op(k) -- which arms the k-th allocation from the point it measures
 * (arm(k)), checks its outcome and says whether a failure was injected -- for
 * k = 0, 1, ... until a run makes no more allocations to fail (and so must
 * have succeeded); returns that k, the number of allocations it makes. */
static long sweep(bool (*op)(long k))
{
	for (long k = 0; k < 10000; k++)
		if (!op(k)) {
			assert_no_leaks();
			return k;
		}
	cr_assert_fail("more than 10000 allocations");
	return -1;
}

/* ---- proto/frame.c: the body of a frame ------------------------------- */

static bool feed_frame(long k)
{
	static const uint8_t frame[] = {0, 0, 0, 5, 0x81, 0xa1, 'a', 0x01, 0xc0};
	struct frame_reader r;
	struct proto_err err;
	size_t used;
	enum frame_status st;

	frame_reader_init(&r, 1 << 20);
	arm(k);
	st = frame_reader_feed(&r, frame, sizeof frame, &used, &err);
	bool hit = disarm();
	if (outcome(st == FRAME_ERROR, hit, &err, k)) {
		uint32_t len;
		cr_assert_eq(st, FRAME_READY, "allocation %ld", k);
		frame_free(frame_reader_take(&r, &len));
		cr_assert_eq(len, 5);
	}
	frame_reader_free(&r);
	return hit;
}

Test(oom, a_frame_body_that_cannot_be_allocated_is_a_frame_error)
{
	cr_assert_geq(sweep(feed_frame), 1);
}

/* ---- proto/tree.c: a dict's duplicate-key check ------------------------ */

static bool decode_dict(long k)
{
	struct tbuf b;
	struct parsed p;
	int rc;

	tbuf_init(&b);
	tbuf_request(&b, "carry");
	tbuf_nil_map(&b, 3, (const char *[]){"x", "y", "z"});
	p.body = tbuf_body(&b);
	arm(k);
	rc = parse_tree(&p, b.sb.size, "carry", NULL);
	bool hit = disarm();
	if (outcome(rc != 0, hit, &p.err, k)) {
		cr_assert_eq(p.out.kind, TREE_DICT);
		cr_assert_eq(p.out.count, 3);
	}
	parsed_free(&p);
	tbuf_destroy(&b);
	return hit;
}

Test(oom, a_dict_whose_key_check_cannot_allocate_is_refused)
{
	cr_assert_geq(sweep(decode_dict), 1, "the duplicate-key check allocates");
}

/* ---- proto/writer.c: flattening a frame -------------------------------- */

static bool flatten(long k)
{
	struct writer w;
	struct proto_err err;
	uint8_t *bytes;
	size_t len = 0;

	cr_assert_eq(writer_init(&w), 0);
	msgpack_pack_map(&w.pk, 1);
	writer_key_str(&w, "op", "health");
	arm(k);
	bytes = writer_flatten(&w, &len, PROTO_FRAME_MAX, &err);
	bool hit = disarm();
	if (outcome(bytes == NULL, hit, &err, k)) {
		cr_assert_eq(len, 4 + 1 + 3 + 7);
		free(bytes);
	}
	writer_destroy(&w);
	return hit;
}

Test(oom, a_frame_that_cannot_be_flattened_is_an_error)
{
	cr_assert_geq(sweep(flatten), 1);
}

/* ---- daemon/graph/run.c: a run job (symbolic batch: its own bound signature) -- */

static struct adapter fake_adapter;
static struct specialization fake_sp;
static struct engine_tensor expected[2], expected_out[2];
static struct graphs fake_g;

static void setup_fake(void)
{
	fake_adapter.def.max_elements = 1 << 20;
	fake_adapter.refs = 1;
	fake_sp.adapter = &fake_adapter;
	fake_sp.refs = 1; /* never dropped to 0 here */
	fake_sp.batch = true;
	fake_sp.n_in = 2;
	fake_sp.n_out = 2;
	fake_sp.expected = expected;
	fake_sp.expected_out = expected_out;
	fake_sp.y.kind = TREE_NONE;
	for (int i = 0; i < 2; i++) {
		expected[i] = (struct engine_tensor){PROTO_DTYPE_F64, 1, {-1}, NULL, 0};
		expected_out[i] = expected[i];
	}
}

static bool new_run(long k)
{
	struct proto_err err;
	struct run_job *j;

	arm(k);
	j = run_new(&fake_g, &fake_sp, 5, NULL, &err);
	bool hit = disarm();
	if (outcome(j == NULL, hit, &err, k)) {
		size_t n;
		run_slots(j, &n);
		cr_assert_eq(n, 0);
		run_free(j);
	}
	cr_assert_eq(fake_sp.refs, 1, "allocation %ld: the job's reference was dropped", k);
	return hit;
}

Test(oom, a_run_job_that_cannot_allocate_fails_and_frees_what_it_had, .init = setup_fake)
{
	cr_assert_geq(sweep(new_run), 3, "the job, its inputs, its result, the bound signature");
}
