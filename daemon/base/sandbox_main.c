/*
 * sandbox_main.c - torchloopd-sandbox, the compile worker's launcher:
 *
 *   torchloopd-sandbox --scratch DIR [--write DIR]... [--hide PATH]...
 *                      [--keep PATH]... -- PROGRAM ARGS...
 *
 * confines itself (sandbox_enter: descriptors, no_new_privs, Landlock,
 * seccomp; no read beneath the --hide paths and SANDBOX_HIDDEN, except
 * beneath the --keep and --write ones), points TMPDIR at DIR, says on
 * stderr what it applied, and execs PROGRAM.  It exits 126 without running
 * PROGRAM when any of that fails: a worker never runs half-confined.  The
 * daemon puts it in front of the worker's argv (wproc.c); it is useful alone
 * to try the sandbox by hand.
 */
#include "sandbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int usage(void)
{
	fprintf(stderr, "usage: " SANDBOX_LAUNCHER
	                " --scratch DIR [--write DIR]... [--hide PATH]... [--keep PATH]... -- "
	                "PROGRAM [ARGS...]\n");
	return 126;
}

int main(int argc, char **argv)
{
	struct sandbox_opts o = {.n_write = 1};
	char report[256];
	int i = 1;

	for (; i + 1 < argc && strcmp(argv[i], "--") != 0; i += 2) {
		if (strcmp(argv[i], "--scratch") == 0)
			o.write[0] = argv[i + 1];
		else if (strcmp(argv[i], "--write") == 0 && o.n_write < SANDBOX_MAX_WRITE)
			o.write[o.n_write++] = argv[i + 1];
		else if (strcmp(argv[i], "--hide") == 0 && o.n_hide < SANDBOX_MAX_PATHS)
			o.hide[o.n_hide++] = argv[i + 1];
		else if (strcmp(argv[i], "--keep") == 0 && o.n_keep < SANDBOX_MAX_PATHS)
			o.keep[o.n_keep++] = argv[i + 1];
		else
			return usage();
		/* Inductor's cache may not exist yet: a rule needs the directory */
		if (strcmp(argv[i], "--write") == 0)
			mkdir(argv[i + 1], 0700);
	}
	if (o.write[0] == NULL || i + 1 >= argc || strcmp(argv[i], "--") != 0)
		return usage();
	if (sandbox_enter(&o, report, sizeof report) != 0) {
		fprintf(stderr, SANDBOX_LAUNCHER ": cannot confine the worker: %s\n", report);
		return 126;
	}
	setenv("TMPDIR", o.write[0], 1);
	fprintf(stderr,
	        SANDBOX_LAUNCHER ": %s; writes only beneath %s and %zu other dir(s); reads all "
	                         "but %zu hidden path(s) and the system's, %zu kept\n",
	        report, o.write[0], o.n_write - 1, o.n_hide, o.n_keep);
	execvp(argv[i + 1], argv + i + 1);
	fprintf(stderr, SANDBOX_LAUNCHER ": cannot run %s\n", argv[i + 1]);
	return 126;
}
