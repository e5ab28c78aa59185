/*
 * proctree.c - killing a process and everything it started, and reaping the
 * orphans the daemon adopts.
 *
 * A process group kill misses descendants that called setsid() (a compiler
 * driver, or a body's subprocess with start_new_session=True).  So the tree
 * is found from /proc (each process's parent) and every member is killed;
 * the walk repeats until a pass finds nothing new, so a child forked during
 * the kill is caught on the next pass.  The daemon is a child subreaper
 * (prctl PR_SET_CHILD_SUBREAPER, set at start), so a descendant whose
 * parent died first is re-parented to the daemon instead of init: those
 * are killed and reaped here too (libuv reaps only the pids it spawned).
 *
 * Loop thread (the /proc walk is a few hundred small reads).
 */
#include "proctree.h"

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROCTREE_MAX 4096

struct ptab {
	pid_t pid[PROCTREE_MAX], ppid[PROCTREE_MAX];
	size_t n;
};

/* The parent of pid from /proc/PID/stat (the field after the ')' of comm). */
static pid_t parent_of(pid_t pid)
{
	char path[64], buf[512], *p;
	FILE *f;
	size_t n;
	int ppid = -1;

	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	f = fopen(path, "re");
	if (f == NULL)
		return -1;
	n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = '\0';
	p = strrchr(buf, ')');
	if (p == NULL || sscanf(p + 1, " %*c %d", &ppid) != 1)
		return -1;
	return (pid_t)ppid;
}

static void snapshot(struct ptab *t)
{
	DIR *dir = opendir("/proc");
	struct dirent *e;

	t->n = 0;
	while (dir && (e = readdir(dir)) != NULL && t->n < PROCTREE_MAX) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		if (*end != '\0' || pid <= 0)
			continue;
		t->pid[t->n] = (pid_t)pid;
		t->ppid[t->n] = parent_of((pid_t)pid);
		t->n++;
	}
	if (dir)
		closedir(dir);
}

static bool listed(const pid_t *set, size_t n, pid_t pid)
{
	for (size_t i = 0; i < n; i++)
		if (set[i] == pid)
			return true;
	return false;
}

/* Adds every descendant of the pids in set (transitively); returns the new size. */
static size_t descendants(const struct ptab *t, pid_t *set, size_t n, size_t max)
{
	for (size_t i = 0; i < n; i++)
		for (size_t k = 0; k < t->n && n < max; k++)
			if (t->ppid[k] == set[i] && !listed(set, n, t->pid[k]))
				set[n++] = t->pid[k];
	return n;
}

size_t proctree_kill(pid_t root)
{
	return proctree_signal(root, SIGKILL);
}

size_t proctree_signal(pid_t root, int sig)
{
	static struct ptab t;
	pid_t set[PROCTREE_MAX];
	size_t n = 1, killed = 0;

	set[0] = root;
	kill(-root, sig); /* its process group, which catches most of it at once */
	for (int pass = 0; pass < 4; pass++) {
		size_t before = n;
		snapshot(&t);
		n = descendants(&t, set, n, PROCTREE_MAX);
		for (size_t i = 0; i < n; i++)
			if (kill(set[i], sig) == 0 && i >= before)
				killed++;
		if (n == before && pass > 0)
			break;
	}
	return killed;
}

size_t proctree_adopted(const pid_t *keep, size_t n_keep, pid_t *out, size_t max)
{
	static struct ptab t;
	pid_t self = getpid();
	size_t n = 0;

	snapshot(&t);
	for (size_t k = 0; k < t.n && n < max; k++)
		if (t.ppid[k] == self && !listed(keep, n_keep, t.pid[k]))
			out[n++] = t.pid[k];
	return n;
}

bool proctree_reap(pid_t pid)
{
	int status;
	pid_t r = waitpid(pid, &status, WNOHANG);

	return r == pid || r < 0; /* reaped, or not ours (ECHILD) */
}

int proctree_become_subreaper(void)
{
	return prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
}
