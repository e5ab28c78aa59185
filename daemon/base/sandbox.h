/*
 * sandbox.h - the compile worker's sandbox (docs/operations.md, "Security
 * model").  A worker handles graphs from any user on the socket, so it runs
 * behind a small launcher (torchloopd-sandbox, sandbox_main.c) that, before
 * it execs the interpreter, closes every inherited descriptor but 0-2, sets
 * no_new_privs, applies a Landlock ruleset (read and execute everywhere but
 * the hidden paths -- the daemon's cache, state and secrets, homes, /tmp,
 * SANDBOX_HIDDEN -- except what it keeps: the interpreter's prefix, the
 * worker's package; write, create and remove only beneath its scratch
 * directory, Inductor's cache directory and a few device files; no TCP
 * bind/connect; no abstract
 * unix socket or signal outside its domain) and a seccomp filter (no
 * connect, bind, listen, ptrace, process_vm_*, io_uring, sockets but
 * AF_UNIX streams, signals to the daemon).  Each works with what the kernel
 * has: Landlock features by ABI.
 *
 * The daemon's side: whether workers are sandboxed (--worker-sandbox), the
 * launcher's path, and each worker's scratch directory under <cache>/tmp
 * (created before it starts, removed when it is gone).
 */
#ifndef TORCHLOOP_SANDBOX_H
#define TORCHLOOP_SANDBOX_H

#include <stddef.h>

enum sandbox_mode { SANDBOX_AUTO, SANDBOX_REQUIRED, SANDBOX_OFF };

#define SANDBOX_LAUNCHER  "torchloopd-sandbox"
#define SANDBOX_MAX_WRITE 8
#define SANDBOX_MAX_PATHS 16 /* --hide and --keep paths, each */
/* health's and stats' "sandbox" when workers run in it */
#define SANDBOX_ON "landlock+seccomp"

/* The running kernel's Landlock ABI (0: none, errno says why). */
int sandbox_landlock_abi(void);

/* ---- the launcher -------------------------------------------------------- */

/* What no worker reads, whoever runs it (besides the launcher's --hide):
 * homes, shared temporary directories, service state, credentials.
 * NULL-terminated. */
extern const char *const SANDBOX_HIDDEN[];

struct sandbox_opts {
	const char *write[SANDBOX_MAX_WRITE]; /* [0] is the scratch directory */
	size_t n_write;
	/* no read beneath these (nor SANDBOX_HIDDEN) ... */
	const char *hide[SANDBOX_MAX_PATHS];
	size_t n_hide;
	/* ... but beneath these (and the write directories) again */
	const char *keep[SANDBOX_MAX_PATHS];
	size_t n_keep;
};

/*
 * Confines the calling process as above (for good: only an exec follows).
 * Returns 0 with what was applied in report, or -1 with why in report.
 */
int sandbox_enter(const struct sandbox_opts *o, char *report, size_t size);

/* ---- the daemon ---------------------------------------------------------- */

/*
 * Decides for mode: 1 when workers run in the sandbox (launcher filled: the
 * torchloopd-sandbox beside worker, else beside the daemon's executable),
 * 0 when they run without it (state says why), -1 when mode is required
 * and the sandbox cannot be had (state says why).
 */
int sandbox_plan(enum sandbox_mode mode, const char *worker, char *launcher, size_t launcher_size,
                 char *state, size_t state_size);
/* Creates <tmp_root>/w.<daemon pid>.<n> (mode 0700) in out; 0 or -1 (errno). */
int sandbox_scratch_create(const char *tmp_root, unsigned n, char *out, size_t size);
/* Removes a scratch directory and everything in it (never following links). */
void sandbox_scratch_remove(const char *path);

#endif
