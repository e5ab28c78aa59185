/*
 * config.c - defaults, flags and --help.  Runs once at start-up on the main
 * thread.  Paths default from the XDG variables (systemd sets
 * RUNTIME_DIRECTORY and CACHE_DIRECTORY for the service).
 */
#include "config.h"

#include "protocol.h"

#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

enum {
	OPT_SOCKET = 1000,
	OPT_CACHE,
	OPT_ADAPTERS,
	OPT_STATE,
	OPT_PYTHON,
	OPT_WORKER,
	OPT_ADMIN,
	OPT_NO_PROBE,
	OPT_MODE,
	OPT_LOG,
	OPT_ISA,
	OPT_SANDBOX,
	OPT_REMOTE,
	OPT_REMOTE_SECRET,
	OPT_REMOTE_AUTH,
	OPT_HELP,
	OPT_VERSION,
	OPT_LIMIT0
};

static const struct limit {
	const char *name;
	long long min, def, max;
	const char *help;
} LIMITS[] = {
#define CONFIG_X_LIMIT(name, field, min, def, max, help) {name, min, def, max, help},
    CONFIG_LIMITS(CONFIG_X_LIMIT)
#undef CONFIG_X_LIMIT
};
#define N_LIMITS (sizeof LIMITS / sizeof LIMITS[0])

static long long *limit_field(struct config *c, size_t i)
{
	long long *fields[] = {
#define CONFIG_X_PTR(name, field, min, def, max, help) &c->field,
	    CONFIG_LIMITS(CONFIG_X_PTR)
#undef CONFIG_X_PTR
	};
	return fields[i];
}

static void usage(FILE *f)
{
	fprintf(
	    f,
	    "usage: torchloopd [options]\n\n"
	    "Serves compiled scans (PyTorch Inductor, AOT) to local clients over a Unix socket.\n\n"
	    "  --socket PATH        listening socket (default "
	    "$XDG_RUNTIME_DIR/torchloopd/torchloopd.sock;\n"
	    "                       under systemd $RUNTIME_DIRECTORY/torchloopd.sock)\n"
	    "  --socket-mode OCTAL  socket file mode (default 0660)\n"
	    "  --cache-dir DIR      compiled artifacts (default $XDG_CACHE_HOME/torchloopd;\n"
	    "                       under systemd $CACHE_DIRECTORY); must allow exec\n"
	    "  --adapters DIR       adapter definitions (*.adapter) registered at start and on "
	    "SIGHUP\n"
	    "  --state-dir DIR      keep what `register` adds there and restore it at start\n"
	    "                       (default: under systemd $STATE_DIRECTORY, else none)\n"
	    "  --python PATH        the compile worker's interpreter (default: the build's .venv)\n"
	    "  --worker PATH        the compile worker script\n"
	    "  --admin-group NAME   members may register, unregister and shut down\n"
	    "  --no-probe           skip the start-up probe compile\n"
	    "  --log-level LEVEL    debug, info, warn or error (default info)\n"
	    "  --target-isa ISA     what graphs are compiled for: native (default: this CPU),\n"
	    "                       avx2 (x86-64 with AVX2) or baseline (any x86-64; also what\n"
	    "                       valgrind can run); part of every cache key\n"
	    "  --worker-sandbox MODE  auto (default: compile workers run confined by Landlock\n"
	    "                       and seccomp where the kernel has Landlock, else unconfined,\n"
	    "                       said loudly), required (refuse to start without it) or off\n"
	    "  --remote-cache URL   a second cache tier shared by many nodes: "
	    "redis://HOST[:PORT][/DB]\n"
	    "                       or unix:///PATH[?db=N] (default: none)\n"
	    "  --remote-secret-file PATH  the shared HMAC secret (default: the systemd credential\n"
	    "                       remote-secret); without it the remote tier is off\n"
	    "  --remote-auth-file PATH    Redis AUTH password (default: the credential "
	    "remote-auth)\n"
	    "  --help, --version\n\nlimits (name: min / default / max):\n");
	for (size_t i = 0; i < N_LIMITS; i++)
		fprintf(f, "  --%-17s %s (%lld / %lld / %lld)\n", LIMITS[i].name, LIMITS[i].help,
		        LIMITS[i].min, LIMITS[i].def, LIMITS[i].max);
}

/* A systemd credential (LoadCredential=NAME:PATH in the unit), if it exists. */
static void credential(char *dst, size_t size, const char *name)
{
	const char *dir = getenv("CREDENTIALS_DIRECTORY");
	char path[PATH_MAX];

	if (dir && *dir && (size_t)snprintf(path, sizeof path, "%s/%s", dir, name) < size &&
	    access(path, R_OK) == 0)
		snprintf(dst, size, "%s", path);
}

static void default_paths(struct config *c)
{
	const char *rt = getenv("RUNTIME_DIRECTORY"), *cache = getenv("CACHE_DIRECTORY");
	const char *state = getenv("STATE_DIRECTORY");
	const char *xrt = getenv("XDG_RUNTIME_DIR"), *xc = getenv("XDG_CACHE_HOME");
	const char *home = getenv("HOME");

	if (rt && *rt)
		snprintf(c->socket_path, sizeof c->socket_path, "%s/torchloopd.sock", rt);
	else if (xrt && *xrt)
		snprintf(c->socket_path, sizeof c->socket_path, "%s/torchloopd/torchloopd.sock",
		         xrt);
	else
		snprintf(c->socket_path, sizeof c->socket_path,
		         "/tmp/torchloopd-%u/torchloopd.sock", (unsigned)getuid());
	if (cache && *cache)
		snprintf(c->cache_dir, sizeof c->cache_dir, "%s", cache);
	else if (xc && *xc)
		snprintf(c->cache_dir, sizeof c->cache_dir, "%s/torchloopd", xc);
	else
		snprintf(c->cache_dir, sizeof c->cache_dir, "%s/.cache/torchloopd",
		         home ? home : "/tmp");
	if (state && *state && strlen(state) < sizeof c->state_dir)
		snprintf(c->state_dir, sizeof c->state_dir, "%s", state);
	snprintf(c->python, sizeof c->python, "%s", TORCHLOOPD_PREFIX "/.venv/bin/python");
	snprintf(c->worker, sizeof c->worker, "%s", CONFIG_WORKER_DIR "/compile_worker.py");
	credential(c->remote_secret_file, sizeof c->remote_secret_file, "remote-secret");
	credential(c->remote_auth_file, sizeof c->remote_auth_file, "remote-auth");
}

static int parse_limit(struct config *c, size_t i, const char *arg)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(arg, &end, 10);
	if (errno || *end || end == arg || v < LIMITS[i].min || v > LIMITS[i].max) {
		fprintf(stderr, "torchloopd: --%s must be an integer in [%lld, %lld], got '%s'\n",
		        LIMITS[i].name, LIMITS[i].min, LIMITS[i].max, arg);
		return -1;
	}
	*limit_field(c, i) = v;
	return 0;
}

static int set_path(char *dst, size_t size, const char *arg, const char *flag)
{
	if (strlen(arg) >= size) {
		fprintf(stderr, "torchloopd: %s path too long\n", flag);
		return -1;
	}
	snprintf(dst, size, "%s", arg);
	return 0;
}

/* Directories the compile worker also uses are made absolute: the worker and
 * Inductor's compiler run in other working directories. */
static int set_dir(char *dst, size_t size, const char *arg, const char *flag)
{
	char cwd[PATH_MAX];

	if (arg[0] == '/' || arg[0] == '\0')
		return set_path(dst, size, arg, flag);
	if (getcwd(cwd, sizeof cwd) == NULL || strlen(cwd) + 1 + strlen(arg) >= size) {
		fprintf(stderr, "torchloopd: %s path too long\n", flag);
		return -1;
	}
	memcpy(dst, cwd, strlen(cwd));
	dst[strlen(cwd)] = '/';
	memcpy(dst + strlen(cwd) + 1, arg, strlen(arg) + 1);
	return 0;
}

/* The options that take a path: the field it fills, and whether it is a
 * directory the worker also uses (made absolute). */
#define PATH_OPT(opt, field, flag, dir)                                                            \
	{                                                                                          \
		opt, flag, offsetof(struct config, field), sizeof(((struct config *)0)->field),    \
		    dir                                                                            \
	}
#define DIR_OPT(opt, field, flag)  PATH_OPT(opt, field, flag, true)
#define FILE_OPT(opt, field, flag) PATH_OPT(opt, field, flag, false)
static const struct path_opt {
	int opt;
	const char *flag;
	size_t off, size;
	bool dir;
} PATH_OPTS[] = {
    DIR_OPT(OPT_CACHE, cache_dir, "--cache-dir"),
    DIR_OPT(OPT_ADAPTERS, adapters_dir, "--adapters"),
    DIR_OPT(OPT_STATE, state_dir, "--state-dir"),
    FILE_OPT(OPT_SOCKET, socket_path, "--socket"),
    FILE_OPT(OPT_PYTHON, python, "--python"),
    FILE_OPT(OPT_WORKER, worker, "--worker"),
    FILE_OPT(OPT_REMOTE, remote_url, "--remote-cache"),
    FILE_OPT(OPT_REMOTE_SECRET, remote_secret_file, "--remote-secret-file"),
    FILE_OPT(OPT_REMOTE_AUTH, remote_auth_file, "--remote-auth-file"),
};
#define N_PATH_OPTS (sizeof PATH_OPTS / sizeof PATH_OPTS[0])

/* The other options (the limits are LIMITS'). */
static const struct option OTHER_OPTS[] = {
    {"socket-mode", required_argument, NULL, OPT_MODE},
    {"admin-group", required_argument, NULL, OPT_ADMIN},
    {"log-level", required_argument, NULL, OPT_LOG},
    {"target-isa", required_argument, NULL, OPT_ISA},
    {"worker-sandbox", required_argument, NULL, OPT_SANDBOX},
    {"no-probe", no_argument, NULL, OPT_NO_PROBE},
    {"help", no_argument, NULL, OPT_HELP},
    {"version", no_argument, NULL, OPT_VERSION},
};

static int parse_sandbox(struct config *c, const char *arg)
{
	static const char *const modes[] = {"auto", "required", "off"};

	for (int i = 0; i < 3; i++)
		if (strcmp(arg, modes[i]) == 0)
			return c->worker_sandbox = (enum sandbox_mode)i, 0;
	fprintf(stderr, "torchloopd: --worker-sandbox: auto, required or off\n");
	return -1;
}

static int parse_other(struct config *c, int opt, const char *arg)
{
	static const char *const levels[] = {"debug", "info", "warn", "error"};
	struct group *g;

	for (size_t i = 0; i < N_PATH_OPTS; i++) {
		const struct path_opt *p = &PATH_OPTS[i];

		if (p->opt == opt)
			return (p->dir ? set_dir : set_path)((char *)c + p->off, p->size, arg,
			                                     p->flag);
	}
	switch (opt) {
	case OPT_MODE:
		c->socket_mode = (unsigned)strtoul(arg, NULL, 8);
		return c->socket_mode > 0777 ? -1 : 0;
	case OPT_NO_PROBE:
		c->probe = false;
		return 0;
	case OPT_ADMIN:
		g = getgrnam(arg);
		if (g == NULL) {
			fprintf(stderr, "torchloopd: --admin-group: no group '%s'\n", arg);
			return -1;
		}
		snprintf(c->admin_group, sizeof c->admin_group, "%s", arg);
		c->admin_gid = g->gr_gid;
		c->has_admin_gid = true;
		return 0;
	case OPT_ISA:
		if (strcmp(arg, "native") == 0)
			c->target_isa = ISA_NATIVE;
		else if (strcmp(arg, "avx2") == 0)
			c->target_isa = ISA_AVX2;
		else if (strcmp(arg, "baseline") == 0)
			c->target_isa = ISA_BASELINE;
		else {
			fprintf(stderr, "torchloopd: --target-isa: native, avx2 or baseline\n");
			return -1;
		}
		return 0;
	case OPT_SANDBOX:
		return parse_sandbox(c, arg);
	case OPT_LOG:
		for (int i = 0; i < 4; i++)
			if (strcmp(arg, levels[i]) == 0)
				return c->log_level = i, 0;
		fprintf(stderr, "torchloopd: --log-level: debug, info, warn or error\n");
		return -1;
	}
	return -1;
}

/* The CPUs this process may run on (its affinity mask, which is what libgomp
 * counts its workers against), else the online count. */
static long usable_cpus(void)
{
	cpu_set_t set;
	long online = sysconf(_SC_NPROCESSORS_ONLN);

	if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
		return CPU_COUNT(&set);
	return online > 0 ? online : 1;
}

int config_parse(struct config *c, int argc, char **argv)
{
	struct option opts[N_LIMITS + N_PATH_OPTS + sizeof OTHER_OPTS / sizeof OTHER_OPTS[0] + 1];
	size_t n = 0;
	long cores;
	int opt;

	memset(c, 0, sizeof *c);
	for (size_t i = 0; i < N_LIMITS; i++) {
		*limit_field(c, i) = LIMITS[i].def;
		opts[n++] =
		    (struct option){LIMITS[i].name, required_argument, NULL, OPT_LIMIT0 + (int)i};
	}
	c->probe = true;
	c->log_level = 1;
	c->socket_mode = 0660;
	default_paths(c);
	for (size_t i = 0; i < N_PATH_OPTS; i++)
		opts[n++] = (struct option){PATH_OPTS[i].flag + 2, required_argument, NULL,
		                            PATH_OPTS[i].opt};
	for (size_t i = 0; i < sizeof OTHER_OPTS / sizeof OTHER_OPTS[0]; i++)
		opts[n++] = OTHER_OPTS[i];
	opts[n] = (struct option){0};
	optind = 1;
	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (opt == OPT_HELP)
			return usage(stdout), 1;
		if (opt == OPT_VERSION)
			return printf("torchloopd %s (protocol %d)\n", TORCHLOOP_VERSION,
			              PROTO_VERSION),
			       1;
		if (opt >= OPT_LIMIT0 && opt < OPT_LIMIT0 + (int)N_LIMITS) {
			if (parse_limit(c, (size_t)(opt - OPT_LIMIT0), optarg) != 0)
				return -1;
		} else if (opt == '?' || parse_other(c, opt, optarg) != 0) {
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "torchloopd: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	cores = usable_cpus();
	if (c->threads == 0)
		c->threads = cores;
	c->omp_threads = cores / c->threads > 1 ? (int)(cores / c->threads) : 1;
	c->cores = (int)cores;
	return 0;
}
