/*
 * test_systemd.c - service-manager integration without systemd as PID 1:
 * systemd-analyze on the units, a fake NOTIFY_SOCKET receiver (a path and an
 * abstract name) for READY / WATCHDOG / RELOADING / STOPPING, and
 * systemd-socket-activate handing the daemon its listening socket.
 */
#include "harness.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <sys/resource.h>
#include <unistd.h>

TestSuite(systemd, .timeout = 300);

static const char *const ARGS[] = {"--no-probe", NULL};

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the units ------------------------------------------------------------------- */

static void staged_units(char *dir, size_t size)
{
	char cmd[4096];

	h_tmpdir(dir, size, "units");
	snprintf(cmd, sizeof cmd,
	         "sed 's|/usr/local/bin/torchloopd|%s/%s/torchloopd|' "
	         "%s/systemd/torchloopd.service > %s/torchloopd.service && "
	         "cp %s/systemd/torchloopd.socket %s/",
	         h_root(), h_build(), h_root(), dir, h_root(), dir);
	cr_assert_eq(h_run((const char *[]){"sh", "-c", cmd, NULL}, NULL), 0);
}

Test(systemd, systemd_analyze_verify_accepts_the_units)
{
	char dir[512], svc[600], sock[600], log[600];

	staged_units(dir, sizeof dir);
	snprintf(svc, sizeof svc, "%s/torchloopd.service", dir);
	snprintf(sock, sizeof sock, "%s/torchloopd.socket", dir);
	snprintf(log, sizeof log, "%s/verify.log", dir);
	cr_assert_eq(h_run((const char *[]){"systemd-analyze", "verify", sock, svc, NULL}, log), 0,
	             "see %s", log);
}

/* The remote-cache drop-in (systemd/remote-cache.conf) loads with the unit
 * without a warning, and its ExecStart flags are ones the daemon takes
 * (parsed in full: --version comes last). */
Test(systemd, the_remote_cache_drop_in_verifies_and_its_flags_parse)
{
	char dir[512], cmd[4096], log[600], line[1024];
	FILE *f;
	int warnings = 0;

	staged_units(dir, sizeof dir);
	snprintf(cmd, sizeof cmd,
	         "mkdir -p %s/torchloopd.service.d && sed 's|/usr/local/bin/torchloopd|%s/%s/"
	         "torchloopd|' %s/systemd/remote-cache.conf > %s/torchloopd.service.d/"
	         "remote-cache.conf && SYSTEMD_UNIT_PATH=%s: systemd-analyze verify "
	         "torchloopd.service",
	         dir, h_root(), h_build(), h_root(), dir, dir);
	snprintf(log, sizeof log, "%s/verify-dropin.log", dir);
	cr_assert_eq(h_run((const char *[]){"sh", "-c", cmd, NULL}, log), 0, "see %s", log);
	f = fopen(log, "r");
	while (f && fgets(line, sizeof line, f))
		warnings += strstr(line, "remote-cache.conf") != NULL;
	if (f)
		fclose(f);
	cr_assert_eq(warnings, 0, "the drop-in has lines systemd does not take: %s", log);
	snprintf(
	    cmd, sizeof cmd,
	    "set -- $(sed -n 's|^ExecStart=/usr/local/bin/torchloopd ||p' "
	    "%s/systemd/remote-cache.conf | sed 's|--admin-group torchloop|--admin-group root|') "
	    "&& %s/%s/torchloopd \"$@\" --version",
	    h_root(), h_root(), h_build());
	cr_assert_eq(h_run((const char *[]){"sh", "-c", cmd, NULL}, log), 0,
	             "the drop-in's flags: see %s", log);
}

/* The unit's LimitNOFILE admits the default --max-connections: the daemon,
 * started under exactly that limit, becomes ready (it refuses to start when
 * the limit cannot hold its connections). */
Test(systemd, the_units_descriptor_limit_fits_the_default_connection_limit)
{
	char path[600], line[256];
	struct rlimit rl = {0, 0};
	struct hd d;
	FILE *f;

	snprintf(path, sizeof path, "%s/systemd/torchloopd.service", h_root());
	f = fopen(path, "r");
	cr_assert_not_null(f);
	while (fgets(line, sizeof line, f))
		if (sscanf(line, "LimitNOFILE=%lu", &rl.rlim_cur) == 1)
			break;
	fclose(f);
	cr_assert_gt(rl.rlim_cur, 0, "the unit sets LimitNOFILE");
	rl.rlim_max = rl.rlim_cur;
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	cr_assert_eq(hd_stop(&d), 0);
}

Test(systemd, the_service_scores_at_most_2_0_in_systemd_analyze_security)
{
	char dir[512], svc[600], log[600], line[512];
	double score = 99;
	FILE *f;

	staged_units(dir, sizeof dir);
	snprintf(svc, sizeof svc, "%s/torchloopd.service", dir);
	snprintf(log, sizeof log, "%s/security.log", dir);
	h_run((const char *[]){"systemd-analyze", "security", "--offline=true", svc, NULL}, log);
	f = fopen(log, "r");
	while (f && fgets(line, sizeof line, f)) {
		char *p = strstr(line, "Overall exposure level for torchloopd.service:");
		if (p)
			score = strtod(p + strlen("Overall exposure level for torchloopd.service:"),
			               NULL);
	}
	if (f)
		fclose(f);
	cr_assert_leq(score, 2.0, "exposure %.1f; see %s", score, log);
}

/* ---- a fake notify receiver ------------------------------------------------------------ */

/*
 * A thread drains the socket the whole time, as systemd does.  A unix
 * datagram socket holds net.unix.max_dgram_qlen (10) messages; past that the
 * daemon's sd_notify blocks its loop until someone reads -- which a receiver
 * that read only inside receiver_collect turned into a deadlock with the
 * harness's health request during start-up (the watchdog test hung for 300 s
 * now and then).
 */
struct note {
	double t;
	char text[256];
};

struct receiver {
	int fd;
	char addr[128]; /* what goes into NOTIFY_SOCKET */
	struct note notes[512];
	int n;
	pthread_t tid;
	pthread_mutex_t mu;
	atomic_bool stop;
};

static void *receiver_main(void *arg)
{
	struct receiver *r = arg;

	while (!atomic_load(&r->stop)) {
		char buf[1024];
		ssize_t k = recv(r->fd, buf, sizeof buf - 1, 0);
		if (k <= 0)
			continue;
		buf[k] = '\0';
		pthread_mutex_lock(&r->mu);
		if (r->n < 512) {
			r->notes[r->n].t = now();
			snprintf(r->notes[r->n].text, sizeof r->notes[0].text, "%s", buf);
			r->n++;
		}
		pthread_mutex_unlock(&r->mu);
	}
	return NULL;
}

static void receiver_open(struct receiver *r, bool abstract)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct timeval tv = {0, 50000};
	char dir[256];
	socklen_t len;

	memset(r, 0, sizeof *r);
	r->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (abstract) {
		snprintf(r->addr, sizeof r->addr, "@torchloopd-test-%d", (int)getpid());
		memcpy(sa.sun_path + 1, r->addr + 1, strlen(r->addr) - 1);
		len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(r->addr));
	} else {
		h_tmpdir(dir, sizeof dir, "notify");
		snprintf(r->addr, sizeof r->addr, "%s/notify", dir);
		memcpy(sa.sun_path, r->addr, strlen(r->addr) + 1);
		len = sizeof sa;
	}
	cr_assert_eq(bind(r->fd, (struct sockaddr *)&sa, len), 0, "bind %s", r->addr);
	setsockopt(r->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	pthread_mutex_init(&r->mu, NULL);
	atomic_store(&r->stop, false);
	cr_assert_eq(pthread_create(&r->tid, NULL, receiver_main, r), 0);
	setenv("NOTIFY_SOCKET", r->addr, 1);
}

static void receiver_close(struct receiver *r)
{
	atomic_store(&r->stop, true);
	pthread_join(r->tid, NULL);
	close(r->fd);
	pthread_mutex_destroy(&r->mu);
}

/* Lets messages arrive for `seconds` (the thread collects them). */
static void receiver_collect(struct receiver *r, double seconds)
{
	(void)r;
	usleep((useconds_t)(seconds * 1e6));
}

static int receiver_count(struct receiver *r)
{
	int n;

	pthread_mutex_lock(&r->mu);
	n = r->n;
	pthread_mutex_unlock(&r->mu);
	return n;
}

/* Index of the first note at or after `from` containing needle, or -1. */
static int find(struct receiver *r, int from, const char *needle)
{
	int found = -1;

	pthread_mutex_lock(&r->mu);
	for (int i = from; i < r->n && found < 0; i++)
		if (strstr(r->notes[i].text, needle))
			found = i;
	pthread_mutex_unlock(&r->mu);
	return found;
}

/* find(), waiting up to timeout_s for the message to arrive: its index or -1. */
static int await(struct receiver *r, int from, const char *needle, double timeout_s)
{
	int found = find(r, from, needle);

	for (int k = 0; found < 0 && k < (int)(timeout_s * 20); k++) {
		usleep(50 * 1000);
		found = find(r, from, needle);
	}
	return found;
}

static int pings(struct receiver *r, double from, double to, double *max_gap)
{
	double last = -1;
	int n = 0;

	*max_gap = 0;
	pthread_mutex_lock(&r->mu);
	for (int i = 0; i < r->n; i++) {
		if (!strstr(r->notes[i].text, "WATCHDOG=1") || r->notes[i].t < from ||
		    r->notes[i].t > to)
			continue;
		if (last >= 0 && r->notes[i].t - last > *max_gap)
			*max_gap = r->notes[i].t - last;
		last = r->notes[i].t;
		n++;
	}
	pthread_mutex_unlock(&r->mu);
	return n;
}

static void notify_lifecycle(bool abstract)
{
	struct receiver r;
	struct hd d;
	double gap, t0;
	int ready, n;

	receiver_open(&r, abstract);
	setenv("WATCHDOG_USEC", "2000000", 1);
	unsetenv("WATCHDOG_PID");
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	ready = await(&r, 0, "READY=1", 30);
	cr_assert_geq(ready, 0, "READY=1 was sent");
	t0 = now();
	receiver_collect(&r, 10.0);
	n = pings(&r, t0, t0 + 10.0, &gap);
	/* pings every 0.45 * WATCHDOG_USEC (0.9 s): 11 in 10 s.  systemd's deadline
	 * is 2 s; 1.5 s leaves a loaded machine (ASan, a busy CI) half a second of
	 * delay and still fails a daemon that pings only at the deadline */
	cr_assert_geq(n, 8, "%d watchdog pings in 10 s", n);
	cr_assert_leq(gap, 1.5, "largest gap between pings %.3f s", gap);
	/* SIGHUP: RELOADING=1 then READY=1 */
	n = receiver_count(&r);
	kill(d.pid, SIGHUP);
	{
		int reloading = await(&r, n, "RELOADING=1", 30);
		cr_assert_geq(reloading, 0, "RELOADING=1 on SIGHUP");
		cr_assert_geq(await(&r, reloading, "READY=1", 30), 0, "READY=1 after the reload");
	}
	n = receiver_count(&r);
	kill(d.pid, SIGTERM);
	cr_assert_geq(await(&r, n, "STOPPING=1", 30), 0, "STOPPING=1 on SIGTERM");
	cr_assert_eq(hd_stop(&d), 0);
	receiver_close(&r);
}

Test(systemd, notify_on_a_path_socket_reports_ready_watchdog_reload_and_stop)
{
	notify_lifecycle(false);
}

Test(systemd, notify_on_an_abstract_socket_reports_ready_watchdog_reload_and_stop)
{
	notify_lifecycle(true);
}

Test(systemd, no_watchdog_pings_when_watchdog_pid_is_another_process)
{
	struct receiver r;
	struct hd d;
	double gap;

	receiver_open(&r, false);
	setenv("WATCHDOG_USEC", "2000000", 1);
	setenv("WATCHDOG_PID", "1", 1);
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	receiver_collect(&r, 3.0);
	cr_assert_eq(pings(&r, 0, 1e18, &gap), 0, "pings for someone else's watchdog");
	cr_assert_geq(find(&r, 0, "READY=1"), 0);
	cr_assert_eq(hd_stop(&d), 0);
	receiver_close(&r);
}

Test(systemd, pings_stop_while_the_event_loop_is_stalled)
{
	struct receiver r;
	struct hd d;
	double gap, t0;

	receiver_open(&r, false);
	setenv("WATCHDOG_USEC", "1000000", 1);
	unsetenv("WATCHDOG_PID");
	setenv("TORCHLOOPD_TEST_HOOKS", "1", 1);
	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	receiver_collect(&r, 1.0);
	t0 = now();
	kill(d.pid, SIGUSR2); /* the loop sleeps 3 s */
	receiver_collect(&r, 5.0);
	/* the window starts before the signal so that the gap's left edge is in it */
	cr_assert_geq(pings(&r, t0 - 1.0, t0 + 5.0, &gap), 4, "pings resume after the stall");
	cr_assert_geq(gap, 2.5, "no ping while the loop was stalled (largest gap %.2f s)", gap);
	unsetenv("TORCHLOOPD_TEST_HOOKS");
	cr_assert_eq(hd_stop(&d), 0);
	receiver_close(&r);
}

/* ---- socket activation --------------------------------------------------------------- */

Test(systemd, a_socket_activated_daemon_serves_on_the_inherited_socket_and_leaves_it)
{
	char dir[512], path[600], bin[1100], log[700];
	struct hd d;
	struct stat st;
	pid_t pid;
	int status;

	unsetenv("NOTIFY_SOCKET");
	unsetenv("WATCHDOG_USEC");
	h_tmpdir(dir, sizeof dir, "activate");
	snprintf(path, sizeof path, "%s/activated.sock", dir);
	snprintf(bin, sizeof bin, "%s/%s/torchloopd", h_root(), h_build());
	snprintf(log, sizeof log, "%s/log", dir);
	pid = fork();
	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
		dup2(fd, 1);
		dup2(fd, 2);
		execlp("systemd-socket-activate", "systemd-socket-activate", "-l", path, bin,
		       "--no-probe", "--cache-dir", h_shared_cache(), "--socket",
		       "/nonexistent/ignored.sock", (char *)NULL);
		_exit(127);
	}
	for (int k = 0; k < 100 && stat(path, &st) != 0; k++)
		usleep(50000);
	cr_assert_eq(stat(path, &st), 0, "systemd-socket-activate is listening");
	memset(&d, 0, sizeof d);
	d.pid = pid;
	snprintf(d.sock, sizeof d.sock, "%s", path);
	snprintf(d.log, sizeof d.log, "%s", log);
	hd_wait_ready(&d, 120); /* the first connection launches the daemon */
	{
		struct tl_client *c = hd_connect(&d);
		struct tl_builder *b = tl_builder_new();
		double carry[4] = {1, 2, 3, 4}, xs[12] = {0};
		int64_t cs[] = {4}, xsh[] = {3, 4};
		struct tl_reply *r;
		struct tl_error err;
		hd_register(c, "t7.cumsum", "examples/bodies/cumsum.py", "body", 12, 64, 3);
		cr_assert_eq(tl_scan(c, "t7.cumsum", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
		                     tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, &err),
		             0, "%s", err.message);
		cr_assert_float_eq(((const double *)tl_tree_data(tl_reply_tree(r, "carry")))[3],
		                   4.0, 0);
		tl_reply_free(r);
		tl_builder_free(b);
		tl_close(c);
	}
	kill(pid, SIGTERM);
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit status %d", status);
	cr_assert_eq(stat(path, &st), 0, "the inherited socket file is left alone");
	cr_assert(S_ISSOCK(st.st_mode));
}
