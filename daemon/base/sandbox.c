/*
 * sandbox.c - see sandbox.h.  Two users: the launcher (sandbox_enter, in the
 * process about to exec the worker: nothing here may allocate state that
 * outlives the exec) and the daemon's loop thread (sandbox_plan at start,
 * the scratch directories as workers come and go).
 *
 * Landlock's constants are spelled out here, not taken from
 * <linux/landlock.h>: the build machine's header may be older than the
 * kernel the daemon runs on, and the ABI is what the kernel says.
 */
#include "sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <ftw.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---- Landlock -------------------------------------------------------------- */

#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH      1
#define LL_FS_EXECUTE             (1ULL << 0)
#define LL_FS_WRITE_FILE          (1ULL << 1)
#define LL_FS_READ_FILE           (1ULL << 2)
#define LL_FS_READ_DIR            (1ULL << 3)
#define LL_FS_ABI1                ((1ULL << 13) - 1) /* EXECUTE .. MAKE_SYM */
#define LL_FS_REFER               (1ULL << 13)       /* ABI 2 */
#define LL_FS_TRUNCATE            (1ULL << 14)       /* ABI 3 */
#define LL_FS_IOCTL_DEV           (1ULL << 15)       /* ABI 5 */
#define LL_NET_BIND_TCP           (1ULL << 0)        /* ABI 4 */
#define LL_NET_CONNECT_TCP        (1ULL << 1)
#define LL_SCOPE_ABSTRACT_UNIX    (1ULL << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL           (1ULL << 1)

struct ll_ruleset_attr {
	uint64_t handled_fs, handled_net, scoped;
};

struct ll_path_beneath {
	uint64_t allowed;
	int32_t parent_fd;
} __attribute__((packed));

int sandbox_landlock_abi(void)
{
	long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);

	return abi < 0 ? 0 : (int)abi;
}

static uint64_t fs_rights(int abi)
{
	return LL_FS_ABI1 | (abi >= 2 ? LL_FS_REFER : 0) | (abi >= 3 ? LL_FS_TRUNCATE : 0) |
	       (abi >= 5 ? LL_FS_IOCTL_DEV : 0);
}

/* Allows access beneath path (a directory) or on it (a file: file rights only). */
static int allow(int ruleset, const char *path, uint64_t access, bool must_exist)
{
	struct stat st;
	struct ll_path_beneath pb;
	int fd = open(path, O_PATH | O_CLOEXEC), rc;

	if (fd < 0)
		return must_exist ? -1 : 0;
	if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode))
		access &= LL_FS_EXECUTE | LL_FS_WRITE_FILE | LL_FS_READ_FILE | LL_FS_TRUNCATE |
		          LL_FS_IOCTL_DEV;
	pb = (struct ll_path_beneath){.allowed = access, .parent_fd = fd};
	rc = (int)syscall(SYS_landlock_add_rule, ruleset, LL_RULE_PATH_BENEATH, &pb, 0);
	close(fd);
	return rc;
}

/* The devices a worker's Python, torch and compilers open for writing. */
static const char *const DEVICES[] = {"/dev/null",   "/dev/zero",    "/dev/full",
                                      "/dev/random", "/dev/urandom", "/dev/tty"};

/* ---- what a worker reads ---------------------------------------------------- */

const char *const SANDBOX_HIDDEN[] = {"/root",
                                      "/home",
                                      "/tmp",
                                      "/var/tmp",
                                      "/var/lib",
                                      "/var/cache",
                                      "/var/log",
                                      "/var/spool",
                                      "/var/mail",
                                      "/run",
                                      "/srv",
                                      "/mnt",
                                      "/media",
                                      "/dev/shm",
                                      "/etc/shadow",
                                      "/etc/shadow-",
                                      "/etc/gshadow",
                                      "/etc/gshadow-",
                                      "/etc/sudoers",
                                      "/etc/sudoers.d",
                                      "/etc/ssh",
                                      "/etc/ssl/private",
                                      NULL};

#define READ_RIGHTS (LL_FS_EXECUTE | LL_FS_READ_FILE | LL_FS_READ_DIR)
#define MAX_HIDDEN  (SANDBOX_MAX_PATHS + sizeof SANDBOX_HIDDEN / sizeof SANDBOX_HIDDEN[0])

struct hidden {
	char path[MAX_HIDDEN][PATH_MAX]; /* real paths of those that exist */
	size_t n;
	char failed[PATH_MAX]; /* the entry whose rule failed */
};

/* 1: path is hidden; 2: a hidden path lies beneath it; 0: neither. */
static int relation(const struct hidden *h, const char *path)
{
	size_t len = strlen(path);
	int r = 0;

	for (size_t i = 0; i < h->n; i++) {
		if (strcmp(h->path[i], path) == 0)
			return 1;
		if (strncmp(h->path[i], path, len) == 0 && h->path[i][len] == '/')
			r = 2;
	}
	return r;
}

/*
 * Read and execute beneath each entry of dir (a real path) but the hidden
 * ones; an entry that leads to a hidden path is opened up the same way one
 * level down.  Symbolic links get no rule of their own (a link an attacker
 * left in /tmp must not open its target): what they point to has its own.
 */
static int allow_but_hidden(int rs, const char *dir, struct hidden *h, int depth)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	struct stat st;
	char path[PATH_MAX];
	int rc = 0;

	if (d == NULL)
		return 0; /* not even we can list it: nothing beneath it is allowed */
	while (rc == 0 && (e = readdir(d)) != NULL) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 ||
		    snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name) >=
		        (int)sizeof path ||
		    lstat(path, &st) != 0 || S_ISLNK(st.st_mode))
			continue;
		switch (relation(h, path)) {
		case 0:
			rc = allow(rs, path, READ_RIGHTS, false);
			break;
		case 2:
			if (S_ISDIR(st.st_mode) && depth < 64)
				rc = allow_but_hidden(rs, path, h, depth + 1);
			break;
		}
		if (rc != 0) /* the report names it; errno is landlock_add_rule's */
			snprintf(h->failed, sizeof h->failed, "%s", path);
	}
	closedir(d);
	return rc;
}

static void add_hidden(struct hidden *h, const char *path)
{
	if (h->n < MAX_HIDDEN && realpath(path, h->path[h->n]) != NULL &&
	    strcmp(h->path[h->n], "/") != 0)
		h->n++;
}

/* Read rules: everything but the hidden paths, then the kept ones again. */
static const char *allow_reads(int rs, const struct sandbox_opts *o)
{
	static char failed_at[PATH_MAX];
	struct hidden *h = calloc(1, sizeof *h);
	char real[PATH_MAX];
	const char *failed = NULL;

	if (h == NULL)
		return "(out of memory)";
	for (const char *const *p = SANDBOX_HIDDEN; *p; p++)
		add_hidden(h, *p);
	for (size_t i = 0; i < o->n_hide; i++)
		add_hidden(h, o->hide[i]);
	if (allow_but_hidden(rs, "/", h, 0) != 0) {
		int e = errno;
		snprintf(failed_at, sizeof failed_at, "%s", h->failed);
		failed = failed_at;
		errno = e;
	}
	for (size_t i = 0; failed == NULL && i < o->n_keep; i++)
		if (realpath(o->keep[i], real) != NULL && allow(rs, real, READ_RIGHTS, true) != 0)
			failed = o->keep[i];
	free(h);
	return failed;
}

static int landlock(const struct sandbox_opts *o, int abi, char *why, size_t size)
{
	uint64_t fs = fs_rights(abi);
	struct ll_ruleset_attr attr = {
	    .handled_fs = fs,
	    .handled_net = abi >= 4 ? LL_NET_BIND_TCP | LL_NET_CONNECT_TCP : 0,
	    .scoped = abi >= 6 ? LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL : 0};
	size_t attr_size = abi >= 6 ? 24 : abi >= 4 ? 16 : 8;
	int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0);
	const char *failed = NULL;

	if (rs < 0)
		return snprintf(why, size, "landlock_create_ruleset: %s", strerror(errno)), -1;
	failed = allow_reads(rs, o);
	for (size_t i = 0; failed == NULL && i < o->n_write; i++)
		if (allow(rs, o->write[i], fs, true) != 0)
			failed = o->write[i];
	for (size_t i = 0; failed == NULL && i < sizeof DEVICES / sizeof DEVICES[0]; i++)
		if (allow(rs, DEVICES[i], fs & ~LL_FS_EXECUTE, false) != 0)
			failed = DEVICES[i];
	if (failed == NULL && syscall(SYS_landlock_restrict_self, rs, 0) != 0)
		failed = "(restrict_self)";
	if (failed)
		snprintf(why, size, "landlock rule %s: %s", failed, strerror(errno));
	close(rs);
	return failed ? -1 : 0;
}

/* ---- seccomp --------------------------------------------------------------- */

/* one instruction (the header's BPF_STMT/BPF_JUMP are initializers only) */
#define OP(code, k, jt, jf) ((struct sock_filter){(unsigned short)(code), jt, jf, (uint32_t)(k)})
#define DENY                OP(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA), 0, 0)
#define ALLOW               OP(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0)
#define LOAD(what)          OP(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, what), 0, 0)
/* the low 32 bits of argument i (little-endian) */
#define LOAD_ARG(i) LOAD(args[i])
#define IS(v, t, f) OP(BPF_JMP | BPF_JEQ | BPF_K, v, t, f)

/* Syscalls a worker never needs that reach outside it. */
static const int DENIED[] = {SYS_connect,
                             SYS_bind,
                             SYS_listen,
                             SYS_ptrace,
                             SYS_process_vm_readv,
                             SYS_process_vm_writev,
                             SYS_io_uring_setup,
                             SYS_io_uring_enter,
                             SYS_io_uring_register,
                             SYS_pidfd_getfd};

#define MAX_FILTER 64

/* kill/tkill/tgkill(the daemon or its group, or everyone) fail. */
static size_t signals(struct sock_filter *f, size_t n, uint32_t daemon)
{
	static const int calls[] = {SYS_kill, SYS_tkill, SYS_tgkill};

	for (size_t i = 0; i < 3; i++) {
		f[n++] = IS(calls[i], 0, 5);
		f[n++] = LOAD_ARG(0);
		f[n++] = IS(daemon, 2, 0);
		f[n++] = IS(-daemon, 1, 0);
		f[n++] = IS(-1, 0, 1);
		f[n++] = DENY;
		f[n++] = LOAD(nr);
	}
	return n;
}

static int seccomp(char *why, size_t size)
{
	struct sock_filter f[MAX_FILTER];
	struct sock_fprog prog;
	size_t n = 0;

	f[n++] = LOAD(arch);
	f[n++] = IS(AUDIT_ARCH_X86_64, 1, 0);
	f[n++] = DENY; /* another ABI's syscall numbers (int 0x80) */
	f[n++] = LOAD(nr);
	f[n++] = OP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1);
	f[n++] = DENY; /* x32 */
	for (size_t i = 0; i < sizeof DENIED / sizeof DENIED[0]; i++) {
		f[n++] = IS(DENIED[i], 0, 1);
		f[n++] = DENY;
	}
	n = signals(f, n, (uint32_t)getppid());
	/* socket(): AF_UNIX streams only (socketpair's pipes; nothing can be reached) */
	f[n++] = IS(SYS_socket, 0, 6);
	f[n++] = LOAD_ARG(0);
	f[n++] = IS(AF_UNIX, 0, 3);
	f[n++] = LOAD_ARG(1);
	f[n++] = OP(BPF_ALU | BPF_AND | BPF_K, 0xf, 0, 0);
	f[n++] = IS(SOCK_STREAM, 1, 0);
	f[n++] = DENY;
	f[n++] = ALLOW;
	prog = (struct sock_fprog){.len = (unsigned short)n, .filter = f};
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0)
		return snprintf(why, size, "seccomp: %s", strerror(errno)), -1;
	return 0;
}

/* Every descriptor but stdin, stdout and stderr (the worker's pipes). */
static void close_inherited(void)
{
	long max = sysconf(_SC_OPEN_MAX);

	if (syscall(SYS_close_range, 3U, ~0U, 0U) == 0)
		return;
	for (long fd = 3; fd < (max > 0 ? max : 65536); fd++)
		close((int)fd);
}

int sandbox_enter(const struct sandbox_opts *o, char *report, size_t size)
{
	int abi;

	close_inherited();
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
		return snprintf(report, size, "PR_SET_NO_NEW_PRIVS: %s", strerror(errno)), -1;
	abi = sandbox_landlock_abi();
	if (abi < 1)
		return snprintf(report, size, "no Landlock: %s", strerror(errno)), -1;
	if (landlock(o, abi, report, size) != 0 || seccomp(report, size) != 0)
		return -1;
	snprintf(report, size, "Landlock ABI %d (files%s%s) + seccomp", abi,
	         abi >= 4 ? ", TCP" : ", no TCP rules before ABI 4",
	         abi >= 6 ? ", signals and abstract sockets" : ", no scopes before ABI 6");
	return 0;
}

/* ---- the daemon's side ------------------------------------------------------ */

/* dir(of)/torchloopd-sandbox, if executable. */
static bool beside(const char *of, char *out, size_t size)
{
	const char *slash = strrchr(of, '/');
	int dir = slash ? (int)(slash - of + 1) : 0;

	return snprintf(out, size, "%.*s%s", dir, of, SANDBOX_LAUNCHER) < (int)size &&
	       access(out, X_OK) == 0;
}

int sandbox_plan(enum sandbox_mode mode, const char *worker, char *launcher, size_t launcher_size,
                 char *state, size_t state_size)
{
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
	int abi;

	if (mode == SANDBOX_OFF)
		return snprintf(state, state_size, "off (--worker-sandbox off)"), 0;
	abi = sandbox_landlock_abi();
	if (abi < 1)
		snprintf(state, state_size, "off (no Landlock in this kernel or unit: %s)",
		         strerror(errno));
	self[n > 0 ? n : 0] = '\0';
	if (abi >= 1 && !beside(worker, launcher, launcher_size) &&
	    !(n > 0 && beside(self, launcher, launcher_size)))
		snprintf(state, state_size, "off (no executable %s beside %s or the daemon)",
		         SANDBOX_LAUNCHER, worker);
	else if (abi >= 1)
		return snprintf(state, state_size, SANDBOX_ON), 1;
	return mode == SANDBOX_REQUIRED ? -1 : 0;
}

int sandbox_scratch_create(const char *tmp_root, unsigned n, char *out, size_t size)
{
	if (snprintf(out, size, "%s/w.%ld.%u", tmp_root, (long)getpid(), n) >= (int)size) {
		errno = ENAMETOOLONG;
		return -1;
	}
	if (mkdir(out, 0700) == 0)
		return 0;
	if (errno != EEXIST)
		return -1;
	sandbox_scratch_remove(out); /* a worker of this pid's before it */
	return mkdir(out, 0700);
}

static int remove_one(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	if (type == FTW_DP)
		rmdir(path);
	else
		unlink(path);
	return 0;
}

void sandbox_scratch_remove(const char *path)
{
	nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
}
