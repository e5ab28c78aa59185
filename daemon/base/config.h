/*
 * config.h - the daemon's settings: every limit is named here with its
 * min/default/max, parsed from flags, and printed by --help (and documented
 * in docs/operations.md).
 */
#ifndef TORCHLOOP_CONFIG_H
#define TORCHLOOP_CONFIG_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "sandbox.h"

#ifndef TORCHLOOPD_PREFIX
#define TORCHLOOPD_PREFIX "" /* the checkout or install it was built for (the Makefile) */
#endif
/* The build's own compile worker package (--worker's default is its
 * compile_worker.py): a sandboxed worker may read it whatever --worker names,
 * since a wrapper script imports it (compiler_sandbox.c). */
#define CONFIG_WORKER_DIR TORCHLOOPD_PREFIX "/daemon/worker"

/* --max-uids-per-adapter's largest value: what an adapter's budget table holds
 * (graphs.h, struct adapter's shares) */
#define CONFIG_MAX_UIDS_PER_ADAPTER 256

/* name, field, min, default, max, help */
#define CONFIG_LIMITS(X)                                                                           \
	X("max-frame", max_frame, PROTO_FRAME_MIN, PROTO_FRAME_DEFAULT, PROTO_FRAME_MAX,           \
	  "largest frame accepted or sent, in bytes")                                              \
	X("max-inflight", max_inflight, 1, 64, 4096, "requests one connection may have in flight") \
	X("write-queue-cap", write_queue_cap, 1LL << 20, 256LL << 20, 4LL << 30,                   \
	  "bytes (replies queued + frame being read) one client may hold before its reads pause")  \
	X("max-queued-memory", max_queued_memory, 16LL << 20, 1LL << 30, 64LL << 30,               \
	  "bytes all clients together may hold in queued replies and frames being read")           \
	X("max-connections", max_connections, 1, 1024, 65536, "concurrent client connections")     \
	X("max-connections-per-uid", max_conns_per_uid, 1, 256, 65536,                             \
	  "concurrent connections of one peer uid")                                                \
	X("idle-timeout", idle_timeout, 0, 3600, 86400,                                            \
	  "seconds a connection with nothing in flight may stay silent (0: forever)")              \
	X("frame-timeout", frame_timeout, 1, 30, 3600,                                             \
	  "seconds a partly received frame may go without a byte before the connection closes")    \
	X("compile-timeout", compile_timeout, 1, 600, 86400,                                       \
	  "seconds one compile may take, from when its worker is ready")                           \
	X("worker-start-timeout", worker_start_timeout, 1, 300, 86400,                             \
	  "seconds a compile worker may take to say hello, and to import the compile path once "   \
	  "it has a job")                                                                          \
	X("compile-workers", compile_workers, 0, 0, 16,                                            \
	  "compile workers for requests that wait (0: one per core, at most one per 1.5 GiB)")     \
	X("drain-timeout", drain_timeout, 0, 30, 3600,                                             \
	  "seconds to finish in-flight requests on SIGTERM")                                       \
	X("threads", threads, 0, 0, 128, "thread-pool size for graph runs (0: one per core)")      \
	X("pool-stall-timeout", pool_stall_timeout, 1, 60, 3600,                                   \
	  "seconds the thread pool may take to start a job before health reports it stalled")      \
	X("inline-run-us", inline_run_us, 0, 50, 100000,                                           \
	  "graphs measured at most this many microseconds run on the event loop (0: never)")       \
	X("busy-poll-us", busy_poll_us, 0, 50, 1000,                                               \
	  "microseconds the event loop polls for the next request before it sleeps, once every "   \
	  "request is answered (adaptive; 0 or one core: never)")                                  \
	X("quick-tier-steps", quick_tier_steps, 0, 32, 129,                                        \
	  "unrolled graphs of this many steps or more are served by the scan op's graph while "    \
	  "they compile (0 or 129: never)")                                                        \
	X("upgrade-budget", upgrade_budget, 0, 40, 86400,                                          \
	  "estimated seconds unrolling may add to a quick tier's upgrade compile; over it the "    \
	  "scan op runs blocks of unrolled steps (0: no limit, always the unrolled loop)")         \
	X("upgrade-keep-percent", upgrade_keep_percent, 1, 90, 100,                                \
	  "a quick tier's upgrade stays only if its median run is at most this percent of the "    \
	  "scan op's graph's; an adapter whose upgrade lost builds no more of that kind")          \
	X("max-graphs-per-uid", max_graphs_per_uid, 1, 64, 65536,                                  \
	  "captured-graph adapters one uid may hold (its least recently used one goes first)")     \
	X("max-failed-specs", max_failed_specs, 1, 64, 4096,                                       \
	  "failed specializations one adapter remembers (least recently used dropped first)")      \
	X("max-uids-per-adapter", max_uids_per_adapter, 1, 16, CONFIG_MAX_UIDS_PER_ADAPTER,        \
	  "uids besides its owner whose specializations one adapter holds (each uid spends its "   \
	  "own recompile_budget)")                                                                 \
	X("cache-max-bytes", cache_max_bytes, 0, 8LL << 30, 1LL << 42,                             \
	  "bytes the on-disk cache may hold; over it the least recently used artifacts no daemon " \
	  "has loaded go first (0: no cap)")                                                       \
	X("max-shm", max_shm, 0, 1LL << 30, 64LL << 30,                                            \
	  "bytes of shared memory one connection may attach (0: attach refused)")                  \
	X("max-shm-total", max_shm_total, 0, 16LL << 30, 1LL << 40,                                \
	  "bytes of shared memory all connections together may attach")                            \
	X("remote-timeout", remote_timeout, 10, 2000, 60000,                                       \
	  "milliseconds one remote-cache command may take before the daemon compiles locally")     \
	X("remote-max-object", remote_max_object, 1LL << 20, 64LL << 20, 1LL << 30,                \
	  "bytes of the largest artifact fetched from or published to the remote cache")           \
	X("remote-ttl", remote_ttl, 60, 604800, 31536000,                                          \
	  "seconds a published artifact stays in the remote cache")                                \
	X("remote-lease-ms", remote_lease_ms, 500, 20000, 600000,                                  \
	  "milliseconds a node's compile lease lasts (renewed while it compiles); another node "   \
	  "takes an expired one over")

/* What compiled graphs are generated for (--target-isa): the host's own CPU,
 * or a fixed x86-64 level that runs on other machines and under valgrind. */
enum target_isa { ISA_NATIVE, ISA_AVX2, ISA_BASELINE };

struct config {
#define CONFIG_X_FIELD(name, field, min, def, max, help) long long field;
	CONFIG_LIMITS(CONFIG_X_FIELD)
#undef CONFIG_X_FIELD
	char socket_path[PATH_MAX];
	char cache_dir[PATH_MAX];
	char adapters_dir[PATH_MAX];
	char state_dir[PATH_MAX]; /* persisted registrations; "" = none */
	char python[PATH_MAX];
	char worker[PATH_MAX];
	char admin_group[64];
	/* the remote cache tier (daemon/base/remote.h): "" = off */
	char remote_url[PATH_MAX];
	char remote_secret_file[PATH_MAX];
	char remote_auth_file[PATH_MAX];
	gid_t admin_gid;
	bool has_admin_gid;
	bool probe;
	int log_level;
	unsigned socket_mode;
	int omp_threads; /* OpenMP team per run when every pool thread runs one */
	int cores;       /* online CPUs at start */
	enum target_isa target_isa;
	enum sandbox_mode worker_sandbox; /* --worker-sandbox */
};

/*
 * Fills cfg from defaults, the environment and argv.  Returns 0 to run, 1
 * when --help/--version was printed, -1 after printing a usage error.
 */
int config_parse(struct config *cfg, int argc, char **argv);

#endif
