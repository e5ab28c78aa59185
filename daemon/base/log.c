/* log.c - see log.h. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

enum log_level log_threshold = LOG_INFO;

void log_line(enum log_level level, uint64_t id, const char *adapter, const char *fmt, ...)
{
	static const char *const names[] = {"debug", "info", "warn", "error"};
	char text[2048], ids[32] = "", ad[96] = "";
	va_list ap;

	if (level < log_threshold)
		return;
	va_start(ap, fmt);
	vsnprintf(text, sizeof text, fmt, ap);
	va_end(ap);
	if (id)
		snprintf(ids, sizeof ids, " id=%llu", (unsigned long long)id);
	if (adapter)
		snprintf(ad, sizeof ad, " adapter=%s", adapter);
	fprintf(stderr, "torchloopd: %s%s%s %s\n", names[level], ids, ad, text);
}

double log_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
