/*
 * graphs.h - the graph layer: an adapter's specializations (signature ->
 * compiled graph), found or built once (single flight, budget, cache, warm-
 * start index).  It knows callers only as waiters: a request of the server
 * layer, the start-up probe or a unit test wait the same way, and nothing
 * here sees a connection or a request.  See graphs.c.  Loop thread.
 */
#ifndef TORCHLOOP_GRAPHS_H
#define TORCHLOOP_GRAPHS_H

#include "protocol.h"
#include "tree.h"

#include <stdbool.h>
#include <stdint.h>

struct adapter;
struct daemon;
struct specialization;

/* What a request asks to run: its trees, dtype, T, batch and kind. */
struct scan_args {
	const struct tree_node *carry, *inputs;
	enum proto_dtype dtype;
	int64_t steps;
	int64_t batch; /* dynamic = batch adapters: the request's batch size (>= 1); else 0 */
	bool grad;
};

/*
 * One caller of graphs_acquire.  The caller owns it and keeps it alive until
 * done has been called (exactly once).  done gets the READY specialization
 * (referenced for the call) or, with sp NULL, why there is none.  event, if
 * set, hears "compiling" when a compile starts and "progress" every 2 s.
 */
struct graph_waiter {
	struct graph_waiter *next; /* the specialization's list (graphs.c) */
	void (*done)(struct graph_waiter *w, struct specialization *sp,
	             const struct proto_err *err);
	void (*event)(struct graph_waiter *w, const char *event, const struct specialization *sp,
	              double elapsed);
};

/* Finds or starts the specialization of args for a; w->done runs when it can
 * run (maybe before this returns) or cannot. */
void graphs_acquire(struct daemon *d, struct adapter *a, const struct scan_args *args,
                    struct graph_waiter *w);
void graphs_ref(struct specialization *sp);
void graphs_unref(struct specialization *sp);
void graphs_drop_all(struct adapter *a);
/*
 * Stacked outputs within max_elements at this batch size (the specialization's
 * own for a static one); -1 with TOO_MANY_ELEMENTS and the leaf's path.
 */
int graphs_check_outputs(const struct specialization *sp, int64_t batch, struct proto_err *err);
/* A READY graph proved wrong (outputs off its signature): drop it and
 * quarantine its cache entry, so the next request rebuilds it. */
void graphs_invalidate(struct daemon *d, struct specialization *sp, const char *why);
/* Loads a's specializations listed in the cache's index; done(d) per load. */
unsigned graphs_prewarm(struct daemon *d, struct adapter *a, void (*done)(struct daemon *d));
unsigned graphs_loaded(const struct daemon *d);
/* The warm-start index file of a's identity (name, body, bounds, strategy). */
void graphs_index_path(const struct daemon *d, const struct adapter *a, char *out, size_t size);

#endif
