/* describe.h - writing an adapter's description (list, describe, stats). */
#ifndef TORCHLOOP_DESCRIBE_H
#define TORCHLOOP_DESCRIBE_H

#include "daemon.h"

/* Bounds, budget (and each uid's share of it), strategy: DESCRIBE_BOUNDS map
 * entries. */
void describe_bounds(struct writer *w, const struct adapter *a);
/* A map of the compile's phases (seconds; empty for a graph from the cache). */
void describe_phases(struct writer *w, const struct specialization *sp);
/* lowered, note, tier ("quick": the scan op's graph serves, "final"),
 * upgrading, graph_key and upgrade (the quick tier's plan and trial, or nil):
 * DESCRIBE_LOWERING keys. */
#define DESCRIBE_LOWERING 6
void describe_lowering(struct writer *w, const struct specialization *sp);
/* origin ("registered", "file", "restored") and persisted: 2 fields. */
void describe_origin(struct writer *w, const struct daemon *d, const struct adapter *a);
#define DESCRIBE_BOUNDS   11 /* map entries describe_bounds writes */
#define DESCRIBE_COUNTERS 20
/* Counters and run percentiles: DESCRIBE_COUNTERS map entries. */
void describe_counters(struct writer *w, const struct adapter *a);
/* The specializations held: one array. */
void describe_specs(struct writer *w, const struct adapter *a);

/* The compile service's lanes (compiler.h): a map of lane name -> its
 * workers, busy, queued, max, paused, jobs, preempted (with full; else the
 * first three). */
void describe_lanes(struct writer *w, const struct compiler *c, bool full);
/* The remote tier: "off", or its state, last error and counters (full). */
void describe_remote(struct writer *w, const struct remote *r, bool full);

#endif
