/*
 * test_compile_path.c - the compile path end to end: example bodies
 * compiled by the worker, cached, loaded and run by the daemon, compared
 * with an eager PyTorch loop computed by tests/helpers/eager_ref.py; compile
 * errors with their codes; corrupted artifacts detected and rebuilt; and a
 * cached artifact run from C with no Python process alive.
 *
 * Test adapters use max_steps = 12 so that T = max_steps stays cheap to
 * compile; every specialization compiles once per test run (shared cache).
 */
#include "harness.h"

#include "cache.h"
#include "engine.h"

#include "params.h"
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_STEPS 12

TestSuite(compile_path, .timeout = 900);

static const char *const NO_PROBE[] = {"--no-probe", NULL};

/* ---- the example bodies -------------------------------------------------- */

enum body { CUMSUM, EMA, LORENZ, RNN, DICT_OUT, N_BODIES };

static const struct body_info {
	const char *adapter, *file, *entry;
} BODIES[N_BODIES] = {
    [CUMSUM] = {"t3.cumsum", "examples/bodies/cumsum.py", "body"},
    [EMA] = {"t3.ema", "examples/bodies/ema.py", "body"},
    [LORENZ] = {"t3.lorenz", "examples/bodies/lorenz.py", "rk4"},
    [RNN] = {"t3.rnn", "examples/bodies/rnn.py", "cell"},
    [DICT_OUT] = {"t3.dict_out", "examples/bodies/dict_out.py", "body"},
};

struct trees {
	struct tl_builder *b;
	struct tl_tree *carry, *inputs;
	void *bufs[8];
	int n;
};

static struct tl_tree *rand_tensor(struct trees *t, enum tl_dtype dt, int ndim,
                                   const int64_t *shape, uint64_t seed)
{
	size_t n = 1, item = dt == TL_FLOAT32 ? 4 : 8;
	void *buf;

	for (int i = 0; i < ndim; i++)
		n *= (size_t)shape[i];
	buf = aligned_alloc(64, ((n * item + 63) / 64 + 1) * 64);
	h_fill(buf, dt, n, seed);
	t->bufs[t->n++] = buf;
	return tl_tensor(t->b, dt, ndim, shape, buf);
}

/* Builds the carry and inputs each body takes, T steps long. */
static void build(struct trees *t, enum body body, enum tl_dtype dt, int64_t steps)
{
	memset(t, 0, sizeof *t);
	t->b = tl_builder_new();
	switch (body) {
	case CUMSUM:
	case DICT_OUT: {
		int64_t c[] = {4}, x[] = {steps, 4};
		t->carry = rand_tensor(t, dt, 1, c, 1);
		t->inputs = rand_tensor(t, dt, 2, x, 2);
		break;
	}
	case EMA: {
		int64_t c[] = {3, 2}, x[] = {steps, 3, 2};
		t->carry = rand_tensor(t, dt, 2, c, 3);
		t->inputs = rand_tensor(t, dt, 3, x, 4);
		break;
	}
	case LORENZ: {
		int64_t c[] = {5}, x[] = {steps, 5};
		const char *keys[] = {"x", "y", "z"}, *fk[] = {"forcing"};
		struct tl_tree *xyz[3] = {rand_tensor(t, dt, 1, c, 5), rand_tensor(t, dt, 1, c, 6),
		                          rand_tensor(t, dt, 1, c, 7)};
		struct tl_tree *f = rand_tensor(t, dt, 2, x, 8);
		t->carry = tl_dict(t->b, 3, keys, xyz);
		t->inputs = tl_dict(t->b, 1, fk, &f);
		break;
	}
	case RNN: {
		int64_t h[] = {2, 8}, x[] = {steps, 2, 3};
		struct tl_tree *items[2] = {rand_tensor(t, dt, 2, h, 9), tl_none(t->b)};
		t->carry = tl_tuple(t->b, 2, items);
		t->inputs = rand_tensor(t, dt, 3, x, 10);
		break;
	}
	default:
		break;
	}
}

static void free_trees(struct trees *t)
{
	for (int i = 0; i < t->n; i++)
		free(t->bufs[i]);
	tl_builder_free(t->b);
}

/* ---- results equal eager PyTorch ----------------------------------------- */

/* Each body at T = 1 and T = max_steps in float64, and at T = max_steps in
 * float32 (its rounding), on one daemon: three compiles a body. */
static const struct run_case {
	enum tl_dtype dtype;
	int64_t steps;
} RUNS[] = {{TL_FLOAT64, 1}, {TL_FLOAT64, MAX_STEPS}, {TL_FLOAT32, MAX_STEPS}};

static void check_run(struct tl_client *c, const struct body_info *bi, enum body body,
                      const struct run_case *rc)
{
	/* float64: the one tolerance of the suite (issue 32); float32: its rounding */
	double rtol = rc->dtype == TL_FLOAT64 ? 1e-10 : 1e-5;
	double atol = rc->dtype == TL_FLOAT64 ? 1e-12 : 1e-6;
	struct tl_reply *r;
	struct tl_error err;
	struct treejson tj;
	struct trees t;
	char dir[512], what[128];

	build(&t, body, rc->dtype, rc->steps);
	cr_assert_eq(tl_scan(c, bi->adapter, t.carry, t.inputs, &r, &err), 0, "%s: %s %s",
	             bi->adapter, err.code, err.message);
	h_tmpdir(dir, sizeof dir, "ref");
	h_reference(dir, bi->file, bi->entry, t.carry, t.inputs, NULL, NULL, false, false);
	treejson_init(&tj, t.b, NULL);
	snprintf(what, sizeof what, "%s %s T=%lld carry", bi->adapter,
	         rc->dtype == TL_FLOAT32 ? "f32" : "f64", (long long)rc->steps);
	h_assert_close(tl_reply_tree(r, "carry"), h_load_ref(&tj, dir, "carry"), rtol, atol, what);
	snprintf(what, sizeof what, "%s %s T=%lld outputs", bi->adapter,
	         rc->dtype == TL_FLOAT32 ? "f32" : "f64", (long long)rc->steps);
	h_assert_close(tl_reply_tree(r, "outputs"), h_load_ref(&tj, dir, "outputs"), rtol, atol,
	               what);
	tl_reply_free(r);
	treejson_free(&tj);
	free_trees(&t);
}

INDEX_PARAMS(compile_path, every_example_body_matches_an_eager_loop, N_BODIES)

ParameterizedTest(int *i, compile_path, every_example_body_matches_an_eager_loop)
{
	const struct body_info *bi = &BODIES[*i];
	struct hd d;
	struct tl_client *c;

	hd_start(&d, NULL, NO_PROBE);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, bi->adapter, bi->file, bi->entry, MAX_STEPS, 65536, 8);
	for (size_t k = 0; k < sizeof RUNS / sizeof RUNS[0]; k++)
		check_run(c, bi, (enum body) * i, &RUNS[k]);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

/* ---- compile errors ---------------------------------------------------------- */

struct error_case {
	const char *entry;
	const char *code;
};

static const struct error_case ERRORS[] = {
    {"raises", "BODY_ERROR"},
    {"reshapes_carry", "CARRY_MISMATCH"},
    {"changes_dtype", "CARRY_MISMATCH"},
    {"returns_one_value", "BODY_ERROR"},
    {"branches_on_data", "GRAPH_BREAK"},
    {"unsupported", "GRAPH_BREAK"},
    {"uses_numpy", "UNSUPPORTED_OP"},
};

#define N_ERRORS (sizeof ERRORS / sizeof ERRORS[0])

/* One failing body on a running daemon: its code, remembered, and the next
 * request (cumsum's scan) served. */
static void check_failure(struct tl_client *c, const struct error_case *ec)
{
	struct tl_reply *r;
	struct tl_error err;
	struct trees t;
	char name[64];

	snprintf(name, sizeof name, "bad.%s", ec->entry);
	hd_register(c, name, "tests/fixtures/bad_bodies.py", ec->entry, MAX_STEPS, 65536, 8);
	build(&t, CUMSUM, TL_FLOAT64, 3);
	cr_assert_eq(tl_scan(c, name, t.carry, t.inputs, &r, &err), -1, "%s compiled", ec->entry);
	cr_assert_str_eq(err.code, ec->code, "%s: got %s: %s", ec->entry, err.code, err.message);
	cr_assert(strlen(err.message) > 20, "the message explains: %s", err.message);
	if (strcmp(ec->code, "CARRY_MISMATCH") == 0)
		cr_assert_str_eq(err.path, "carry", "names the leaf: %s", err.message);
	/* the same request again is answered from the remembered failure */
	cr_assert_eq(tl_scan(c, name, t.carry, t.inputs, &r, &err), -1);
	cr_assert_str_eq(err.code, ec->code);
	cr_assert_eq(hd_counter(c, name, "compiles"), 1, "a deterministic failure is not retried");
	/* and the daemon still serves the next request */
	cr_assert_eq(tl_scan(c, BODIES[CUMSUM].adapter, t.carry, t.inputs, &r, &err), 0,
	             "after %s: %s", ec->entry, err.message);
	tl_reply_free(r);
	free_trees(&t);
}

/* Every failing body in turn on one daemon, which serves on after each. */
Test(compile_path, a_failing_body_gets_its_code_and_the_daemon_serves_on)
{
	struct hd d;
	struct tl_client *c;

	hd_start(&d, NULL, NO_PROBE);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, BODIES[CUMSUM].adapter, BODIES[CUMSUM].file, "body", MAX_STEPS, 65536, 8);
	for (size_t i = 0; i < N_ERRORS; i++)
		check_failure(c, &ERRORS[i]);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

/* ---- corruption ---------------------------------------------------------------- */

static void find_artifact(const char *cache, char *out, size_t size)
{
	char dir[600];
	DIR *dp;
	struct dirent *e;

	snprintf(dir, sizeof dir, "%s/objects", cache);
	dp = opendir(dir);
	cr_assert_not_null(dp);
	out[0] = '\0';
	while ((e = readdir(dp)) != NULL) {
		size_t n = strlen(e->d_name);
		if (n > 3 && strcmp(e->d_name + n - 3, ".so") == 0) {
			cr_assert_eq(out[0], '\0', "one artifact expected in %s", dir);
			snprintf(out, size, "%s/%s", dir, e->d_name);
		}
	}
	closedir(dp);
	cr_assert_neq(out[0], '\0', "no artifact in %s", dir);
}

static int count_files(const char *dir)
{
	DIR *dp = opendir(dir);
	struct dirent *e;
	int n = 0;

	while (dp && (e = readdir(dp)) != NULL)
		n += e->d_name[0] != '.';
	if (dp)
		closedir(dp);
	return n;
}

static void corrupt(const char *path, long cut, bool flip)
{
	struct stat st;

	chmod(path, 0600);
	cr_assert_eq(stat(path, &st), 0);
	if (flip) {
		FILE *f = fopen(path, "r+b");
		int ch;
		fseek(f, st.st_size / 3, SEEK_SET);
		ch = fgetc(f);
		fseek(f, st.st_size / 3, SEEK_SET);
		fputc(ch ^ 0x40, f);
		fclose(f);
	} else {
		cr_assert_eq(truncate(path, cut < 0 ? st.st_size + cut : cut), 0);
	}
}

/* One scan on a private cache; returns whether it came from the cache. */
static bool scan_once(const char *cache, struct trees *t, double *compiles)
{
	struct tl_reply *r;
	struct tl_error err;
	struct hd d;
	struct tl_client *c;
	const double *y;
	bool from_cache;

	hd_start(&d, cache, NO_PROBE);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "t3.corrupt", BODIES[CUMSUM].file, "body", MAX_STEPS, 65536, 8);
	cr_assert_eq(tl_scan(c, "t3.corrupt", t->carry, t->inputs, &r, &err), 0, "%s", err.message);
	/* cumsum by hand: carry + x0 + x1 + x2 */
	y = tl_tree_data(tl_reply_tree(r, "carry"));
	for (int k = 0; k < 4; k++) {
		const double *c0 = tl_tree_data(t->carry), *x = tl_tree_data(t->inputs);
		cr_assert_float_eq(y[k], c0[k] + x[k] + x[4 + k] + x[8 + k], 1e-12);
	}
	*compiles = hd_counter(c, "t3.corrupt", "compiles");
	from_cache = hd_counter(c, "t3.corrupt", "cache_hits") == 1;
	tl_reply_free(r);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	return from_cache;
}

/* Writes len bytes of data to path (0444, as the cache leaves its files). */
static void put_file(const char *path, const void *data, size_t len)
{
	FILE *f;

	chmod(path, 0600);
	f = fopen(path, "wb");
	cr_assert_not_null(f, "%s", path);
	cr_assert_eq(fwrite(data, 1, len, f), len);
	cr_assert_eq(fclose(f), 0);
	chmod(path, 0444);
}

static void *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	struct stat st;
	void *buf;

	cr_assert_not_null(f, "%s", path);
	cr_assert_eq(fstat(fileno(f), &st), 0);
	*len = (size_t)st.st_size;
	buf = malloc(*len + 1);
	cr_assert_eq(fread(buf, 1, *len, f), *len);
	fclose(f);
	return buf;
}

/*
 * Every corruption of a committed entry (emptied, cut to one byte, to half,
 * by its last byte, one bit flipped) is found by the cache's lookup and
 * quarantined; for two of them (the size check and the sha256 check) a
 * daemon goes on to rebuild the entry, once, and serves the scan.  The others
 * are looked up in process: the rebuild after them is the same code.
 */
Test(compile_path, a_truncated_or_flipped_artifact_is_quarantined_and_rebuilt)
{
	static const struct {
		long cut;
		bool flip, half, rebuild;
	} modes[] = {{0, false, false, true},
	             {1, false, false, false},
	             {0, false, true, false},
	             {-1, false, false, false},
	             {0, true, false, true}};
	char cache[512], so[1024], meta[1030], key[CACHE_KEY_HEX], quarantine[600];
	struct trees t;
	struct cache cc;
	struct proto_err perr;
	double compiles;
	void *good_so, *good_meta;
	size_t so_len, meta_len;

	h_tmpdir(cache, sizeof cache, "cache");
	snprintf(quarantine, sizeof quarantine, "%s/quarantine", cache);
	build(&t, CUMSUM, TL_FLOAT64, 3);
	cr_assert_not(scan_once(cache, &t, &compiles), "first scan compiles");
	cr_assert(scan_once(cache, &t, &compiles), "second daemon finds the artifact");
	cr_assert_eq(compiles, 0, "no recompilation after a restart");
	find_artifact(cache, so, sizeof so);
	snprintf(meta, sizeof meta, "%.*s.meta", (int)(strlen(so) - 3), so);
	snprintf(key, sizeof key, "%.64s", strrchr(so, '/') + 1);
	good_so = read_file(so, &so_len);
	good_meta = read_file(meta, &meta_len);
	cr_assert_eq(cache_open(&cc, cache, &perr), 0, "%s", perr.message);
	for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
		struct cache_meta cm;
		int quarantined;

		put_file(so, good_so, so_len);
		put_file(meta, good_meta, meta_len);
		corrupt(so, modes[m].half ? (long)so_len / 2 : modes[m].cut, modes[m].flip);
		if (modes[m].rebuild) {
			cr_assert_not(scan_once(cache, &t, &compiles),
			              "mode %zu: the corrupt artifact was loaded", m);
			cr_assert_eq(compiles, 1, "mode %zu: rebuilt once", m);
		} else {
			cr_assert_eq(cache_lookup(&cc, key, &cm, &quarantined, &perr), 0,
			             "mode %zu: the corrupt entry was found", m);
			cr_assert_eq(quarantined, 1, "mode %zu: not quarantined", m);
		}
		cr_assert_eq(count_files(quarantine), 2 * (int)(m + 1),
		             "mode %zu: .so and .meta quarantined", m);
	}
	free(good_so);
	free(good_meta);
	free_trees(&t);
}

/* ---- a cached artifact runs from C with no Python process ----------------------- */

Test(compile_path, a_cached_artifact_runs_from_c_while_no_python_process_exists)
{
	char cache[512], so[1024];
	struct cache cc;
	struct proto_err perr;
	struct engine_graph *g;
	struct engine_result res;
	struct trees t;
	int64_t c_shape[] = {4096}, x_shape[] = {3, 4096};
	struct engine_tensor in[2];
	pid_t worker = 0;

	h_tmpdir(cache, sizeof cache, "nopy");
	/* a daemon compiles a large-ish cumsum (OpenMP-parallel code), then stops */
	memset(&t, 0, sizeof t);
	t.b = tl_builder_new();
	t.carry = rand_tensor(&t, TL_FLOAT64, 1, c_shape, 21);
	t.inputs = rand_tensor(&t, TL_FLOAT64, 2, x_shape, 22);
	{
		struct hd d;
		struct tl_client *c;
		struct tl_reply *r;
		struct tl_error err;
		hd_start(&d, cache, NO_PROBE);
		hd_wait_ready(&d, 120);
		c = hd_connect(&d);
		hd_register(c, "t3.nopy", BODIES[CUMSUM].file, "body", MAX_STEPS, 65536, 8);
		cr_assert_eq(tl_scan(c, "t3.nopy", t.carry, t.inputs, &r, &err), 0, "%s",
		             err.message);
		tl_reply_free(r);
		tl_close(c);
		worker = h_child_of(d.pid);
		cr_assert_gt(worker, 0, "found the daemon's compile worker");
		cr_assert_eq(hd_stop(&d), 0);
	}
	/* the worker went with its daemon: no Python process serves what follows */
	cr_assert(kill(worker, 0) != 0 && errno == ESRCH, "compile worker %d still exists",
	          (int)worker);
	cr_assert_eq(cache_open(&cc, cache, &perr), 0, "%s", perr.message);
	find_artifact(cache, so, sizeof so);
	cr_assert_eq(engine_load(so, 1, &g, &perr), 0, "%s", perr.message);
	cr_assert_eq(engine_count_openmp_runtimes(), 1, "one OpenMP runtime mapped");
	in[0] = (struct engine_tensor){
	    PROTO_DTYPE_F64, 1, {4096}, (void *)tl_tree_data(t.carry), 4096 * 8};
	in[1] = (struct engine_tensor){
	    PROTO_DTYPE_F64, 2, {3, 4096}, (void *)tl_tree_data(t.inputs), 3 * 4096 * 8};
	cr_assert_eq(engine_run(g, in, 2, in, in, NULL, &res, &perr), 0, "%s", perr.message);
	for (int k = 0; k < 4096; k++) {
		const double *c0 = tl_tree_data(t.carry), *x = tl_tree_data(t.inputs);
		const double *y = res.tensors[1].data, *fin = res.tensors[0].data;
		double acc = c0[k];
		for (int s = 0; s < 3; s++) {
			acc += x[s * 4096 + k];
			cr_assert_float_eq(y[s * 4096 + k], acc, 1e-12);
		}
		cr_assert_float_eq(fin[k], acc, 1e-12);
	}
	engine_result_free(&res);
	/* shapes other than the compiled signature are refused before Run */
	{
		struct engine_tensor expected[2] = {in[0], in[1]};
		in[1].shape[1] = 4095;
		in[1].nbytes = 3 * 4095 * 8;
		cr_assert_eq(engine_run(g, in, 2, expected, expected, NULL, &res, &perr), -1);
		cr_assert_eq(perr.code, PROTO_E_SPEC_MISMATCH, "%s", perr.message);
	}
	engine_unload(g);
	free_trees(&t);
}

/* The wheel's libgomp (SONAME libgomp.so.1) is loaded by libtorch_cpu; an
 * artifact that NEEDs libgomp.so.1 must bind to it, not to the system's copy. */
Test(compile_path, an_openmp_artifact_shares_libtorchs_openmp_runtime)
{
	char cache[512], so[1024];
	struct engine_graph *g;
	struct proto_err perr;
	struct trees t;
	struct hd d;
	struct tl_client *c;
	struct tl_reply *r;
	struct tl_error err;
	int64_t cs[] = {262144}, xs[] = {2, 262144};
	FILE *f;
	char buf[4096];
	size_t n;
	bool needs_gomp = false;

	h_tmpdir(cache, sizeof cache, "omp");
	memset(&t, 0, sizeof t);
	t.b = tl_builder_new();
	/* big enough that Inductor parallelises the elementwise loops */
	t.carry = rand_tensor(&t, TL_FLOAT64, 1, cs, 31);
	t.inputs = rand_tensor(&t, TL_FLOAT64, 2, xs, 32);
	hd_start(&d, cache, NO_PROBE);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "t3.omp", BODIES[CUMSUM].file, "body", MAX_STEPS, 1048576, 8);
	cr_assert_eq(tl_scan(c, "t3.omp", t.carry, t.inputs, &r, &err), 0, "%s", err.message);
	tl_reply_free(r);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	find_artifact(cache, so, sizeof so);
	f = fopen(so, "rb");
	while (f && (n = fread(buf, 1, sizeof buf, f)) > 0)
		for (size_t k = 0; k + 12 <= n && !needs_gomp; k++)
			needs_gomp = memcmp(buf + k, "libgomp.so.1", 12) == 0;
	if (f)
		fclose(f);
	cr_assert(needs_gomp, "this graph was expected to use OpenMP (NEEDED libgomp.so.1)");
	cr_assert_eq(engine_load(so, 1, &g, &perr), 0, "%s", perr.message);
	cr_assert_eq(engine_count_openmp_runtimes(), 1, "one libgomp image in the process");
	engine_unload(g);
	free_trees(&t);
}

/* ---- the parity check ------------------------------------------------------------- */

/* A worker whose graphs add 0.5 to their first result (tests/helpers/
 * miscompile_worker.py): each new artifact is run once on the worker's probe
 * inputs against the eager scan before it is committed, so the wrong graph
 * is refused with MISCOMPILE and the numbers, remembered (not compiled
 * again), nothing cached, and the daemon serves on. */
Test(compile_path, an_artifact_that_disagrees_with_the_eager_scan_is_refused)
{
	char cache[512], worker[600], so[1024];
	const char *args[] = {"--no-probe", "--worker", worker, NULL};
	struct trees t;
	struct tl_reply *r;
	struct tl_error err;
	struct hd d;
	struct tl_client *c;
	int ready = 0;

	h_tmpdir(cache, sizeof cache, "miscompile");
	snprintf(worker, sizeof worker, "%s/tests/helpers/miscompile_worker.py", h_root());
	build(&t, CUMSUM, TL_FLOAT64, 3);
	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "t3.wrong", BODIES[CUMSUM].file, "body", MAX_STEPS, 65536, 8);
	cr_assert_eq(tl_scan(c, "t3.wrong", t.carry, t.inputs, &r, &err), -1, "accepted");
	cr_assert_str_eq(err.code, "MISCOMPILE", "%s: %s", err.code, err.message);
	cr_assert_str_eq(err.path, "carry");
	cr_assert(strstr(err.message, "disagrees with the eager scan") &&
	              strstr(err.message, "run on the request's own inputs") &&
	              strstr(err.message, "max |compiled - eager| = 0.5"),
	          "%s", err.message);
	/* remembered: asked again, answered without a compile */
	cr_assert_eq(tl_scan(c, "t3.wrong", t.carry, t.inputs, &r, &err), -1);
	cr_assert_str_eq(err.code, "MISCOMPILE");
	cr_assert_eq(hd_counter(c, "t3.wrong", "compiles"), 1);
	{ /* a verdict on random inputs (a data-less compile) is not remembered */
		struct trees t4;
		build(&t4, CUMSUM, TL_FLOAT64, 4);
		for (int k = 0; k < 2; k++) {
			cr_assert_eq(tl_compile(c, "t3.wrong", t4.carry, t4.inputs, TL_FLOAT64,
			                        TL_GRAPH_SCAN, &r, &err),
			             -1, "accepted");
			cr_assert_str_eq(err.code, "MISCOMPILE", "%s: %s", err.code, err.message);
			cr_assert(strstr(err.message, "run on random inputs"), "%s", err.message);
		}
		cr_assert_eq(hd_counter(c, "t3.wrong", "compiles"), 3, "compiled again each time");
		free_trees(&t4);
	}
	cr_assert(strstr(err.message, "max |compiled - eager| = 0.5"), "%s", err.message);
	{ /* the key's lock file may remain; no artifact */
		DIR *dp;
		struct dirent *e;
		snprintf(so, sizeof so, "%s/objects", cache);
		dp = opendir(so);
		cr_assert_not_null(dp);
		while ((e = readdir(dp)) != NULL)
			cr_assert_null(strstr(e->d_name, ".so"), "%s was cached", e->d_name);
		closedir(dp);
	}
	cr_assert_eq(tl_health(c, &ready, &err), 0);
	cr_assert(ready);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	free_trees(&t);
}

/* The worker dlopens every artifact it checks and can never unload one: it
 * asks to be replaced after TORCHLOOP_WORKER_RECYCLE of them (32 by
 * default), between jobs.  Here after each: every compile still succeeds,
 * nothing is counted as a crash. */
Test(compile_path, a_worker_that_has_loaded_its_share_of_artifacts_is_replaced)
{
	struct trees t1, t2;
	struct tl_reply *r;
	struct tl_error err;
	struct hd d;
	struct tl_client *c;

	setenv("TORCHLOOP_WORKER_RECYCLE", "1", 1);
	hd_start(&d, NULL, NO_PROBE);
	unsetenv("TORCHLOOP_WORKER_RECYCLE");
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "t3.recycle", BODIES[CUMSUM].file, "body", MAX_STEPS, 65536, 8);
	build(&t1, CUMSUM, TL_FLOAT64, 2);
	build(&t2, CUMSUM, TL_FLOAT64, 4);
	cr_assert_eq(tl_scan(c, "t3.recycle", t1.carry, t1.inputs, &r, &err), 0, "%s", err.message);
	tl_reply_free(r);
	cr_assert_eq(tl_scan(c, "t3.recycle", t2.carry, t2.inputs, &r, &err), 0, "%s", err.message);
	tl_reply_free(r);
	/* a warm cache may serve both without compiling: then nothing was loaded */
	if (hd_counter(c, "t3.recycle", "compiles") > 0)
		cr_assert_geq(h_stat(c, "worker_recycled"), 1);
	cr_assert_eq(hd_counter(c, "t3.recycle", "worker_crashes"), 0);
	cr_assert_eq(h_stat(c, "worker_start_failures"), 0);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	free_trees(&t1);
	free_trees(&t2);
}
