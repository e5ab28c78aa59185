/*
 * test_sandbox.c - the compile worker's sandbox (daemon/base/sandbox.h): a
 * worker, through its test-only hook (TORCHLOOP_TEST_SANDBOX_PROBE,
 * torchloop_worker/sandbox_probe.py), tries each act its sandbox forbids --
 * writing the cache, the load links, the state directory and $HOME;
 * reading or listing the cache's entries, a state file, a file in $HOME,
 * one in /tmp and /etc/shadow; replacing a cache entry; connecting to the
 * daemon's socket, to a unix socket and a TCP port of the test's;
 * signalling, tracing and writing the daemon -- and each fails with its
 * errno while its scratch is writable; a real compile then works inside it
 * and the daemon serves the next request.  A kernel without Landlock (ABI 6
 * for signal scoping) skips, loudly.
 */
#include "fixture.h"
#include "harness.h"
#include "sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

TestSuite(sandbox, .timeout = 600);

/* A listening socket (non-blocking), on path or (path NULL) 127.0.0.1:*port. */
static int listener(const char *path, int *port)
{
	struct sockaddr_un un = {.sun_family = AF_UNIX};
	struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof in;
	int fd = socket(path ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);

	cr_assert_geq(fd, 0);
	if (path) {
		snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
		cr_assert_eq(bind(fd, (struct sockaddr *)&un, sizeof un), 0, "%s", strerror(errno));
	} else {
		cr_assert_eq(bind(fd, (struct sockaddr *)&in, sizeof in), 0, "%s", strerror(errno));
		cr_assert_eq(getsockname(fd, (struct sockaddr *)&in, &len), 0);
		*port = ntohs(in.sin_port);
	}
	cr_assert_eq(listen(fd, 8), 0);
	return fd;
}

/* Nobody connected to fd (it is closed). */
static void assert_no_connection(int fd, const char *what)
{
	int c = accept(fd, NULL, NULL);

	cr_assert(c < 0 && errno == EAGAIN, "the worker reached the %s", what);
	close(fd);
}

/* name's outcome in the worker's probe line: "name=ERRNO" (or OK). */
static void assert_outcome(const char *line, const char *name, const char *want)
{
	char key[64], got[32] = "";
	const char *at;

	snprintf(key, sizeof key, " %s=", name);
	at = strstr(line, key);
	cr_assert_not_null(at, "no outcome for %s in: %s", name, line);
	sscanf(at + strlen(key), "%31[A-Z]", got);
	cr_assert_str_eq(got, want, "%s: %s, not %s (probe line: %s)", name, got, want, line);
}

/* The probe's line from the daemon's log (a copy; free it). */
static char *probe_line(const char *log)
{
	char *text = h_slurp(log), *at = strstr(text, "sandbox probe:"), *end;

	cr_assert_not_null(at, "the worker's probe line is not in %s", log);
	end = strchr(at, '\n');
	if (end)
		*end = '\0';
	at = strdup(at - 1); /* from the space before it, for " name=" */
	free(text);
	return at;
}

/* The w.<pid>.<n> scratch directories left in cache/tmp. */
static int scratches(const char *cache)
{
	char tmp[600];
	DIR *d;
	struct dirent *e;
	int n = 0;

	snprintf(tmp, sizeof tmp, "%s/tmp", cache);
	d = opendir(tmp);
	cr_assert_not_null(d);
	while ((e = readdir(d)) != NULL)
		n += strncmp(e->d_name, "w.", 2) == 0;
	closedir(d);
	return n;
}

struct targets {
	char dir[256], cache[320], state[320], sock[320], home[600], entry[600], unix_path[320];
	char home_file[600], state_file[400], tmp_file[64];
	int unix_fd, tcp_fd, tcp_port;
};

/* The test's listeners, a private cache with one planted entry, and the JSON
 * of everything the worker will try (in the environment the daemon passes on). */
static void plant(struct targets *t)
{
	char json[8192], path[700];
	int fd;

	h_tmpdir(t->dir, sizeof t->dir, "sbx");
	snprintf(t->cache, sizeof t->cache, "%s/cache", t->dir);
	snprintf(t->state, sizeof t->state, "%s/state", t->dir);
	snprintf(t->unix_path, sizeof t->unix_path, "%s/l.sock", t->dir);
	snprintf(t->sock, sizeof t->sock, "%s/sock", t->dir);
	snprintf(t->home, sizeof t->home, "%s/.torchloop-sandbox-probe.%d", getenv("HOME"),
	         (int)getpid());
	cr_assert_eq(mkdir(t->cache, 0700), 0);
	cr_assert_eq(mkdir(t->state, 0700), 0);
	snprintf(path, sizeof path, "%s/objects", t->cache);
	cr_assert_eq(mkdir(path, 0700), 0);
	snprintf(t->entry, sizeof t->entry, "%s/objects/%064d.so", t->cache, 0);
	h_write_file(t->entry, "the daemon's entry");
	/* files the daemon's uid can read that no worker may */
	snprintf(t->state_file, sizeof t->state_file, "%s/planted.adapter", t->state);
	h_write_file(t->state_file, "another user's registration");
	snprintf(t->home_file, sizeof t->home_file, "%s.read", t->home);
	h_write_file(t->home_file, "the daemon's home");
	snprintf(t->tmp_file, sizeof t->tmp_file, "/tmp/torchloop-sandbox-read.XXXXXX");
	fd = mkstemp(t->tmp_file);
	cr_assert_geq(fd, 0);
	close(fd);
	t->unix_fd = listener(t->unix_path, NULL);
	t->tcp_fd = listener(NULL, &t->tcp_port);
	snprintf(json, sizeof json,
	         "{\"files\": {\"objects\": \"%s/objects/planted.so\", \"index\": \"%s/index/x\", "
	         "\"loadlinks\": \"%s/tmp/planted.so\", \"state\": \"%s/x.adapter\", "
	         "\"home\": \"%s\"}, \"read\": {\"entry\": \"%s\", \"objects\": \"%s/objects\", "
	         "\"state\": \"%s\", \"home\": \"%s\", \"tmp\": \"%s\", \"shadow\": "
	         "\"/etc/shadow\"}, \"replace\": \"%s\", \"unix\": {\"daemon_socket\": \"%s\", "
	         "\"test_socket\": \"%s\"}, \"tcp\": %d}",
	         t->cache, t->cache, t->cache, t->state, t->home, t->entry, t->cache, t->state_file,
	         t->home_file, t->tmp_file, t->entry, t->sock, t->unix_path, t->tcp_port);
	setenv("TORCHLOOP_TEST_SANDBOX_PROBE", json, 1);
}

/*
 * Every forbidden act fails with its errno (EACCES from Landlock for files,
 * the rename over an entry and the daemon's memory; EPERM from seccomp for
 * sockets and ptrace, from Landlock's scope for the signal), the scratch is writable, the listeners
 * saw nobody, the planted entry is unchanged; then a compile inside the sandbox serves a right
 * scan, the next request too, and the scratch goes with the worker.
 */
Test(sandbox, a_worker_can_write_its_scratch_and_nothing_the_daemon_trusts)
{
	struct fixture f = {0};
	struct targets t;
	char *line, *entry;
	int abi = sandbox_landlock_abi();
	json_t *health;

	if (abi < 6)
		cr_skip_test("THE SANDBOX IS NOT TESTED HERE: this kernel's Landlock ABI is %d (6 "
		             "needed for signal scoping; 0: none)",
		             abi);
	plant(&t);
	{
		const char *const args[] = {"--no-probe",  "--socket", t.sock,
		                            "--state-dir", t.state,    "--worker-sandbox",
		                            "required",    NULL};
		hd_start(&f.d, t.cache, args);
	}
	unsetenv("TORCHLOOP_TEST_SANDBOX_PROBE");
	snprintf(f.d.sock, sizeof f.d.sock, "%s", t.sock);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	health = h_call_json(f.c, "health", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(health, "sandbox")), SANDBOX_ON);
	json_decref(health);
	hd_register(f.c, "t4.cumsum", CUMSUM, "body", 12, 64, 3);
	fixture_trees(&f);
	scan_ok(&f, f.c); /* compiled inside the sandbox (a private cache) */
	scan_ok(&f, f.c); /* and the daemon serves the next request */
	line = probe_line(f.d.log);
	for (const char *const *n =
	         (const char *const[]){"objects", "index", "loadlinks", "state", "home", "replace",
	                               "overwrite", "mem", "read_entry", "read_objects",
	                               "read_state", "read_home", "read_tmp", "read_shadow", NULL};
	     *n; n++)
		assert_outcome(line, *n, "EACCES");
	for (const char *const *n = (const char *const[]){"daemon_socket", "test_socket", "tcp",
	                                                  "kill", "ptrace", NULL};
	     *n; n++)
		assert_outcome(line, *n, "EPERM");
	assert_outcome(line, "scratch", "OK");
	free(line);
	assert_no_connection(t.unix_fd, "test's unix socket");
	assert_no_connection(t.tcp_fd, "test's TCP port");
	cr_assert_eq(access(t.home, F_OK), -1, "a file appeared in $HOME");
	unlink(t.home_file);
	unlink(t.tmp_file);
	entry = h_slurp(t.entry);
	cr_assert_str_eq(entry, "the daemon's entry");
	free(entry);
	cr_assert_eq(scratches(t.cache), 1, "one worker, one scratch directory");
	teardown(&f);
	cr_assert_eq(scratches(t.cache), 0, "the scratch went with its worker");
}

/* --worker-sandbox off: the workers run unconfined, and health says so. */
Test(sandbox, off_is_reported_by_health)
{
	struct fixture f = {0};
	const char *const args[] = {"--no-probe", "--worker-sandbox", "off", NULL};
	json_t *health;

	hd_start(&f.d, NULL, args);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	health = h_call_json(f.c, "health", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(health, "sandbox")),
	                 "off (--worker-sandbox off)");
	json_decref(health);
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
}

/* A mode that is not one of the three is a usage error (exit 1 or 2, no start). */
Test(sandbox, an_unknown_mode_is_refused_at_start)
{
	char bin[600], dir[256], log[300], *text;
	const char *argv[] = {bin, "--worker-sandbox", "sometimes", NULL};

	h_tmpdir(dir, sizeof dir, "sbm");
	snprintf(log, sizeof log, "%s/log", dir);
	snprintf(bin, sizeof bin, "%s/%s/torchloopd", h_root(), h_build());
	cr_assert_neq(h_run(argv, log), 0, "torchloopd accepted --worker-sandbox sometimes");
	text = h_slurp(log);
	cr_assert_not_null(strstr(text, "--worker-sandbox: auto, required or off"), "%s", text);
	free(text);
}
