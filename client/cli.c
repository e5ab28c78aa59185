/*
 * cli.c - the torchloop command-line client.  argv work happens here; each
 * subcommand sends one request through libtorchloop, prints the daemon's
 * message on stderr on failure and maps outcomes to exit codes:
 *   0 ok, 1 the daemon returned an error, 2 usage error, 3 cannot connect.
 * Trees are .npy paths, null, or JSON trees of those (docs/cli.md).
 */
#include "protocol.h"
#include "torchloop.h"
#include "cli_stats.h"
#include "treejson.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { EXIT_OK = 0, EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_CONNECT = 3 };

struct cli {
	const char *socket;
	bool json;
	struct tl_client *client;
	struct tl_builder *builder;
	struct treejson tj;
};

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "torchloop: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n(torchloop --help for usage)\n");
	return EXIT_USAGE;
}

/* ---- the subcommands: one row each ------------------------------------- */

struct cli;
struct sub_opts;
typedef int (*command_fn)(struct cli *c, const struct sub_opts *o, const char *cmd,
                          const char *arg);
static int run_health(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg);
static int run_register(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg);
static int run_scan(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg);
static int run_compile(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg);
static int run_json(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg);

static const struct command {
	const char *name;
	const char *arg; /* the one positional argument it needs ("a NAME"), or NULL */
	command_fn run;
	const char *usage;
} COMMANDS[] = {
    {"health", NULL, run_health,
     "health [--live]\n  exit 0 only when the daemon is ready (--live: when it answers)"},
    {"register", "a NAME", run_register,
     "register NAME --body FILE.py [--entry FN] [--max-steps N] [--max-elements N]\n"
     "         [--budget N] [--strategy unroll|scan|chunk] [--dynamic none|batch]\n"
     "  register or replace an adapter (admin)"},
    {"unregister", "a NAME", run_json, "unregister NAME\n  drop an adapter and its graphs (admin)"},
    {"list", NULL, run_json, "list\n  adapters with bounds and budget use"},
    {"describe", "a NAME", run_json, "describe NAME\n  one adapter: bounds, graphs, counters"},
    {"scan", "an ADAPTER", run_scan,
     "scan ADAPTER --carry TREE --inputs TREE --out DIR\n"
     "  run a scan; DIR gets one .npy per leaf and tree.json"},
    {"grad", "an ADAPTER", run_scan,
     "grad ADAPTER --carry TREE --inputs TREE [--cot-carry TREE] [--cot-outputs TREE]\n"
     "         [--checkpoint] --out DIR\n"
     "  scan plus the vector-Jacobian product (None or absent cotangents are zero);\n"
     "  --checkpoint: keep each step's carry only and recompute the step backward"},
    {"compile", "an ADAPTER", run_compile,
     "compile ADAPTER --carry TREE --inputs TREE [--dtype float32|float64]\n"
     "         [--grad [--checkpoint]]\n"
     "  warm a specialization; leaves may be .npy files or shape:AxB strings"},
    {"stats", NULL, run_json, "stats [--prometheus]\n  counters per adapter"},
    {"shutdown", NULL, run_json, "shutdown\n  stop the daemon after in-flight requests (admin)"},
};

#define N_COMMANDS (sizeof COMMANDS / sizeof COMMANDS[0])

static const struct command *find_command(const char *name)
{
	for (size_t i = 0; i < N_COMMANDS; i++)
		if (strcmp(name, COMMANDS[i].name) == 0)
			return &COMMANDS[i];
	return NULL;
}

static void print_help(FILE *f, const char *cmd)
{
	for (size_t i = 0; i < N_COMMANDS; i++) {
		if (cmd && strcmp(cmd, COMMANDS[i].name) != 0)
			continue;
		fprintf(f, "%storchloop [--socket PATH] [--json] %s\n", cmd ? "usage: " : "  ",
		        COMMANDS[i].usage);
	}
	if (!cmd)
		fprintf(f, "\nTREE: a .npy path, null, or JSON: [..] list, {..} dict, "
		           "{\"__tuple__\": [..]} tuple.\n"
		           "--socket defaults to $TORCHLOOP_SOCKET, then "
		           "$XDG_RUNTIME_DIR/torchloopd/torchloopd.sock.\n"
		           "exit codes: 0 ok, 1 daemon error, 2 usage error, 3 cannot connect.\n");
}

static int daemon_error(const struct cli *c, const struct tl_error *err)
{
	if (strcmp(err->code, "CONNECT") == 0) {
		fprintf(stderr, "torchloop: %s\n", err->message);
		return EXIT_CONNECT;
	}
	if (c->json) {
		json_t *j = json_pack("{s:{s:s,s:s,s:s}}", "error", "code", err->code, "message",
		                      err->message, "path", err->path);
		char *s = json_dumps(j, JSON_COMPACT);
		printf("%s\n", s);
		free(s);
		json_decref(j);
	}
	fprintf(stderr, "torchloop: %s: %s\n", err->code, err->message);
	return strcmp(err->code, "IO") == 0 ? EXIT_CONNECT : EXIT_DAEMON;
}

static void on_progress(const char *event, const char *adapter, const char *sig, double s, void *u)
{
	(void)u;
	fprintf(stderr, "\r%s %s %s %.0f s  ", event, adapter, sig, s);
	fflush(stderr);
}

static int connect_client(struct cli *c)
{
	struct tl_error err;

	if (tl_connect(c->socket, 5000, &c->client, &err) != 0)
		return daemon_error(c, &err);
	if (isatty(2))
		tl_set_progress(c->client, on_progress, NULL);
	return EXIT_OK;
}

/* A tree argument: JSON, or a bare .npy path / shape string. */
static int parse_tree(struct cli *c, const char *opt, const char *arg, bool shapes_only,
                      struct tl_tree **out)
{
	char msg[1024] = "";

	c->tj.shapes_only = shapes_only;
	*out = treejson_parse(&c->tj, arg, msg, sizeof msg);
	if (*out == NULL)
		return usage_error("%s: %s", opt, msg[0] ? msg : "bad tree");
	return EXIT_OK;
}

static int write_outputs(struct cli *c, const struct tl_reply *r, const char *dir)
{
	static const char *const keys[] = {"carry", "outputs", "grad_carry", "grad_inputs"};
	json_t *doc = json_object();
	char path[4096];
	int rc = EXIT_OK;

	if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
		json_decref(doc);
		return usage_error("--out %s: %s", dir, strerror(errno));
	}
	for (size_t i = 0; i < 4 && rc == EXIT_OK; i++) {
		const struct tl_tree *t = tl_reply_tree(r, keys[i]);
		char msg[512];
		json_t *j = t ? treejson_save(t, dir, keys[i], msg, sizeof msg) : NULL;
		if (t && j == NULL)
			rc = usage_error("%s", msg);
		else if (j)
			json_object_set_new(doc, keys[i], j);
	}
	snprintf(path, sizeof path, "%s/tree.json", dir);
	if (json_dump_file(doc, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0)
		rc = usage_error("cannot write %s", path);
	if (c->json && rc == EXIT_OK) {
		char *s = json_dumps(doc, JSON_COMPACT | JSON_PRESERVE_ORDER);
		printf("%s\n", s);
		free(s);
	}
	json_decref(doc);
	return rc;
}

/* ---- subcommands ------------------------------------------------------------------ */

struct sub_opts {
	const char *carry, *inputs, *cot_carry, *cot_outputs, *out, *body, *entry, *strategy,
	    *dynamic;
	int64_t max_steps, max_elements, budget;
	bool live, prometheus, grad, checkpoint;
	const char *dtype;
};

static int parse_int_opt(const char *name, const char *v, int64_t *out)
{
	char *end;

	errno = 0;
	*out = strtoll(v, &end, 10);
	if (errno || *end || end == v)
		return usage_error("--%s takes an integer, got '%s'", name, v);
	return EXIT_OK;
}

/* The subcommands' options: one row each, what it sets in struct sub_opts. */
enum sub_opt_kind { OPT_STR, OPT_INT, OPT_FLAG };
#define SUB_OPT(name, kind, field)                                                                 \
	{                                                                                          \
		name, kind, offsetof(struct sub_opts, field)                                       \
	}
static const struct sub_opt {
	const char *name;
	enum sub_opt_kind kind;
	size_t off;
} sub_opt_table[] = {
    SUB_OPT("carry", OPT_STR, carry),
    SUB_OPT("inputs", OPT_STR, inputs),
    SUB_OPT("cot-carry", OPT_STR, cot_carry),
    SUB_OPT("cot-outputs", OPT_STR, cot_outputs),
    SUB_OPT("out", OPT_STR, out),
    SUB_OPT("body", OPT_STR, body),
    SUB_OPT("entry", OPT_STR, entry),
    SUB_OPT("strategy", OPT_STR, strategy),
    SUB_OPT("dynamic", OPT_STR, dynamic),
    SUB_OPT("dtype", OPT_STR, dtype),
    SUB_OPT("max-steps", OPT_INT, max_steps),
    SUB_OPT("max-elements", OPT_INT, max_elements),
    SUB_OPT("budget", OPT_INT, budget),
    SUB_OPT("live", OPT_FLAG, live),
    SUB_OPT("prometheus", OPT_FLAG, prometheus),
    SUB_OPT("grad", OPT_FLAG, grad),
    SUB_OPT("checkpoint", OPT_FLAG, checkpoint),
};
#define N_SUB_OPTS (sizeof sub_opt_table / sizeof sub_opt_table[0])
#define OPT_FIRST  256 /* getopt_long values: 256 + row (past any character) */
#define OPT_HELP   (OPT_FIRST + (int)N_SUB_OPTS)

static int set_sub_opt(struct sub_opts *o, const struct sub_opt *t, const char *arg)
{
	char *field = (char *)o + t->off;

	if (t->kind == OPT_STR)
		memcpy(field, &arg, sizeof arg);
	else if (t->kind == OPT_FLAG)
		*(bool *)(void *)field = true;
	else
		return parse_int_opt(t->name, arg, (int64_t *)(void *)field);
	return EXIT_OK;
}

static int parse_sub(int argc, char **argv, struct sub_opts *o, const char *cmd)
{
	struct option opts[N_SUB_OPTS + 2];
	int opt, rc = EXIT_OK;

	for (size_t i = 0; i < N_SUB_OPTS; i++)
		opts[i] = (struct option){sub_opt_table[i].name,
		                          sub_opt_table[i].kind == OPT_FLAG ? no_argument
		                                                            : required_argument,
		                          NULL, OPT_FIRST + (int)i};
	opts[N_SUB_OPTS] = (struct option){"help", no_argument, NULL, OPT_HELP};
	opts[N_SUB_OPTS + 1] = (struct option){0, 0, 0, 0};
	optind = 1;
	opterr = 0;
	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1 && rc == EXIT_OK) {
		if (opt == OPT_HELP) {
			print_help(stdout, cmd);
			return -1;
		}
		if (opt < OPT_FIRST || opt >= OPT_HELP)
			return usage_error("%s: unknown option '%s'", cmd, argv[optind - 1]);
		rc = set_sub_opt(o, &sub_opt_table[opt - OPT_FIRST], optarg);
	}
	return rc;
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "r");
	char *buf = NULL;
	long n;

	if (f == NULL)
		return NULL;
	if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && n <= PROTO_MAX_SOURCE &&
	    fseek(f, 0, SEEK_SET) == 0) {
		buf = calloc(1, (size_t)n + 1);
		if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
			free(buf);
			buf = NULL;
		}
	}
	fclose(f);
	return buf;
}

static int cmd_health(struct cli *c, const struct sub_opts *o)
{
	struct tl_error err;
	int ready = 0, rc = connect_client(c);

	if (rc != EXIT_OK)
		return rc;
	if (tl_health(c->client, &ready, &err) != 0)
		return daemon_error(c, &err);
	if (c->json)
		printf("{\"live\":true,\"ready\":%s}\n", ready ? "true" : "false");
	else
		printf("%s\n", ready ? "ready" : o->live ? "live (not ready)" : "not ready");
	return o->live || ready ? EXIT_OK : EXIT_DAEMON;
}

static int cmd_register(struct cli *c, const struct sub_opts *o, const char *name)
{
	struct tl_adapter_def def = {0};
	struct tl_error err;
	char *src;
	int rc;

	if (o->body == NULL)
		return usage_error("register: --body FILE.py is required");
	src = slurp(o->body);
	if (src == NULL)
		return usage_error("register: cannot read %s: %s", o->body, strerror(errno));
	def = (struct tl_adapter_def){name,        src,          o->body,         o->entry,
	                              o->strategy, o->max_steps, o->max_elements, o->budget,
	                              o->dynamic};
	rc = connect_client(c);
	if (rc == EXIT_OK && tl_register(c->client, &def, &err) != 0)
		rc = daemon_error(c, &err);
	else if (rc == EXIT_OK)
		printf(c->json ? "{\"registered\":\"%s\"}\n" : "registered %s\n", name);
	free(src);
	return rc;
}

static int cmd_run(struct cli *c, const struct sub_opts *o, const char *adapter, bool grad)
{
	struct tl_tree *carry, *inputs, *cc = NULL, *co = NULL;
	struct tl_reply *r;
	struct tl_error err;
	int rc;

	if (!o->carry || !o->inputs || !o->out)
		return usage_error("%s: --carry, --inputs and --out are required",
		                   grad ? "grad" : "scan");
	if (o->checkpoint && !grad)
		return usage_error("scan: --checkpoint is grad's");
	if ((rc = parse_tree(c, "--carry", o->carry, false, &carry)) ||
	    (rc = parse_tree(c, "--inputs", o->inputs, false, &inputs)) ||
	    (grad && o->cot_carry &&
	     (rc = parse_tree(c, "--cot-carry", o->cot_carry, false, &cc))) ||
	    (grad && o->cot_outputs &&
	     (rc = parse_tree(c, "--cot-outputs", o->cot_outputs, false, &co))) ||
	    (rc = connect_client(c)))
		return rc;
	rc = !grad ? tl_scan(c->client, adapter, carry, inputs, &r, &err)
	     : o->checkpoint
	         ? tl_grad_checkpoint(c->client, adapter, carry, inputs, cc, co, &r, &err)
	         : tl_grad(c->client, adapter, carry, inputs, cc, co, &r, &err);
	if (isatty(2))
		fprintf(stderr, "\r\033[K");
	if (rc != 0)
		return daemon_error(c, &err);
	rc = write_outputs(c, r, o->out);
	tl_reply_free(r);
	return rc;
}

static int cmd_compile(struct cli *c, const struct sub_opts *o, const char *adapter)
{
	struct tl_tree *carry, *inputs;
	struct tl_reply *r;
	struct tl_error err;
	int rc;

	if (!o->carry || !o->inputs)
		return usage_error("compile: --carry and --inputs are required");
	if (o->dtype && strcmp(o->dtype, "float32") && strcmp(o->dtype, "float64"))
		return usage_error("compile: --dtype is float32 or float64");
	if (o->checkpoint && !o->grad)
		return usage_error("compile: --checkpoint needs --grad");
	c->tj.dtype = o->dtype && strcmp(o->dtype, "float32") == 0 ? TL_FLOAT32 : TL_FLOAT64;
	c->tj.have_dtype = o->dtype != NULL;
	if ((rc = parse_tree(c, "--carry", o->carry, true, &carry)) ||
	    (rc = parse_tree(c, "--inputs", o->inputs, true, &inputs)) || (rc = connect_client(c)))
		return rc;
	if (tl_compile(c->client, adapter, carry, inputs,
	               c->tj.have_dtype ? c->tj.dtype : TL_FLOAT64,
	               !o->grad        ? TL_GRAPH_SCAN
	               : o->checkpoint ? TL_GRAPH_GRAD_CHECKPOINT
	                               : TL_GRAPH_GRAD,
	               &r, &err) != 0)
		return daemon_error(c, &err);
	if (isatty(2))
		fprintf(stderr, "\r\033[K");
	printf(c->json ? "{\"ready\":true,\"from_cache\":%s,\"compile_seconds\":%.3f}\n"
	               : "ready (%s, %.1f s compile)\n",
	       tl_reply_number(r, "from_cache") == 1 ? (c->json ? "true" : "from cache")
	                                             : (c->json ? "false" : "compiled"),
	       tl_reply_number(r, "compile_seconds"));
	tl_reply_free(r);
	return EXIT_OK;
}

static int cmd_json(struct cli *c, const struct sub_opts *o, const char *op, const char *name)
{
	struct tl_error err;
	char *text;
	json_t *j;
	int rc = connect_client(c);

	if (rc != EXIT_OK)
		return rc;
	if (tl_call_json(c->client, op, name, &text, &err) != 0)
		return daemon_error(c, &err);
	j = json_loads(text, JSON_PRESERVE_ORDER, NULL);
	if (strcmp(op, "stats") == 0 && o->prometheus && j)
		cli_print_prometheus(j);
	else if (strcmp(op, "stats") == 0 && !c->json && j)
		cli_print_stats_table(j);
	else if (c->json || j == NULL)
		printf("%s\n", text);
	else {
		char *pretty = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
		printf("%s\n", pretty);
		free(pretty);
	}
	json_decref(j);
	free(text);
	return EXIT_OK;
}

static int run_health(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg)
{
	(void)cmd;
	(void)arg;
	return cmd_health(c, o);
}

static int run_register(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg)
{
	(void)cmd;
	return cmd_register(c, o, arg);
}

static int run_scan(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg)
{
	return cmd_run(c, o, arg, strcmp(cmd, "grad") == 0);
}

static int run_compile(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg)
{
	(void)cmd;
	return cmd_compile(c, o, arg);
}

static int run_json(struct cli *c, const struct sub_opts *o, const char *cmd, const char *arg)
{
	return cmd_json(c, o, cmd, arg);
}

static int dispatch(struct cli *c, const char *cmd, int argc, char **argv)
{
	const struct command *command = find_command(cmd);
	struct sub_opts o = {0};
	const char *arg;
	int rc;

	if (command == NULL)
		return usage_error("unknown command '%s'", cmd);
	rc = parse_sub(argc, argv, &o, cmd);
	if (rc < 0)
		return EXIT_OK; /* --help */
	if (rc != EXIT_OK)
		return rc;
	arg = optind < argc ? argv[optind] : NULL;
	if (command->arg && arg == NULL)
		return usage_error("%s needs %s", cmd, command->arg);
	if (optind + (command->arg ? 1 : 0) < argc)
		return usage_error("%s: unexpected argument '%s'", cmd,
		                   argv[optind + (command->arg ? 1 : 0)]);
	return command->run(c, &o, cmd, arg);
}

int main(int argc, char **argv)
{
	static struct cli c;
	int i = 1, rc;

	while (i < argc && argv[i][0] == '-') {
		if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
			c.socket = argv[i + 1];
			i += 2;
		} else if (strncmp(argv[i], "--socket=", 9) == 0) {
			c.socket = argv[i++] + 9;
		} else if (strcmp(argv[i], "--json") == 0) {
			c.json = true;
			i++;
		} else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
			printf("usage: torchloop [--socket PATH] [--json] COMMAND [options]\n\n");
			print_help(stdout, NULL);
			return EXIT_OK;
		} else {
			return usage_error("unknown option '%s'", argv[i]);
		}
	}
	if (i >= argc)
		return usage_error("no command given");
	c.builder = tl_builder_new();
	treejson_init(&c.tj, c.builder, NULL);
	rc = dispatch(&c, argv[i], argc - i, argv + i);
	tl_close(c.client);
	treejson_free(&c.tj);
	tl_builder_free(c.builder);
	return rc;
}
