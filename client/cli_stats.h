/* cli_stats.h - how `torchloop stats` prints the daemon's stats (cli_stats.c). */
#ifndef TORCHLOOP_CLI_STATS_H
#define TORCHLOOP_CLI_STATS_H

#include <jansson.h>

/* One line per adapter: requests, errors, compiles, cache, budget, run p50/p99. */
void cli_print_stats_table(json_t *stats);
/* The Prometheus text format of the stats map. */
void cli_print_prometheus(json_t *stats);

#endif
