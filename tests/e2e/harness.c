/* harness.c - see harness.h. */
#include "harness.h"
#include "helpers.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *h_root(void)
{
	static char root[1024];

	if (root[0] == '\0' && getcwd(root, sizeof root) == NULL)
		cr_assert_fail("getcwd");
	return root;
}

static const char *scratch(void)
{
	static char dir[1024];
	const char *env = getenv("TORCHLOOP_TEST_TMP");

	if (dir[0] == '\0') {
		snprintf(dir, sizeof dir, "%s", env && *env ? env : "/tmp/torchloop-tests");
		mkdir(dir, 0755);
	}
	return dir;
}

const char *h_shared_cache(void)
{
	static char dir[1024];
	const char *env = getenv("TORCHLOOP_TEST_CACHE");

	if (dir[0] == '\0')
		snprintf(dir, sizeof dir, "%s", env && *env ? env : "/tmp/torchloop-tests/cache");
	return dir;
}

void h_unchecked_src(char *out, size_t size, const char *src)
{
	static unsigned n;
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	cr_assert_lt((size_t)snprintf(out, size, "%s\n# unchecked %d.%lld.%ld.%u\n", src,
	                              (int)getpid(), (long long)t.tv_sec, t.tv_nsec, n++),
	             size, "h_unchecked_src: %zu bytes are too few", size);
}

void h_tmpdir(char *out, size_t size, const char *tag)
{
	snprintf(out, size, "%s/%s.XXXXXX", scratch(), tag);
	cr_assert_not_null(mkdtemp(out), "mkdtemp %s: %s", out, strerror(errno));
	chmod(out, 0755);
}

const char *h_build(void)
{
	const char *b = getenv("TORCHLOOP_TEST_BUILD");

	return b && *b ? b : "build";
}

void hd_start(struct hd *d, const char *cache, const char *const *extra)
{
	const char *argv[64];
	char bin[1100];
	int n = 0, fd;

	memset(d, 0, sizeof *d);
	h_tmpdir(d->dir, sizeof d->dir, "d");
	snprintf(d->sock, sizeof d->sock, "%s/sock", d->dir);
	snprintf(d->log, sizeof d->log, "%s/log", d->dir);
	snprintf(d->cache, sizeof d->cache, "%s", cache ? cache : h_shared_cache());
	/* TORCHLOOPD_TEST_HOOKS=1: the build with test-only hooks (Makefile) */
	snprintf(bin, sizeof bin, "%s/%s/torchloopd%s", h_root(), h_build(),
	         getenv("TORCHLOOPD_TEST_HOOKS") ? "-testhooks" : "");
	argv[n++] = bin;
	argv[n++] = "--socket";
	argv[n++] = d->sock;
	argv[n++] = "--cache-dir";
	argv[n++] = d->cache;
	for (; extra && *extra && n < 60; extra++)
		argv[n++] = *extra;
	argv[n] = NULL;
	d->pid = fork();
	cr_assert_neq(d->pid, -1);
	if (d->pid == 0) {
		/* a test that fails before hd_stop must not leave its daemon behind */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		/* LeakSanitizer's tracer crashes suspending libtorch's threads; the
		 * daemon's leaks are checked under valgrind (scripts/valgrind-daemon.sh) */
		setenv("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0", 1);
		fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		dup2(fd, 1);
		dup2(fd, 2);
		execv(bin, (char *const *)argv);
		_exit(127);
	}
}

void hd_wait_ready(struct hd *d, int timeout_s)
{
	time_t end = time(NULL) + timeout_s;

	while (time(NULL) < end) {
		struct tl_client *c;
		struct tl_error err;
		int ready = 0, status;

		if (waitpid(d->pid, &status, WNOHANG) == d->pid)
			cr_assert_fail("torchloopd exited during start-up (status %d); log %s",
			               status, d->log);
		if (tl_connect(d->sock, 1000, &c, &err) == 0) {
			int rc = tl_health(c, &ready, &err);
			tl_close(c);
			if (rc == 0 && ready)
				return;
		}
		usleep(100 * 1000);
	}
	cr_assert_fail("torchloopd not ready within %d s; log %s", timeout_s, d->log);
}

int hd_stop(struct hd *d)
{
	int status = 0;

	if (d->pid <= 0)
		return 0;
	kill(d->pid, SIGTERM);
	cr_assert_eq(waitpid(d->pid, &status, 0), d->pid);
	d->pid = 0;
	cr_assert(WIFEXITED(status), "torchloopd died of signal %d; log %s",
	          WIFSIGNALED(status) ? WTERMSIG(status) : 0, d->log);
	return WEXITSTATUS(status);
}

struct tl_client *hd_connect(struct hd *d)
{
	struct tl_client *c;
	struct tl_error err;

	cr_assert_eq(tl_connect(d->sock, 5000, &c, &err), 0, "%s", err.message);
	cr_assert_eq(tl_hello(c, &err), 0, "%s", err.message);
	return c;
}

char *h_slurp(const char *path)
{
	return slurp(path);
}

void hs_open(struct h_session *s, const char *cache, const char *const *args)
{
	hd_start(&s->d, cache, args);
	hd_wait_ready(&s->d, 120);
	s->c = hd_connect(&s->d);
}

void hs_close(struct h_session *s)
{
	h_bufs_free(&s->bb);
	tl_builder_free(s->b);
	tl_close(s->c);
	cr_assert_eq(hd_stop(&s->d), 0, "clean exit; log %s", s->d.log);
}

void h_not_checked(const char *fmt, ...)
{
	va_list ap;

	fputs("NOT CHECKED: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

void h_write_file(const char *path, const char *fmt, ...)
{
	FILE *f = fopen(path, "w");
	va_list ap;

	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	cr_assert_eq(fclose(f), 0, "%s: %s", path, strerror(errno));
}

void hd_register(struct tl_client *c, const char *name, const char *body_file, const char *entry,
                 int64_t max_steps, int64_t max_elements, int64_t budget)
{
	hd_register_strategy(c, name, body_file, entry, NULL, max_steps, max_elements, budget);
}

void hd_register_strategy(struct tl_client *c, const char *name, const char *body_file,
                          const char *entry, const char *strategy, int64_t max_steps,
                          int64_t max_elements, int64_t budget)
{
	char path[2048];
	char *src;
	struct tl_error err;
	struct tl_adapter_def def;

	snprintf(path, sizeof path, "%s/%s", h_root(), body_file);
	src = h_slurp(path);
	def = (struct tl_adapter_def){name,     src,       path,         entry,
	                              strategy, max_steps, max_elements, budget};
	cr_assert_eq(tl_register(c, &def, &err), 0, "register %s: %s %s", name, err.code,
	             err.message);
	free(src);
}

json_t *h_call_json(struct tl_client *c, const char *op, const char *name)
{
	struct tl_error err;
	char *text;
	json_t *j;

	cr_assert_eq(tl_call_json(c, op, name, &text, &err), 0, "%s: %s", op, err.message);
	j = json_loads(text, 0, NULL);
	free(text);
	cr_assert_not_null(j);
	return j;
}

long h_status_kib(pid_t pid, const char *field)
{
	char path[64], line[256], format[64];
	long kib = -1;
	FILE *f;

	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	snprintf(format, sizeof format, "%s: %%ld kB", field);
	f = fopen(path, "r");
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, format, &kib) == 1)
			break;
	if (f)
		fclose(f);
	return kib;
}

long h_rss_kib(pid_t pid)
{
	return h_status_kib(pid, "VmRSS");
}

uint64_t h_stat(struct tl_client *c, const char *key)
{
	json_t *j = h_call_json(c, "stats", NULL);
	uint64_t v = (uint64_t)json_integer_value(json_object_get(j, key));

	json_decref(j);
	return v;
}

double hd_counter(struct tl_client *c, const char *adapter, const char *counter)
{
	struct tl_error err;
	char *text;
	json_t *j;
	double v;

	cr_assert_eq(tl_call_json(c, "describe", adapter, &text, &err), 0, "%s", err.message);
	j = json_loads(text, 0, NULL);
	cr_assert_not_null(j);
	v = json_number_value(json_object_get(json_object_get(j, "counters"), counter));
	json_decref(j);
	free(text);
	return v;
}

void h_wait_spec_state(struct tl_client *c, const char *adapter, const char *state, int timeout_s)
{
	bool seen = false;

	for (int k = 0; k < timeout_s * 20 && !seen; k++) {
		json_t *j = h_call_json(c, "describe", adapter), *sp;
		size_t i;

		json_array_foreach(json_object_get(j, "specializations"), i, sp)
		{
			const char *st = json_string_value(json_object_get(sp, "state"));
			seen = seen || (st && strcmp(st, state) == 0);
		}
		json_decref(j);
		if (!seen)
			usleep(50 * 1000);
	}
	cr_assert(seen, "%s: no specialization %s within %d s", adapter, state, timeout_s);
}

void h_fill(void *data, enum tl_dtype dtype, size_t n, uint64_t seed)
{
	uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;

	for (size_t i = 0; i < n; i++) {
		double v;
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		v = (double)(s >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
		if (dtype == TL_FLOAT32)
			((float *)data)[i] = (float)v;
		else
			((double *)data)[i] = v;
	}
}

pid_t h_child_of(pid_t parent)
{
	DIR *dp = opendir("/proc");
	struct dirent *e;
	pid_t found = 0;

	while (dp && (e = readdir(dp)) != NULL && !found) {
		char path[300], buf[512];
		FILE *fp;
		long ppid = 0;
		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
		fp = fopen(path, "r");
		if (fp && fgets(buf, sizeof buf, fp)) {
			char *p = strrchr(buf, ')'); /* comm may contain spaces */
			if (p)
				sscanf(p + 2, "%*c %ld", &ppid);
		}
		if (fp)
			fclose(fp);
		if (ppid == parent)
			found = (pid_t)atoi(e->d_name);
	}
	if (dp)
		closedir(dp);
	return found;
}

int h_run(const char *const *argv, const char *log)
{
	pid_t pid = fork();
	int status;

	cr_assert_neq(pid, -1);
	if (pid == 0) {
		if (log) {
			int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execvp(argv[0], (char *const *)argv);
		_exit(127);
	}
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void h_reference(const char *dir, const char *body_file, const char *entry,
                 const struct tl_tree *carry, const struct tl_tree *inputs,
                 const struct tl_tree *cot_carry, const struct tl_tree *cot_outputs, bool grad,
                 bool fd)
{
	json_t *doc = json_object();
	char msg[512], path[1024], py[1100], script[1100], body[1100], log[1100];
	const char *argv[12];
	int n = 0;

	json_object_set_new(doc, "carry", treejson_save(carry, dir, "in_carry", msg, sizeof msg));
	json_object_set_new(doc, "inputs",
	                    treejson_save(inputs, dir, "in_inputs", msg, sizeof msg));
	if (cot_carry)
		json_object_set_new(doc, "cot_carry",
		                    treejson_save(cot_carry, dir, "cot_carry", msg, sizeof msg));
	if (cot_outputs)
		json_object_set_new(
		    doc, "cot_outputs",
		    treejson_save(cot_outputs, dir, "cot_outputs", msg, sizeof msg));
	snprintf(path, sizeof path, "%s/in.json", dir);
	cr_assert_eq(json_dump_file(doc, path, JSON_PRESERVE_ORDER), 0);
	json_decref(doc);
	snprintf(py, sizeof py, "%s/.venv/bin/python", h_root());
	snprintf(script, sizeof script, "%s/tests/helpers/eager_ref.py", h_root());
	snprintf(body, sizeof body, "%s/%s", h_root(), body_file);
	snprintf(log, sizeof log, "%s/ref.log", dir);
	argv[n++] = py;
	argv[n++] = script;
	argv[n++] = "--body";
	argv[n++] = body;
	argv[n++] = "--entry";
	argv[n++] = entry;
	argv[n++] = "--dir";
	argv[n++] = dir;
	if (grad)
		argv[n++] = "--grad";
	if (fd)
		argv[n++] = "--fd";
	argv[n] = NULL;
	cr_assert_eq(h_run(argv, log), 0, "eager reference failed; see %s", log);
}

void h_assert_grad_matches_reference(struct tl_reply *r, struct tl_builder *b, const char *tag,
                                     const char *body_file, const char *entry,
                                     const struct tl_tree *carry, const struct tl_tree *inputs,
                                     const struct tl_tree *cot_carry,
                                     const struct tl_tree *cot_outputs)
{
	h_assert_pair_matches_reference(r, r, b, tag, body_file, entry, carry, inputs, cot_carry,
	                                cot_outputs);
}

void h_assert_pair_matches_reference(const struct tl_reply *fwd, const struct tl_reply *r,
                                     struct tl_builder *b, const char *tag, const char *body_file,
                                     const char *entry, const struct tl_tree *carry,
                                     const struct tl_tree *inputs, const struct tl_tree *cot_carry,
                                     const struct tl_tree *cot_outputs)
{
	static const char *const same[] = {"carry", "outputs", "grad_carry", "grad_inputs"};
	static const char *const fd[][2] = {{"grad_carry", "fd_carry"},
	                                    {"grad_inputs", "fd_inputs"}};
	struct treejson tj;
	char dir[512];

	h_tmpdir(dir, sizeof dir, tag);
	h_reference(dir, body_file, entry, carry, inputs, cot_carry, cot_outputs, true, true);
	treejson_init(&tj, b, NULL);
	for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
		h_assert_close(tl_reply_tree(i < 2 ? fwd : r, same[i]),
		               h_load_ref(&tj, dir, same[i]), 1e-10, 1e-12, same[i]);
	for (size_t i = 0; i < sizeof fd / sizeof fd[0]; i++)
		cr_assert_leq(
		    h_normwise_error(tl_reply_tree(r, fd[i][0]), h_load_ref(&tj, dir, fd[i][1])),
		    1e-6, "%s vs finite differences", fd[i][0]);
	treejson_free(&tj);
}

const struct tl_tree *h_load_ref(struct treejson *tj, const char *dir, const char *key)
{
	char path[1024], msg[512], base[1024];
	json_t *doc;
	const struct tl_tree *t;

	snprintf(path, sizeof path, "%s/ref/tree.json", dir);
	snprintf(base, sizeof base, "%s/ref", dir);
	doc = json_load_file(path, JSON_PRESERVE_ORDER, NULL);
	cr_assert_not_null(doc, "%s", path);
	tj->base = base; /* only used while loading */
	t = treejson_load(tj, json_object_get(doc, key), msg, sizeof msg);
	tj->base = NULL;
	cr_assert_not_null(t, "%s: %s", key, msg);
	json_decref(doc);
	return t;
}

static double value(const struct tl_tree *t, size_t i)
{
	return tl_tree_dtype(t) == TL_FLOAT32 ? ((const float *)tl_tree_data(t))[i]
	                                      : ((const double *)tl_tree_data(t))[i];
}

static void walk(const struct tl_tree *got, const struct tl_tree *want, double rtol, double atol,
                 double floor, double *max_rel, const char *what, bool assert_close)
{
	cr_assert_eq(tl_tree_kind(got), tl_tree_kind(want), "%s: node kinds differ", what);
	if (tl_tree_kind(want) == TL_TENSOR) {
		size_t n;
		cr_assert_eq(tl_tree_dtype(got), tl_tree_dtype(want), "%s: dtype", what);
		cr_assert_eq(tl_tree_ndim(got), tl_tree_ndim(want), "%s: rank", what);
		for (int k = 0; k < tl_tree_ndim(want); k++)
			cr_assert_eq(tl_tree_shape(got)[k], tl_tree_shape(want)[k], "%s: dim %d",
			             what, k);
		n = tl_tree_nbytes(want) / (tl_tree_dtype(want) == TL_FLOAT32 ? 4 : 8);
		for (size_t i = 0; i < n; i++) {
			double g = value(got, i), w = value(want, i);
			double rel = fabs(g - w) / fmax(fabs(w), floor);
			if (rel > *max_rel)
				*max_rel = rel;
			if (assert_close)
				cr_assert(fabs(g - w) <= atol + rtol * fabs(w),
				          "%s: element %zu is %.17g, reference %.17g", what, i, g,
				          w);
		}
		return;
	}
	cr_assert_eq(tl_tree_len(got), tl_tree_len(want), "%s: container sizes", what);
	for (size_t i = 0; i < tl_tree_len(want); i++) {
		if (tl_tree_kind(want) == TL_DICT) {
			size_t a, b;
			const char *ka = tl_tree_key(got, i, &a), *kb = tl_tree_key(want, i, &b);
			cr_assert(a == b && memcmp(ka, kb, a) == 0, "%s: dict keys or order differ",
			          what);
		}
		walk(tl_tree_item(got, i), tl_tree_item(want, i), rtol, atol, floor, max_rel, what,
		     assert_close);
	}
}

void h_assert_close(const struct tl_tree *got, const struct tl_tree *want, double rtol, double atol,
                    const char *what)
{
	double m = 0;

	walk(got, want, rtol, atol, 1e-300, &m, what, true);
}

static void norms(const struct tl_tree *got, const struct tl_tree *want, double *diff,
                  double *scale)
{
	if (tl_tree_kind(want) == TL_TENSOR) {
		size_t n = tl_tree_nbytes(want) / (tl_tree_dtype(want) == TL_FLOAT32 ? 4 : 8);
		cr_assert_eq(tl_tree_kind(got), TL_TENSOR);
		cr_assert_eq(tl_tree_nbytes(got), tl_tree_nbytes(want));
		for (size_t i = 0; i < n; i++) {
			*diff = fmax(*diff, fabs(value(got, i) - value(want, i)));
			*scale = fmax(*scale, fabs(value(want, i)));
		}
		return;
	}
	cr_assert_eq(tl_tree_len(got), tl_tree_len(want));
	for (size_t i = 0; i < tl_tree_len(want); i++)
		norms(tl_tree_item(got, i), tl_tree_item(want, i), diff, scale);
}

double h_normwise_error(const struct tl_tree *got, const struct tl_tree *want)
{
	double diff = 0, scale = 0;

	norms(got, want, &diff, &scale);
	return scale > 0 ? diff / scale : diff;
}

double h_max_rel_error(const struct tl_tree *got, const struct tl_tree *want, double floor)
{
	double m = 0;

	walk(got, want, 0, 0, floor, &m, "tree", false);
	return m;
}

#include "frame.h"
#include "msg.h"

#include <sys/socket.h>
#include <sys/un.h>

int raw_connect(const char *sock)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect: %s",
	             strerror(errno));
	return fd;
}

void raw_send(int fd, const void *bytes, size_t n)
{
	cr_assert_eq(send(fd, bytes, n, MSG_NOSIGNAL), (ssize_t)n);
}

void raw_send_frame(int fd, const void *body, size_t n)
{
	uint8_t head[4];

	frame_put_header(head, (uint32_t)n);
	raw_send(fd, head, 4);
	raw_send(fd, body, n);
}

/* Reads n bytes: 0, or the number read before the stream ended (-1: none). */
static ssize_t read_n(int fd, uint8_t *p, size_t n)
{
	size_t want = n;

	while (n > 0) {
		ssize_t k = recv(fd, p, n, 0);
		if (k <= 0)
			return want == n ? -1 : (ssize_t)(want - n);
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

int raw_recv_msg(int fd, uint8_t **body, struct msg *m)
{
	uint8_t head[4];
	uint32_t len;
	struct proto_err err;

	do {
		ssize_t got = read_n(fd, head, 4);
		cr_assert_leq(got, 0, "a reply frame cut after %zd of its 4 header bytes", got);
		if (got != 0)
			return -1; /* a close between frames */
		len = (uint32_t)head[0] << 24 | (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 |
		      head[3];
		*body = frame_alloc(len);
		cr_assert_eq(read_n(fd, *body, len), 0, "truncated reply frame");
		cr_assert_eq(msg_parse(m, *body, len, MSG_REPLY, &err), 0, "bad reply: %s",
		             err.message);
		if (m->is_event) {
			msg_destroy(m);
			frame_free(*body);
		}
	} while (m->is_event);
	return 0;
}

int raw_recv(int fd, char *code, size_t code_size, long long *id, char *message, size_t msg_size)
{
	uint8_t *body;
	struct msg m;
	struct proto_err err;

	if (raw_recv_msg(fd, &body, &m) != 0)
		return -1;
	*id = m.has_id ? (long long)m.id : -1;
	code[0] = message[0] = '\0';
	if (m.is_error) {
		msg_reply_error(&m, &err);
		snprintf(code, code_size, "%s", proto_code_name(err.code));
		snprintf(message, msg_size, "%s", err.message);
	}
	msg_destroy(&m);
	frame_free(body);
	return 0;
}

struct tl_tree *h_rand_tensor(struct tl_builder *b, struct h_bufs *bb, int ndim,
                              const int64_t *shape, uint64_t seed)
{
	size_t n = 1;
	double *buf;

	cr_assert_lt(bb->n, (int)(sizeof bb->p / sizeof bb->p[0]), "h_bufs is full");
	for (int i = 0; i < ndim; i++)
		n *= (size_t)shape[i];
	buf = aligned_alloc(64, (n * 8 / 64 + 1) * 64);
	cr_assert_not_null(buf);
	h_fill(buf, TL_FLOAT64, n, seed);
	bb->p[bb->n++] = buf;
	return tl_tensor(b, TL_FLOAT64, ndim, shape, buf);
}

void h_bufs_free(struct h_bufs *bb)
{
	for (int k = 0; k < bb->n; k++)
		free(bb->p[k]);
	bb->n = 0;
}

void h_assert_scan_matches_reference(struct tl_client *c, const char *adapter,
                                     const char *body_file, const char *entry,
                                     struct tl_tree *carry, struct tl_tree *inputs,
                                     struct tl_builder *b, const char *tag)
{
	struct tl_reply *r;
	struct tl_error err;

	cr_assert_eq(tl_scan(c, adapter, carry, inputs, &r, &err), 0, "%s: %s %s", adapter,
	             err.code, err.message);
	h_assert_reply_matches_reference(r, body_file, entry, carry, inputs, b, tag);
}

void h_assert_reply_matches_reference(struct tl_reply *r, const char *body_file, const char *entry,
                                      struct tl_tree *carry, struct tl_tree *inputs,
                                      struct tl_builder *b, const char *tag)
{
	struct treejson tj;
	char dir[512];

	h_tmpdir(dir, sizeof dir, tag);
	h_reference(dir, body_file, entry, carry, inputs, NULL, NULL, false, false);
	treejson_init(&tj, b, NULL);
	h_assert_close(tl_reply_tree(r, "carry"), h_load_ref(&tj, dir, "carry"), 1e-10, 1e-12,
	               "carry");
	h_assert_close(tl_reply_tree(r, "outputs"), h_load_ref(&tj, dir, "outputs"), 1e-10, 1e-12,
	               "outputs");
	tl_reply_free(r);
	treejson_free(&tj);
}
