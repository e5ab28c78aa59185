/*
 * log.h - one line per event on stderr: "torchloopd: LEVEL [id=N] [adapter=X] text".
 * Safe from any thread (one fprintf per line, stderr unbuffered).
 */
#ifndef TORCHLOOP_LOG_H
#define TORCHLOOP_LOG_H

#include <stdint.h>

enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR };

extern enum log_level log_threshold;

void log_line(enum log_level level, uint64_t id, const char *adapter, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Seconds on the monotonic clock (timeouts, durations, latencies). */
double log_now(void);

#define log_info(...)  log_line(LOG_INFO, 0, NULL, __VA_ARGS__)
#define log_warn(...)  log_line(LOG_WARN, 0, NULL, __VA_ARGS__)
#define log_error(...) log_line(LOG_ERROR, 0, NULL, __VA_ARGS__)
#define log_debug(...) log_line(LOG_DEBUG, 0, NULL, __VA_ARGS__)

#endif
