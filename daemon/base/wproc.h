/*
 * wproc.h - one compile worker process: uv_spawn'd in its own session and
 * process group, stdin and stdout pipes carrying proto frames, stderr shared
 * with the daemon's log.  It knows nothing of jobs or lanes (compiler.c):
 * it sends frames, hands up the frames it reads, and says when the process
 * is gone.  Loop thread only.
 *
 * Lifetime: wproc_spawn returns it running; after ops->exited has run (the
 * process is reaped) it closes its handles and frees itself, then calls
 * ops->closed.  Nothing may use it after exited returns.
 */
#ifndef TORCHLOOP_WPROC_H
#define TORCHLOOP_WPROC_H

#include "msg.h"
#include "writer.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

struct wproc;

struct wproc_ops {
	/* a parsed frame from the worker (the caller destroys nothing) */
	void (*reply)(struct wproc *p, const struct msg *m);
	/* the worker broke the framing: it is being killed (exited follows) */
	void (*broken)(struct wproc *p, const char *why);
	/* the process is gone: "exited with status N" or "was killed by signal N" */
	void (*exited)(struct wproc *p, const char *how);
	/* every handle closed; p is freed */
	void (*closed)(void *data);
};

struct wproc_opts {
	const char *python, *script;
	char **env;
	int nice; /* added to the worker's nice value (its children inherit it) */
	/* the sandbox's launcher (sandbox.h) put in front of the interpreter, or
	 * NULL; scratch is the worker's own directory, write the others it may
	 * write (NULL-terminated) */
	const char *sandbox, *scratch;
	const char *const *write;
	/* paths it may not read, and paths beneath those it may (NULL-terminated) */
	const char *const *hide, *const *keep;
	/* "NAME=value" replacing NAME in env for this worker, or NULL */
	const char *env_set;
};

/* The workers' environment (allow-listed, then extra): calloc'ed, free it. */
char **wproc_env(const char *const *extra);
/* Starts a worker; NULL with *uv_err (a libuv code) when it cannot be spawned. */
struct wproc *wproc_spawn(uv_loop_t *loop, const struct wproc_opts *o, const struct wproc_ops *ops,
                          void *data, int *uv_err);
void *wproc_data(const struct wproc *p);
pid_t wproc_pid(const struct wproc *p);
/* Its scratch directory (wproc_opts), removed once the process is gone; or "". */
const char *wproc_scratch(const struct wproc *p);
/* A writer to build one message in (NULL: out of memory); wproc_send takes it. */
struct writer *wproc_begin(void);
/* Sends the message built in w and frees w (p NULL: just frees it); -1 if not sent. */
int wproc_send(struct wproc *p, struct writer *w);
/* SIGKILLs its tree (setsid'd descendants too); returns how many beyond itself. */
size_t wproc_kill(struct wproc *p);
/* Killed on purpose: its exit is expected. */
bool wproc_killed(const struct wproc *p);
/* SIGSTOP (stop) or SIGCONT its whole tree: a paused background compile. */
void wproc_pause(struct wproc *p, bool stop);

#endif
