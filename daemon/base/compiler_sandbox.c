/*
 * compiler_sandbox.c - what a compile worker is confined to (sandbox.h) and
 * whose jobs it runs (compiler.h "Tenants"): the paths it may not read and
 * those it keeps beneath them, and a tenant's own Inductor cache.  Shared by
 * compiler_workers.c through compiler_pool.h; nothing here starts a process.
 */
#include "compiler_pool.h"

#include "config.h"
#include "log.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* path's parent into out ("" when it has none) */
static void parent_of(const char *path, char *out, size_t size)
{
	const char *slash = strrchr(path, '/');

	snprintf(out, size, "%.*s", slash && slash != path ? (int)(slash - path) : 0, path);
}

/* name as the worker's spawn finds it: itself with a '/', else on $PATH */
static void which(const char *name, char *out, size_t size)
{
	const char *path = getenv("PATH");

	snprintf(out, size, "%s", name);
	while (strchr(name, '/') == NULL && path && *path) {
		size_t len = strcspn(path, ":");
		if (snprintf(out, size, "%.*s/%s", (int)len, path, name) < (int)size &&
		    access(out, X_OK) == 0)
			return;
		path += len + (path[len] == ':');
		snprintf(out, size, "%s", name);
	}
}

/*
 * What workers may not read (the daemon's, as many as the launcher takes),
 * and what they keep beneath it: the interpreter's prefix (as named: a
 * virtual environment's; and as resolved), the worker's directory (--worker)
 * and the build's own worker package (a wrapper named by --worker imports it).
 */
static void sandbox_paths(struct compiler *c, const struct compiler_opts *opts)
{
	char python[1024], bin[1024], real[PATH_MAX];
	size_t n = 0;

	for (const char *const *h = opts->hide;
	     h && *h && n + 1 < sizeof c->hide / sizeof c->hide[0]; h++)
		if (**h)
			c->hide[n++] = *h;
	c->hide[n] = NULL;
	which(opts->python, python, sizeof python);
	parent_of(python, bin, sizeof bin);
	parent_of(bin, c->kept[0], sizeof c->kept[0]);
	if (realpath(python, real) != NULL) {
		parent_of(real, bin, sizeof bin);
		parent_of(bin, c->kept[1], sizeof c->kept[1]);
	}
	parent_of(opts->script, c->kept[2], sizeof c->kept[2]);
	snprintf(c->kept[3], sizeof c->kept[3], "%s", CONFIG_WORKER_DIR);
	n = 0;
	for (size_t i = 0; i < 4; i++)
		if (c->kept[i][0])
			c->keep[n++] = c->kept[i];
	c->keep[n] = NULL;
	c->wopts.hide = c->hide;
	c->wopts.keep = c->keep;
}

/*
 * Whether workers run in the sandbox (sandbox_plan), said loudly when they
 * do not; -1 when it is required and cannot be had.
 */
int pool_sandbox_init(struct compiler *c, const struct compiler_opts *opts)
{
	int on = sandbox_plan(opts->sandbox, opts->script, c->launcher, sizeof c->launcher,
	                      c->sandbox, sizeof c->sandbox);

	snprintf(c->scratch_root, sizeof c->scratch_root, "%s", opts->scratch_root);
	snprintf(c->inductor_dir, sizeof c->inductor_dir, "%s", opts->inductor_dir);
	c->write[0] = c->inductor_dir;
	c->wopts.write = c->write;
	sandbox_paths(c, opts);
	if (on < 0) {
		log_error("--worker-sandbox required, but the compile workers' sandbox is %s",
		          c->sandbox);
		return -1;
	}
	if (on == 0) {
		c->launcher[0] = '\0';
		log_error("compile workers run WITHOUT their sandbox: %s; a hostile graph that "
		          "subverts one can write the cache and reach other sockets",
		          c->sandbox);
	} else {
		log_info("compile workers run in the sandbox (%s, %s)", SANDBOX_ON, c->launcher);
		c->wopts.sandbox = c->launcher;
	}
	return 0;
}

const char *compiler_sandbox(const struct compiler *c)
{
	return c->sandbox;
}

/*
 * A tenant's worker (compiler.h "Tenants") writes <cache>/tenants/<uid>/
 * inductor, its TORCHINDUCTOR_CACHE_DIR, and may not read the daemon's
 * Inductor cache (nor, the cache being hidden, the other tenants').
 */
int pool_tenant_opts(struct compiler *c, uint32_t tenant, struct wproc_opts *o,
                     struct pool_tenant *t)
{
	char cache[1024];
	size_t n = 0;

	if (tenant == 0)
		return 0;
	parent_of(c->scratch_root, cache, sizeof cache);
	snprintf(t->dir, sizeof t->dir, "%s/tenants", cache);
	mkdir(t->dir, 0700);
	snprintf(t->dir, sizeof t->dir, "%s/tenants/%u", cache, tenant);
	if (mkdir(t->dir, 0700) != 0 && errno != EEXIST)
		return -1;
	snprintf(t->dir, sizeof t->dir, "%s/tenants/%u/inductor", cache, tenant);
	snprintf(t->env, sizeof t->env, "TORCHINDUCTOR_CACHE_DIR=%s", t->dir);
	t->write[0] = t->dir;
	t->write[1] = NULL;
	for (const char *const *h = c->hide; *h; h++)
		t->hide[n++] = *h;
	t->hide[n++] = c->inductor_dir;
	t->hide[n] = NULL;
	o->write = t->write;
	o->hide = t->hide;
	o->env_set = t->env;
	return 0;
}

uint32_t compiler_tenant(uid_t uid)
{
	return uid == 0 || uid == geteuid() ? 0 : (uint32_t)uid;
}
