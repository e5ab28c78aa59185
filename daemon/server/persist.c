/*
 * persist.c - registrations that survive a restart (--state-dir).
 *
 * What `register` added is written to <state>/registered as an adapter file
 * (`a.NAME.adapter`, the format of --adapters) and its body
 * (`a.NAME.py`), each by write + rename; `unregister` removes them; at start
 * persist_restore registers them again (origin "restored") before the
 * --adapters directory is read, so an operator's file of the same name wins.
 * The directory must be the daemon's own and not group/world-writable: its
 * bodies are imported as code.  Without --state-dir (and without systemd's
 * $STATE_DIRECTORY) nothing is persisted, and describe says so.  Loop thread;
 * the files are small and written only by admin requests.
 */
#include "daemon.h"

#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int reg_dir(const struct daemon *d, char *out, size_t size)
{
	if (d->cfg.state_dir[0] == '\0')
		return -1;
	return snprintf(out, size, "%s/registered", d->cfg.state_dir) < (int)size ? 0 : -1;
}

static int write_atomic(const char *path, const char *data, size_t len)
{
	char tmp[PATH_MAX];
	int fd, e;
	size_t off = 0;

	if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
		return -1;
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0)
		return -1;
	while (off < len) {
		ssize_t k = write(fd, data + off, len - off);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			break;
		off += (size_t)k;
	}
	e = off == len ? 0 : -1;
	if (close(fd) != 0)
		e = -1;
	if (e == 0 && rename(tmp, path) != 0)
		e = -1;
	if (e != 0)
		unlink(tmp);
	return e;
}

/* Copies s with control characters (a newline would start a new setting)
 * replaced, for the adapter file's one-line values. */
static void one_line(char *dst, size_t size, const char *s)
{
	size_t i = 0;

	for (; s[i] && i + 1 < size; i++)
		dst[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
	dst[i] = '\0';
}

int persist_save(struct daemon *d, const struct adapter_def *def, struct proto_err *err)
{
	char dir[PATH_MAX - 128], path[PATH_MAX], shown[sizeof def->body_file], text[2048];
	int n;

	if (reg_dir(d, dir, sizeof dir) != 0)
		return 0;
	if (mkdir(d->cfg.state_dir, 0700) != 0 && errno != EEXIST)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot create %s: %s",
		                  d->cfg.state_dir, strerror(errno));
	if (mkdir(dir, 0700) != 0 && errno != EEXIST)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot create %s: %s", dir,
		                  strerror(errno));
	snprintf(path, sizeof path, "%s/a.%s.py", dir, def->name);
	if (write_atomic(path, def->source, strlen(def->source)) != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot write %s: %s", path,
		                  strerror(errno));
	one_line(shown, sizeof shown, def->body_file);
	n = snprintf(text, sizeof text,
	             "# registered with torchloopd's register op; restored at start\n"
	             "name = %s\nbody = a.%s.py\nbody_file = %s\nentry = %s\nstrategy = %s\n"
	             "dynamic = %s\n"
	             "max_steps = %lld\nmax_elements = %lld\nrecompile_budget = %lld\n",
	             def->name, def->name, shown, def->entry, def->strategy, def->dynamic,
	             (long long)def->max_steps, (long long)def->max_elements,
	             (long long)def->budget);
	snprintf(path, sizeof path, "%s/a.%s.adapter", dir, def->name);
	if (n >= (int)sizeof text || write_atomic(path, text, (size_t)n) != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot write %s: %s", path,
		                  strerror(errno));
	return 0;
}

void persist_forget(struct daemon *d, const char *name, size_t len)
{
	char dir[PATH_MAX - 128], path[PATH_MAX];
	int n = len > ADAPTER_NAME_MAX ? ADAPTER_NAME_MAX : (int)len;

	if (reg_dir(d, dir, sizeof dir) != 0)
		return;
	snprintf(path, sizeof path, "%s/a.%.*s.adapter", dir, n, name);
	if (unlink(path) != 0 && errno != ENOENT)
		log_warn("cannot remove %s: %s", path, strerror(errno));
	snprintf(path, sizeof path, "%s/a.%.*s.py", dir, n, name);
	if (unlink(path) != 0 && errno != ENOENT)
		log_warn("cannot remove %s: %s", path, strerror(errno));
}

int persist_restore(struct daemon *d, void (*done)(struct daemon *d, int failed))
{
	char dir[PATH_MAX - 128];
	struct proto_err err;
	struct stat st;

	if (reg_dir(d, dir, sizeof dir) != 0 || stat(dir, &st) != 0) {
		done(d, 0);
		return 0;
	}
	if (cache_trusted_dir(d->cfg.state_dir, &err) != 0 || cache_trusted_dir(dir, &err) != 0) {
		log_error("not restoring registrations: %s", err.message);
		done(d, 1);
		return 0;
	}
	return registry_load_from(d, dir, ADAPTER_RESTORED, false, done);
}
