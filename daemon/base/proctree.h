/*
 * proctree.h - kill a process tree (setsid'd descendants included) and reap
 * the orphans the daemon adopts as a child subreaper.  See proctree.c.
 */
#ifndef TORCHLOOP_PROCTREE_H
#define TORCHLOOP_PROCTREE_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* SIGKILLs root's process group and every descendant; returns how many
 * descendants outside root itself were signalled. */
size_t proctree_kill(pid_t root);
/* As proctree_kill with any signal (SIGSTOP / SIGCONT pause a tree). */
size_t proctree_signal(pid_t root, int sig);
/* The daemon's children other than keep[0..n_keep) (orphans re-parented to it). */
size_t proctree_adopted(const pid_t *keep, size_t n_keep, pid_t *out, size_t max);
/* waitpid(pid, WNOHANG): true once pid is reaped (or is not our child). */
bool proctree_reap(pid_t pid);
/* prctl(PR_SET_CHILD_SUBREAPER): 0 or -1. */
int proctree_become_subreaper(void);

#endif
