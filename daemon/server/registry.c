/*
 * registry.c - adapter definition files (the server layer's side of the
 * registry in adapter.c).  Loop thread, except the directory read.
 *
 * Adapter definition files (*.adapter in --adapters DIR) are key = value
 * lines; see docs/operations.md.  The directory is read on the thread pool
 * (a FIFO or a hung mount must not freeze the loop): regular files only,
 * each size-capped; the loop thread then registers what was read.  On a
 * reload, an adapter whose file is gone is unregistered, but one whose file
 * or body cannot be read right now keeps its old definition (a warning says
 * so): an editor's rename-and-replace, or a half-written edit, must not drop
 * a live adapter.
 */
#include "daemon.h"

#include "log.h"
#include "sha256.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- adapter definition files ------------------------------------------ */

/* A regular file's text, at most max bytes (errno EINVAL for a FIFO, EFBIG). Pool. */
static char *read_text(const char *path, size_t max)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	struct stat st;
	char *buf = NULL;
	size_t n = 0;
	ssize_t r;

	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		errno = EINVAL;
		return NULL;
	}
	if ((uint64_t)st.st_size > max) {
		close(fd);
		errno = EFBIG;
		return NULL;
	}
	buf = malloc((size_t)st.st_size + 1);
	while (buf && n < (size_t)st.st_size && (r = read(fd, buf + n, (size_t)st.st_size - n)) > 0)
		n += (size_t)r;
	close(fd);
	if (buf == NULL)
		return NULL;
	buf[n] = '\0';
	return buf;
}

static char *trim(char *s)
{
	char *e;

	while (*s == ' ' || *s == '\t')
		s++;
	e = s + strlen(s);
	while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' || e[-1] == '\n'))
		*--e = '\0';
	return s;
}

static int parse_int(const char *v, int64_t *out)
{
	char *end;
	long long x = strtoll(v, &end, 10);

	if (*v == '\0' || *end != '\0')
		return -1;
	*out = x;
	return 0;
}

static int set_field(struct adapter_def *def, const char *k, const char *v, char *body,
                     size_t body_size)
{
	if (strcmp(k, "name") == 0)
		return snprintf(def->name, sizeof def->name, "%s", v) >= (int)sizeof def->name ? -1
		                                                                               : 0;
	if (strcmp(k, "body") == 0)
		return snprintf(body, body_size, "%s", v) >= (int)body_size ? -1 : 0;
	if (strcmp(k, "entry") == 0)
		return snprintf(def->entry, sizeof def->entry, "%s", v) >= (int)sizeof def->entry
		           ? -1
		           : 0;
	if (strcmp(k, "strategy") == 0)
		return snprintf(def->strategy, sizeof def->strategy, "%s", v) >=
		               (int)sizeof def->strategy
		           ? -1
		           : 0;
	if (strcmp(k, "dynamic") == 0)
		return snprintf(def->dynamic, sizeof def->dynamic, "%s", v) >=
		               (int)sizeof def->dynamic
		           ? -1
		           : 0;
	if (strcmp(k, "max_steps") == 0)
		return parse_int(v, &def->max_steps);
	if (strcmp(k, "max_elements") == 0)
		return parse_int(v, &def->max_elements);
	if (strcmp(k, "recompile_budget") == 0)
		return parse_int(v, &def->budget);
	if (strcmp(k, "body_file") == 0) /* shown in errors; persisted registrations keep it */
		return snprintf(def->body_file, sizeof def->body_file, "%s", v) >=
		               (int)sizeof def->body_file
		           ? -1
		           : 0;
	return -1;
}

/*
 * Parses one *.adapter file (pool); the body path is relative to its
 * directory.  *body_unreadable tells that the file itself was fine (def.name
 * is set) but its body could not be read.
 */
static int parse_file(const char *dir, const char *file, enum adapter_origin origin,
                      struct adapter_def *def, bool *body_unreadable, struct proto_err *err)
{
	char path[PATH_MAX], body[PATH_MAX / 2] = "", full[PATH_MAX];
	char *text, *line, *save = NULL;
	int lineno = 0;

	snprintf(path, sizeof path, "%s/%s", dir, file);
	adapter_def_defaults(def);
	def->origin = origin;
	text = read_text(path, 65536);
	if (text == NULL)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL, "%s: %s", path,
		                  strerror(errno));
	for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *eq, *t = trim(line);
		lineno++;
		if (*t == '\0' || *t == '#')
			continue;
		eq = strchr(t, '=');
		if (eq == NULL) {
			free(text);
			return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL,
			                  "%s:%d: expected key = value", path, lineno);
		}
		*eq = '\0';
		if (set_field(def, trim(t), trim(eq + 1), body, sizeof body) != 0) {
			proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL, "%s:%d: bad setting '%s'",
			           path, lineno,
			           trim(t)); /* t points into text: before it is freed */
			free(text);
			return -1;
		}
	}
	free(text);
	if (body[0] == '\0')
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL, "%s: no body = FILE.py",
		                  path);
	snprintf(full, sizeof full, "%s%s%s", body[0] == '/' ? "" : dir, body[0] == '/' ? "" : "/",
	         body);
	def->source = read_text(full, PROTO_MAX_SOURCE);
	if (def->source == NULL) {
		*body_unreadable = true;
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL, "%s: body %s: %s", path,
		                  full,
		                  errno == EINVAL  ? "not a regular file"
		                  : errno == EFBIG ? "larger than 1 MiB"
		                                   : strerror(errno));
	}
	if (def->body_file[0] == '\0' && realpath(full, path) != NULL &&
	    strlen(path) < sizeof def->body_file)
		memcpy(def->body_file, path, strlen(path) + 1);
	return adapter_def_validate(def, err);
}

static int ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), m = strlen(suffix);

	return n > m && strcmp(s + n - m, suffix) == 0;
}

/* One *.adapter file as read on the pool. */
struct dir_entry {
	char file[256];
	struct adapter_def def; /* owns def.source */
	bool ok, body_unreadable;
	struct proto_err err;
};

struct dir_load {
	uv_work_t work;
	struct daemon *d;
	char dir[PATH_MAX];
	enum adapter_origin origin;
	bool reload;
	struct dir_entry *e;
	size_t n;
	int scan_errno;
	void (*done)(struct daemon *d, int failed);
};

static void load_dir_work(uv_work_t *w)
{
	struct dir_load *l = w->data;
	struct dirent **names;
	int n = scandir(l->dir, &names, NULL, alphasort);

	if (n < 0) {
		l->scan_errno = errno;
		return;
	}
	l->e = calloc((size_t)n + 1, sizeof *l->e);
	if (l->e == NULL)
		l->scan_errno = ENOMEM; /* never "no files": a reload would drop them all */
	for (int i = 0; i < n; i++) {
		struct dir_entry *e = l->e ? &l->e[l->n] : NULL;
		if (e && ends_with(names[i]->d_name, ".adapter") &&
		    strlen(names[i]->d_name) < sizeof e->file) {
			snprintf(e->file, sizeof e->file, "%s", names[i]->d_name);
			e->ok = parse_file(l->dir, e->file, l->origin, &e->def, &e->body_unreadable,
			                   &e->err) == 0;
			l->n++;
		}
		free(names[i]);
	}
	free(names);
}

static bool named_in(const struct dir_load *l, const char *name)
{
	for (size_t i = 0; i < l->n; i++)
		if (strcmp(l->e[i].def.name, name) == 0)
			return true;
	return false;
}

/* Loop: registers what the pool read; returns the number of failed files. */
static int apply_dir(struct dir_load *l)
{
	struct daemon *d = l->d;
	int failed = 0;

	for (size_t i = 0; i < l->n; i++) {
		struct dir_entry *e = &l->e[i];
		bool replaced, unchanged;
		if (!e->ok) {
			failed++;
			if (e->def.name[0] &&
			    adapter_find(&d->graphs.reg, e->def.name, strlen(e->def.name)))
				log_warn("adapter file %s: %s; keeping the registered %s", e->file,
				         e->err.message, e->def.name);
			else
				log_error("adapter file %s: %s", e->file, e->err.message);
			free(e->def.source);
			continue;
		}
		if (adapter_register(&d->graphs.reg, &e->def, &replaced, &unchanged) == NULL) {
			free(e->def.source);
			failed++;
			continue;
		}
		log_line(LOG_INFO, 0, e->def.name, "%s from %s",
		         unchanged  ? "unchanged"
		         : replaced ? "replaced"
		                    : "registered",
		         e->file);
	}
	for (struct adapter *a = d->graphs.reg.head, *next; l->reload && a; a = next) {
		next = a->next;
		if (a->def.origin == ADAPTER_FILE && !named_in(l, a->def.name)) {
			log_line(LOG_INFO, 0, a->def.name, "unregistered: its file is gone");
			adapter_unregister(&d->graphs.reg, a->def.name, strlen(a->def.name));
		}
	}
	return failed;
}

static void load_dir_done(uv_work_t *w, int status)
{
	struct dir_load *l = w->data;
	int failed;

	(void)status;
	if (l->scan_errno) {
		log_error("adapters directory %s: %s", l->dir, strerror(l->scan_errno));
		failed = 1;
	} else {
		failed = apply_dir(l);
	}
	l->done(l->d, failed);
	free(l->e);
	free(l);
}

/*
 * Reads every *.adapter file of dir on the pool, then registers them on the
 * loop and calls done(d, number of files that failed).  On reload, adapters
 * that came from the directory but whose file is gone are unregistered.
 */
int registry_load_dir(struct daemon *d, const char *dir, bool reload,
                      void (*done)(struct daemon *d, int failed))
{
	return registry_load_from(d, dir, ADAPTER_FILE, reload, done);
}

int registry_load_from(struct daemon *d, const char *dir, enum adapter_origin origin, bool reload,
                       void (*done)(struct daemon *d, int failed))
{
	struct dir_load *l = calloc(1, sizeof *l);

	if (l == NULL)
		return -1;
	l->d = d;
	l->origin = origin;
	l->reload = reload;
	l->done = done;
	l->work.data = l;
	snprintf(l->dir, sizeof l->dir, "%s", dir);
	return uv_queue_work(d->loop, &l->work, load_dir_work, load_dir_done) == 0 ? 0 : -1;
}
