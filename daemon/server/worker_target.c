/*
 * worker_target.c - what the compile workers build for, part of every cache
 * key: the CPU's ISA flags (or --target-isa's target), the environment that
 * makes Inductor generate for it, and the digest of the worker's code.
 * Loop thread, at start.
 */
#include "daemon.h"

#include "log.h"
#include "sha256.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/*
 * The ISA flags -march=native specialises code for: part of every cache key
 * (with --target-isa avx2/baseline, only the target's name).  Returns -1
 * when the target needs what this CPU lacks.
 */
static int read_isa(struct daemon *d)
{
	static const char *const flags[] = {" avx2",        " avx512f",  " avx512bw", " avx512vl",
	                                    " avx512_bf16", " amx_tile", " fma",      " sve"};
	FILE *f = fopen("/proc/cpuinfo", "re");
	char line[8192], host[128] = "";
	bool avx2 = false;

	while (f && fgets(line, sizeof line, f)) {
		if (strncmp(line, "flags", 5) != 0)
			continue;
		for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
			char pat[32];
			snprintf(pat, sizeof pat, "%s ", flags[i]);
			if (strstr(line, pat))
				strncat(host, flags[i], sizeof host - strlen(host) - 1);
		}
		avx2 = strstr(line, " avx2 ") != NULL;
		break;
	}
	if (f)
		fclose(f);
	switch (d->cfg.target_isa) {
	case ISA_NATIVE:
		snprintf(d->isa, sizeof d->isa, "isa:%s", host);
		return 0;
	case ISA_AVX2:
		snprintf(d->isa, sizeof d->isa, "isa:target=avx2");
		if (!avx2)
			log_error("--target-isa avx2: this CPU has no AVX2");
		return avx2 ? 0 : -1;
	case ISA_BASELINE:
		snprintf(d->isa, sizeof d->isa, "isa:target=baseline");
		return 0;
	}
	return 0;
}

/* Environment that makes Inductor generate code for --target-isa. */
static const char *const *target_env(enum target_isa isa)
{
	static const char *const avx2[] = {"TORCHINDUCTOR_CPP_MARCH=haswell",
	                                   "ATEN_CPU_CAPABILITY=avx2", NULL};
	static const char *const baseline[] = {"TORCHINDUCTOR_CPP_MARCH=x86-64",
	                                       "ATEN_CPU_CAPABILITY=default", NULL};

	return isa == ISA_AVX2 ? avx2 : isa == ISA_BASELINE ? baseline : NULL;
}

/* The worker's package beside its script (install copies it with it). */
#define WORKER_PACKAGE "torchloop_worker"
#define MAX_MODULES    64

static int is_module(const struct dirent *e)
{
	size_t n = strlen(e->d_name);

	return n > 3 && strcmp(e->d_name + n - 3, ".py") == 0 && e->d_name[0] != '.';
}

/*
 * The worker's part of every cache key: its script and every module of its
 * package, in name order (they decide what a graph compiles to; a stand-in
 * worker of the tests has no package beside it).
 */
static int worker_digest(struct daemon *d)
{
	static char paths[MAX_MODULES][PATH_MAX];
	const char *files[1 + MAX_MODULES] = {d->cfg.worker};
	const char *slash = strrchr(d->cfg.worker, '/');
	int dir = slash ? (int)(slash - d->cfg.worker + 1) : 0, n = 0, rc = -1;
	char pkg[PATH_MAX];
	struct dirent **names = NULL;

	if (snprintf(pkg, sizeof pkg, "%.*s" WORKER_PACKAGE, dir, d->cfg.worker) >= (int)sizeof pkg)
		goto out;
	n = scandir(pkg, &names, is_module, alphasort);
	if (n < 0 && errno != ENOENT)
		goto out;
	if (n > MAX_MODULES) {
		log_error("compile worker package %s: %d modules, at most %d", pkg, n, MAX_MODULES);
		goto out;
	}
	for (int i = 0; i < n; i++) {
		if (snprintf(paths[i], sizeof paths[i], "%s/%s", pkg, names[i]->d_name) >=
		    (int)sizeof paths[i])
			goto out;
		files[1 + i] = paths[i];
	}
	if (access(d->cfg.worker, R_OK) == 0 &&
	    sha256_files(files, 1 + (n > 0 ? n : 0), d->worker_sha) == 0)
		rc = 0;
out:
	for (int i = 0; i < n; i++)
		free(names[i]);
	free(names);
	if (rc != 0)
		log_error("compile worker %s: cannot read it (or its package %s)", d->cfg.worker,
		          WORKER_PACKAGE);
	return rc;
}

/*
 * The workers' environment beyond the allow-list: the target's, and
 * Inductor's own cache (its precompiled headers, ~150 MB each, take seconds
 * to build) in the cache directory, so it outlives a restart (PrivateTmp
 * gives every start a new /tmp) -- unless the environment names one.
 */
const char *const *worker_target_env(struct daemon *d)
{
	const char *const *target = target_env(d->cfg.target_isa);
	size_t n = 0;

	for (; target && *target; target++)
		d->worker_env[n++] = *target;
	if (getenv("TORCHINDUCTOR_CACHE_DIR") == NULL) {
		snprintf(d->inductor_dir_env, sizeof d->inductor_dir_env,
		         "TORCHINDUCTOR_CACHE_DIR=%s/inductor", d->cfg.cache_dir);
		d->worker_env[n++] = d->inductor_dir_env;
	}
	d->worker_env[n] = NULL;
	return d->worker_env;
}

/*
 * What a sandboxed worker may not read besides the system's (SANDBOX_HIDDEN):
 * the cache (but its scratch and Inductor's directory, which it writes), the
 * registrations (state directory, adapter files), the remote tier's secrets
 * and the daemon's home.
 */
const char *const *worker_target_hidden(struct daemon *d)
{
	const char *const mine[] = {d->cfg.cache_dir,        d->cfg.state_dir,
	                            d->cfg.adapters_dir,     d->cfg.remote_secret_file,
	                            d->cfg.remote_auth_file, getenv("HOME")};
	size_t n = 0;

	for (size_t i = 0; i < sizeof mine / sizeof mine[0]; i++)
		if (mine[i] && mine[i][0])
			d->worker_hidden[n++] = mine[i];
	d->worker_hidden[n] = NULL;
	return d->worker_hidden;
}

int worker_target_open(struct daemon *d)
{
	return read_isa(d) != 0 || worker_digest(d) != 0 ? -1 : 0;
}
