/*
 * test_cli.c - the torchloop CLI against a real daemon: scans and grads from
 * .npy files compared with eager PyTorch, every usage error (exit 2), a
 * daemon error (exit 1), no daemon (exit 3), health, stats, and a C program
 * built against libtorchloop through its pkg-config file.
 */
#include "harness.h"

#include "params.h"
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

TestSuite(cli, .timeout = 600);

static const char *const ARGS[] = {"--no-probe", NULL};

static const char *cli_bin(void)
{
	static char p[1100];

	snprintf(p, sizeof p, "%s/%s/torchloop", h_root(),
	         getenv("TORCHLOOP_TEST_BUILD") ? getenv("TORCHLOOP_TEST_BUILD") : "build");
	return p;
}

/* Runs the CLI with --socket; returns the exit code; output in dir/cli.log. */
static int cli(const char *sock, const char *dir, const char *const *args)
{
	const char *argv[32];
	char log[600];
	int n = 0;

	argv[n++] = cli_bin();
	argv[n++] = "--socket";
	argv[n++] = sock;
	while (*args && n < 30)
		argv[n++] = *args++;
	argv[n] = NULL;
	snprintf(log, sizeof log, "%s/cli.log", dir);
	return h_run(argv, log);
}

static bool log_has(const char *dir, const char *needle)
{
	char path[600], line[4096];
	FILE *f;
	bool found = false;

	snprintf(path, sizeof path, "%s/cli.log", dir);
	f = fopen(path, "r");
	while (f && fgets(line, sizeof line, f))
		found |= strstr(line, needle) != NULL;
	if (f)
		fclose(f);
	return found;
}

static void save(const char *dir, const char *name, int ndim, const int64_t *shape, uint64_t seed)
{
	char path[600], msg[256];
	double buf[256];
	size_t n = 1;

	for (int i = 0; i < ndim; i++)
		n *= (size_t)shape[i];
	h_fill(buf, TL_FLOAT64, n, seed);
	snprintf(path, sizeof path, "%s/%s", dir, name);
	cr_assert_eq(npy_write(path, TL_FLOAT64, ndim, shape, buf, msg, sizeof msg), 0, "%s", msg);
}

static const struct tl_tree *load_tree(struct treejson *tj, const char *dir, const char *text)
{
	char msg[512];
	const struct tl_tree *t;

	tj->base = dir;
	t = treejson_parse(tj, text, msg, sizeof msg);
	cr_assert_not_null(t, "%s", msg);
	return t;
}

Test(cli, a_scan_from_npy_files_matches_eager_pytorch)
{
	struct hd d;
	char dir[512], out[600], carry[700], ref[600];
	struct tl_builder *b = tl_builder_new();
	struct treejson tj, rj;
	int64_t c[] = {5}, x[] = {4, 5};

	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	h_tmpdir(dir, sizeof dir, "cli");
	for (int i = 0; i < 3; i++) /* x, y and z: [5] each */
		save(dir, (const char *[]){"x.npy", "y.npy", "z.npy"}[i], 1, c, (uint64_t)i + 1);
	save(dir, "f.npy", 2, x, 4);
	cr_assert_eq(
	    cli(d.sock, dir,
	        (const char *[]){"register", "t5.lorenz", "--body", "examples/bodies/lorenz.py",
	                         "--entry", "rk4", "--max-steps", "12", NULL}),
	    0);
	snprintf(out, sizeof out, "%s/out", dir);
	snprintf(carry, sizeof carry,
	         "{\"x\": \"%s/x.npy\", \"y\": \"%s/y.npy\", \"z\": \"%s/z.npy\"}", dir, dir, dir);
	snprintf(ref, sizeof ref, "{\"forcing\": \"%s/f.npy\"}", dir);
	cr_assert_eq(cli(d.sock, dir,
	                 (const char *[]){"scan", "t5.lorenz", "--carry", carry, "--inputs", ref,
	                                  "--out", out, NULL}),
	             0);
	treejson_init(&tj, b, NULL);
	treejson_init(&rj, b, NULL);
	h_reference(dir, "examples/bodies/lorenz.py", "rk4", load_tree(&tj, "/", carry),
	            load_tree(&tj, "/", ref), NULL, NULL, false, false);
	{
		char path[700], msg[256];
		json_t *doc;
		snprintf(path, sizeof path, "%s/tree.json", out);
		doc = json_load_file(path, JSON_PRESERVE_ORDER, NULL);
		cr_assert_not_null(doc);
		tj.base = out;
		h_assert_close(treejson_load(&tj, json_object_get(doc, "carry"), msg, sizeof msg),
		               h_load_ref(&rj, dir, "carry"), 1e-10, 1e-12, "carry");
		h_assert_close(treejson_load(&tj, json_object_get(doc, "outputs"), msg, sizeof msg),
		               h_load_ref(&rj, dir, "outputs"), 1e-10, 1e-12, "outputs");
		json_decref(doc);
	}
	treejson_free(&tj);
	treejson_free(&rj);
	tl_builder_free(b);
	cr_assert_eq(hd_stop(&d), 0);
}

Test(cli, a_grad_writes_gradients_that_match_autograd)
{
	struct hd d;
	char dir[512], out[600], carry[700], inputs[600], cot_c[700], cot_y[600], path[700],
	    msg[256];
	struct tl_builder *b = tl_builder_new();
	struct treejson tj, rj;
	int64_t h[] = {2, 8}, x[] = {3, 2, 3}, y[] = {3, 2, 8};
	json_t *doc;

	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	h_tmpdir(dir, sizeof dir, "cligrad");
	save(dir, "h.npy", 2, h, 5);
	save(dir, "x.npy", 3, x, 6);
	save(dir, "ch.npy", 2, h, 7);
	save(dir, "cy.npy", 3, y, 8);
	cr_assert_eq(cli(d.sock, dir,
	                 (const char *[]){"register", "t5.rnn", "--body", "examples/bodies/rnn.py",
	                                  "--entry", "cell", "--max-steps", "6", NULL}),
	             0);
	snprintf(carry, sizeof carry, "{\"__tuple__\": [\"%s/h.npy\", null]}", dir);
	snprintf(inputs, sizeof inputs, "%s/x.npy", dir);
	snprintf(cot_c, sizeof cot_c, "{\"__tuple__\": [\"%s/ch.npy\", null]}", dir);
	snprintf(cot_y, sizeof cot_y, "%s/cy.npy", dir);
	snprintf(out, sizeof out, "%s/out", dir);
	treejson_init(&tj, b, NULL);
	treejson_init(&rj, b, NULL);
	h_reference(dir, "examples/bodies/rnn.py", "cell", load_tree(&tj, "/", carry),
	            load_tree(&tj, "/", inputs), load_tree(&tj, "/", cot_c),
	            load_tree(&tj, "/", cot_y), true, false);
	/* the plain VJP, then the checkpointed one (a graph of its own) */
	for (int ckpt = 0; ckpt < 2; ckpt++) {
		snprintf(out, sizeof out, "%s/out%d", dir, ckpt);
		cr_assert_eq(
		    cli(d.sock, dir,
		        (const char *[]){"grad", "t5.rnn", "--carry", carry, "--inputs", inputs,
		                         "--cot-carry", cot_c, "--cot-outputs", cot_y, "--out", out,
		                         ckpt ? "--checkpoint" : NULL, NULL}),
		    0);
		snprintf(path, sizeof path, "%s/tree.json", out);
		doc = json_load_file(path, JSON_PRESERVE_ORDER, NULL);
		cr_assert_not_null(doc);
		tj.base = out;
		for (int k = 0; k < 4; k++) {
			static const char *const keys[] = {"carry", "outputs", "grad_carry",
			                                   "grad_inputs"};
			h_assert_close(
			    treejson_load(&tj, json_object_get(doc, keys[k]), msg, sizeof msg),
			    h_load_ref(&rj, dir, keys[k]), 1e-10, 1e-12, keys[k]);
		}
		json_decref(doc);
	}
	treejson_free(&tj);
	treejson_free(&rj);
	tl_builder_free(b);
	cr_assert_eq(hd_stop(&d), 0);
}

/* ---- usage errors: exit 2, with a message --------------------------------------- */

struct usage_case {
	const char *args[10];
	const char *says;
};

static const struct usage_case USAGE[] = {
    {{NULL}, "no command"},
    {{"frobnicate", NULL}, "unknown command"},
    {{"scan", NULL}, "needs an ADAPTER"},
    {{"scan", "t5.x", "--carry", "c.npy", NULL}, "required"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "fortran.npy", "--out", "o", NULL},
     "Fortran"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "int.npy", "--out", "o", NULL},
     "not float32"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "damaged.npy", "--out", "o", NULL},
     "damaged"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "missing.npy", "--out", "o", NULL},
     "No such file"},
    {{"scan", "t5.x", "--carry", "{\"a\": 5}", "--inputs", "c.npy", "--out", "o", NULL}, "leaves"},
    /* malformed JSON is reported as such, with where, not as a missing file */
    {{"scan", "t5.x", "--carry", "{\"a\": \"c.npy\"", "--inputs", "c.npy", "--out", "o", NULL},
     "invalid JSON tree at line 1"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "[\"c.npy\",]", "--out", "o", NULL},
     "invalid JSON tree at line 1, column"},
    {{"scan", "t5.x", "--bogus", NULL}, "unknown option"},
    {{"register", "t5.x", NULL}, "--body"},
    {{"register", "t5.x", "--body", "b.py", "--max-steps", "many", NULL}, "integer"},
    {{"describe", NULL}, "needs a NAME"},
    {{"list", "extra", NULL}, "unexpected argument"},
    {{"scan", "t5.x", "--carry", "c.npy", "--inputs", "c.npy", "--out", "o", "--checkpoint", NULL},
     "grad's"},
    {{"compile", "t5.x", "--carry", "c.npy", "--inputs", "c.npy", "--checkpoint", NULL},
     "needs --grad"},
};

#define N_USAGE (sizeof USAGE / sizeof USAGE[0])

INDEX_PARAMS(cli, each_usage_error_exits_2_with_a_message, N_USAGE)

static void write_bytes(const char *dir, const char *name, const void *p, size_t n)
{
	char path[600];
	FILE *f;

	snprintf(path, sizeof path, "%s/%s", dir, name);
	f = fopen(path, "wb");
	fwrite(p, 1, n, f);
	fclose(f);
}

/* A .npy with the given header text (its length computed) and data bytes. */
static void write_npy(const char *dir, const char *name, const char *header, size_t data)
{
	char buf[512] = "\x93NUMPY\x01\x00";
	size_t n = strlen(header);

	buf[8] = (char)(n & 0xff);
	buf[9] = (char)(n >> 8);
	memcpy(buf + 10, header, n);
	memset(buf + 10 + n, 0, data);
	write_bytes(dir, name, buf, 10 + n + data);
}

ParameterizedTest(int *i, cli, each_usage_error_exits_2_with_a_message)
{
	char dir[512], cwd[1024];
	int64_t s4[] = {4};
	const char *argv[16];
	char log[600];
	int n = 0, rc;

	(void)cli_bin(); /* resolve the paths before the chdir below */
	h_tmpdir(dir, sizeof dir, "usage");
	save(dir, "c.npy", 1, s4, 1);
	write_npy(dir, "fortran.npy", "{'descr': '<f8', 'fortran_order': True, 'shape': (2,), }",
	          16);
	write_npy(dir, "damaged.npy", "{'descr': '<f8', 'fortran_", 0);
	write_npy(dir, "int.npy", "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", 16);
	write_bytes(dir, "b.py", "def body(c, x):\n    return c, c\n", 32);
	cr_assert_not_null(getcwd(cwd, sizeof cwd));
	cr_assert_eq(chdir(dir), 0);
	argv[n++] = cli_bin();
	argv[n++] = "--socket";
	argv[n++] = "/nonexistent/sock";
	for (const char *const *a = USAGE[*i].args; *a; a++)
		argv[n++] = *a;
	argv[n] = NULL;
	snprintf(log, sizeof log, "%s/cli.log", dir);
	rc = h_run(argv, log);
	cr_assert_eq(chdir(cwd), 0);
	cr_assert_eq(rc, 2, "exit %d for case %d", rc, *i);
	cr_assert(log_has(dir, USAGE[*i].says), "case %d: stderr says '%s'", *i, USAGE[*i].says);
}

Test(cli, no_daemon_exits_3_and_a_daemon_error_exits_1)
{
	struct hd d;
	char dir[512];
	int64_t s4[] = {4}, s34[] = {3, 4};

	h_tmpdir(dir, sizeof dir, "exits");
	save(dir, "c.npy", 1, s4, 1);
	save(dir, "x.npy", 2, s34, 2);
	cr_assert_eq(cli("/nonexistent/sock", dir, (const char *[]){"health", NULL}), 3);
	cr_assert(log_has(dir, "cannot connect"));
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	{
		char c[600], x[600], out[600];
		snprintf(c, sizeof c, "%s/c.npy", dir);
		snprintf(x, sizeof x, "%s/x.npy", dir);
		snprintf(out, sizeof out, "%s/out", dir);
		cr_assert_eq(cli(d.sock, dir,
		                 (const char *[]){"scan", "no.such", "--carry", c, "--inputs", x,
		                                  "--out", out, NULL}),
		             1);
		cr_assert(log_has(dir, "NOT_FOUND"));
	}
	/* --dynamic reaches the daemon: a mode it does not know is its error */
	cr_assert_eq(cli(d.sock, dir,
	                 (const char *[]){"register", "t5.dyn", "--body", "examples/bodies/ema.py",
	                                  "--dynamic", "rows", NULL}),
	             1);
	cr_assert(log_has(dir, "INVALID_ARGUMENT"));
	cr_assert(log_has(dir, "dynamic must be"));
	cr_assert_eq(cli(d.sock, dir,
	                 (const char *[]){"register", "t5.dyn", "--body", "examples/bodies/ema.py",
	                                  "--dynamic", "batch", NULL}),
	             0);
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"--json", "describe", "t5.dyn", NULL}), 0);
	cr_assert(log_has(dir, "\"dynamic\":\"batch\""));
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"health", NULL}), 0);
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"health", "--live", NULL}), 0);
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"--json", "list", NULL}), 0);
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"stats", "--prometheus", NULL}), 0);
	cr_assert(log_has(dir, "torchloopd_connections_total"));
	cr_assert(log_has(dir, "torchloopd_adapter_upgrades_skipped_total{adapter=\"t5.dyn\"} 0"));
	cr_assert_eq(cli(d.sock, dir, (const char *[]){"scan", "--help", NULL}), 0);
	cr_assert(log_has(dir, "usage: torchloop"));
	cr_assert_eq(hd_stop(&d), 0);
}

Test(cli, a_c_program_builds_against_libtorchloop_through_pkg_config)
{
	struct hd d;
	char dir[512], exe[600], src[1100], pc[1100], log[600], cmd[8192];
	int rc;

	h_tmpdir(dir, sizeof dir, "pkgconfig");
	snprintf(exe, sizeof exe, "%s/example", dir);
	snprintf(src, sizeof src, "%s/examples/client_example.c", h_root());
	snprintf(pc, sizeof pc, "%s/%s", h_root(),
	         getenv("TORCHLOOP_TEST_BUILD") ? getenv("TORCHLOOP_TEST_BUILD") : "build");
	snprintf(log, sizeof log, "%s/cli.log", dir);
	snprintf(cmd, sizeof cmd,
	         "PKG_CONFIG_PATH=%s cc -std=c11 -Wall -Werror %s -o %s %s $(PKG_CONFIG_PATH=%s "
	         "pkg-config --cflags --libs torchloop) -Wl,-rpath,%s",
	         pc, /* a sanitizer build's library needs the program linked with its runtimes */
	         getenv("TORCHLOOP_TEST_SAN") ? "-fsanitize=address,undefined" : "", exe, src, pc,
	         pc);
	rc = h_run((const char *[]){"sh", "-c", cmd, NULL}, log);
	cr_assert_eq(rc, 0, "build failed; see %s", log);
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	{
		struct tl_client *c = hd_connect(&d);
		hd_register(c, "t5.cumsum", "examples/bodies/cumsum.py", "body", 12, 65536, 8);
		tl_close(c);
	}
	rc = h_run((const char *[]){exe, d.sock, "t5.cumsum", NULL}, log);
	cr_assert_eq(rc, 0);
	/* 0.5 * (1 + ... + 8) = 18 added to each element */
	cr_assert(log_has(dir, "carry: 18 19 20 21"), "see %s", log);
	cr_assert_eq(hd_stop(&d), 0);
}
