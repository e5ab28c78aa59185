/*
 * log.c - see log.h.  What a line shows of its text is escaped here, once:
 * control characters, DEL, C1 controls, backslash and bytes that are not
 * well-formed UTF-8 become \xNN, so request text (adapter names, graph
 * strings, op names in error messages) or a worker's output can never end
 * a line early, start a forged "torchloopd: ..." line or drive a terminal.
 * Any thread: each line is built in a buffer and written with one call.
 */
#include "log.h"

#include "utf8.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

enum log_level log_threshold = LOG_INFO;

static const char *const LEVEL_NAMES[] = {"debug", "info", "warn", "error"};

/* Whether the sequence of k bytes at s is shown as is. */
static bool shown(const uint8_t *s, size_t k, const char *also)
{
	if (k == 0)
		return false; /* not UTF-8 */
	if (k == 2 && s[0] == 0xc2 && s[1] < 0xa0)
		return false; /* C1 controls, U+0080..U+009F */
	if (k > 1)
		return true;
	return s[0] >= 0x20 && s[0] != 0x7f && strchr(also, s[0]) == NULL;
}

size_t log_escape(char *out, size_t size, const char *text, size_t n, const char *also)
{
	static const char hex[] = "0123456789abcdef";
	const uint8_t *s = (const uint8_t *)text;
	size_t o = 0;

	for (size_t i = 0; i < n && size > 0;) {
		size_t k = utf8_seq_len(s + i, n - i);
		if (shown(s + i, k, also)) {
			if (o + k >= size)
				break;
			memcpy(out + o, s + i, k);
			o += k;
			i += k;
			continue;
		}
		if (o + 4 >= size)
			break;
		k = k ? k : 1; /* a C1 control's two bytes, or one bad byte */
		for (size_t j = 0; j < k && o + 4 < size; j++) {
			out[o++] = '\\';
			out[o++] = 'x';
			out[o++] = hex[s[i + j] >> 4];
			out[o++] = hex[s[i + j] & 15];
		}
		i += k;
	}
	if (size > 0)
		out[o] = '\0';
	return o;
}

void log_line(enum log_level level, uint64_t id, const char *adapter, const char *fmt, ...)
{
	char text[2048], shown_text[4 * sizeof text], ids[32] = "", ad[300] = "", ad_shown[260];
	va_list ap;

	if (level < log_threshold)
		return;
	va_start(ap, fmt);
	vsnprintf(text, sizeof text, fmt, ap);
	va_end(ap);
	log_escape(shown_text, sizeof shown_text, text, strlen(text), "\\");
	if (id)
		snprintf(ids, sizeof ids, " id=%llu", (unsigned long long)id);
	if (adapter) {
		log_escape(ad_shown, sizeof ad_shown, adapter, strnlen(adapter, 64), "\\");
		snprintf(ad, sizeof ad, " adapter=%s", ad_shown);
	}
	fprintf(stderr, "torchloopd: %s%s%s %s\n", LEVEL_NAMES[level], ids, ad, shown_text);
}

void log_relay(enum log_level level, const char *who, const char *text, size_t n)
{
	char shown_text[4 * 4096 + 1];

	if (level < log_threshold)
		return;
	log_escape(shown_text, sizeof shown_text, text, n, "\"");
	fprintf(stderr, "torchloopd: %s %s: \"%s\"\n", LEVEL_NAMES[level], who, shown_text);
}

double log_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
