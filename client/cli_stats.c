/*
 * cli_stats.c - `torchloop stats`: the per-adapter table, and the Prometheus
 * text exposition (--prometheus).
 */
#include "cli_stats.h"

#include <stdio.h>
#include <string.h>

void cli_print_stats_table(json_t *j)
{
	json_t *a;
	size_t i;

	printf("%-24s %9s %7s %8s %9s %6s %6s %9s %10s %10s\n", "adapter", "requests", "errors",
	       "compiles", "compile_s", "hits", "misses", "budget", "p50_us", "p99_us");
	json_array_foreach(json_object_get(j, "adapters"), i, a)
	{
		char budget[32];
		snprintf(budget, sizeof budget, "%lld/%lld",
		         (long long)json_integer_value(json_object_get(a, "budget_used")),
		         (long long)json_integer_value(json_object_get(a, "recompile_budget")));
		printf("%-24s %9lld %7lld %8lld %9.1f %6lld %6lld %9s %10.1f %10.1f\n",
		       json_string_value(json_object_get(a, "name")),
		       (long long)json_integer_value(json_object_get(a, "requests")),
		       (long long)json_integer_value(json_object_get(a, "errors")),
		       (long long)json_integer_value(json_object_get(a, "compiles")),
		       json_number_value(json_object_get(a, "compile_seconds")),
		       (long long)json_integer_value(json_object_get(a, "cache_hits")),
		       (long long)json_integer_value(json_object_get(a, "cache_misses")), budget,
		       json_number_value(json_object_get(a, "run_p50_us")),
		       json_number_value(json_object_get(a, "run_p99_us")));
	}
}

/* The remote tier's counters (stats' "remote" map: every integer is one). */
static void print_prometheus_remote(json_t *remote)
{
	const char *key, *state = json_string_value(json_object_get(remote, "state"));
	json_t *v;

	if (!json_is_object(remote))
		return;
	printf("# TYPE torchloopd_remote_degraded gauge\ntorchloopd_remote_degraded %d\n",
	       state != NULL && strcmp(state, "degraded") == 0);
	json_object_foreach(remote, key, v)
	{
		if (!json_is_integer(v))
			continue;
		printf(
		    "# TYPE torchloopd_remote_%s_total counter\ntorchloopd_remote_%s_total %lld\n",
		    key, key, (long long)json_integer_value(v));
	}
}

/* A per-adapter summary of run times: <prefix>_p50_us and _p99_us. */
static void print_run_summary(json_t *j, const char *metric, const char *prefix)
{
	char p50[48], p99[48];
	json_t *a;
	size_t i;

	snprintf(p50, sizeof p50, "%s_p50_us", prefix);
	snprintf(p99, sizeof p99, "%s_p99_us", prefix);
	printf("# TYPE torchloopd_adapter_%s_microseconds summary\n", metric);
	json_array_foreach(json_object_get(j, "adapters"), i, a)
	{
		const char *n = json_string_value(json_object_get(a, "name"));
		printf("torchloopd_adapter_%s_microseconds{adapter=\"%s\",quantile=\"0.5\"} %.1f\n",
		       metric, n, json_number_value(json_object_get(a, p50)));
		printf(
		    "torchloopd_adapter_%s_microseconds{adapter=\"%s\",quantile=\"0.99\"} %.1f\n",
		    metric, n, json_number_value(json_object_get(a, p99)));
	}
}

void cli_print_prometheus(json_t *j)
{
	static const char *const counters[] = {
	    "requests",         "errors",        "compiles",         "cache_hits",
	    "cache_misses",     "runs",          "local_runs",       "upgrades_started",
	    "upgrades_skipped", "upgrades_kept", "upgrades_reverted"};
	json_t *a;
	size_t i;

	printf("# TYPE torchloopd_uptime_seconds gauge\ntorchloopd_uptime_seconds %.3f\n",
	       json_number_value(json_object_get(j, "uptime")));
	printf("# TYPE torchloopd_connections_total counter\ntorchloopd_connections_total %lld\n",
	       (long long)json_integer_value(json_object_get(j, "connections")));
	for (size_t k = 0; k < sizeof counters / sizeof counters[0]; k++) {
		printf("# TYPE torchloopd_adapter_%s_total counter\n", counters[k]);
		json_array_foreach(json_object_get(j, "adapters"), i, a)
		    printf("torchloopd_adapter_%s_total{adapter=\"%s\"} %lld\n", counters[k],
		           json_string_value(json_object_get(a, "name")),
		           (long long)json_integer_value(json_object_get(a, counters[k])));
	}
	print_prometheus_remote(json_object_get(j, "remote"));
	printf("# TYPE torchloopd_adapter_compile_seconds_total counter\n");
	json_array_foreach(json_object_get(j, "adapters"), i, a)
	    printf("torchloopd_adapter_compile_seconds_total{adapter=\"%s\"} %.3f\n",
	           json_string_value(json_object_get(a, "name")),
	           json_number_value(json_object_get(a, "compile_seconds")));
	print_run_summary(j, "run", "run");
	/* runs clients made in their own processes (run="local"), as they report them */
	print_run_summary(j, "local_run", "local_run");
}
