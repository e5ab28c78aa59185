/*
 * log.h - one line per event on stderr: "torchloopd: LEVEL [id=N] [adapter=X] text".
 * Safe from any thread (one fprintf per line, stderr unbuffered).  The text
 * is escaped (log.c): control characters, backslashes and bytes that are
 * not UTF-8 show as \xNN, so no text ends a line or forges another.
 */
#ifndef TORCHLOOP_LOG_H
#define TORCHLOOP_LOG_H

#include <stddef.h>
#include <stdint.h>

enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR };

extern enum log_level log_threshold;

void log_line(enum log_level level, uint64_t id, const char *adapter, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Another process's output line (a compile worker's stderr), quoted:
 * `torchloopd: LEVEL WHO: "text"`, with control characters, non-UTF-8
 * bytes and '"' as \xNN (backslashes stay: the worker escapes its own
 * text the same way, frames.py log); at most 4096 bytes of text. */
void log_relay(enum log_level level, const char *who, const char *text, size_t n);

/* text[0..n) into out (NUL-terminated, cut to fit size) with control
 * characters, DEL, C1 controls, bytes that are not well-formed UTF-8 and
 * the ASCII characters of also as \xNN.  Returns the length written. */
size_t log_escape(char *out, size_t size, const char *text, size_t n, const char *also);

/* Seconds on the monotonic clock (timeouts, durations, latencies). */
double log_now(void);

#define log_info(...)  log_line(LOG_INFO, 0, NULL, __VA_ARGS__)
#define log_warn(...)  log_line(LOG_WARN, 0, NULL, __VA_ARGS__)
#define log_error(...) log_line(LOG_ERROR, 0, NULL, __VA_ARGS__)
#define log_debug(...) log_line(LOG_DEBUG, 0, NULL, __VA_ARGS__)

#endif
