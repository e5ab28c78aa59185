/*
 * test_log.c - the daemon's log lines (daemon/base/log.c): whatever the
 * text holds (newlines, carriage returns, terminal escapes, backslashes,
 * C1 controls, bytes that are not UTF-8), one call writes exactly one line,
 * with those bytes as \xNN, and a worker's relayed line is quoted with its
 * own quotes escaped.  stderr goes to a file per test (Criterion forks one
 * process per test).
 */
#include "log.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

TestSuite(log, .timeout = 30);

static char path[64];

/* stderr, from here on, into a fresh file */
static void capture(void)
{
	int fd;

	snprintf(path, sizeof path, "/tmp/tl-log-test.XXXXXX");
	fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	close(fd);
	cr_assert_not_null(freopen(path, "w", stderr));
}

/* What was written; *lines: its count of '\n'. */
static char *captured(int *lines)
{
	FILE *f;
	char *text = calloc(1, 65536);
	size_t n;

	fflush(stderr);
	f = fopen(path, "r");
	cr_assert_not_null(f);
	n = fread(text, 1, 65535, f);
	fclose(f);
	unlink(path);
	*lines = 0;
	for (size_t i = 0; i < n; i++)
		*lines += text[i] == '\n';
	return text;
}

Test(log, a_message_with_newlines_and_escapes_is_one_line_with_them_as_hex)
{
	int lines;
	char *text;

	capture();
	log_line(LOG_WARN, 7, "a.b", "refused %s",
	         "x\ntorchloopd: warn forged\r\x1b[31mred\\ \x7f");
	text = captured(&lines);
	cr_assert_eq(lines, 1, "one line: %s", text);
	cr_assert_str_eq(text, "torchloopd: warn id=7 adapter=a.b refused "
	                       "x\\x0atorchloopd: warn forged\\x0d\\x1b[31mred\\x5c \\x7f\n");
	free(text);
}

Test(log, bytes_that_are_not_utf8_and_c1_controls_are_escaped_and_text_kept)
{
	int lines;
	char *text;

	capture();
	log_line(LOG_INFO, 0, NULL, "caf\xc3\xa9 \xff \xc0\x80 \xc2\x9b[2J \xf0\x9f\x98\x80");
	text = captured(&lines);
	cr_assert_eq(lines, 1);
	cr_assert_str_eq(text, "torchloopd: info caf\xc3\xa9 \\xff \\xc0\\x80 \\xc2\\x9b[2J "
	                       "\xf0\x9f\x98\x80\n");
	free(text);
}

Test(log, an_adapter_name_is_escaped_too)
{
	int lines;
	char *text;

	capture();
	log_line(LOG_INFO, 0, "a\nb", "x");
	text = captured(&lines);
	cr_assert_eq(lines, 1);
	cr_assert_str_eq(text, "torchloopd: info adapter=a\\x0ab x\n");
	free(text);
}

Test(log, a_relayed_worker_line_is_quoted_with_its_controls_and_quotes_escaped)
{
	static const char out[] =
	    "worker[9]: Traceback:\\x0a  File \"x\"\rtorchloopd: warn forged\n";
	int lines;
	char *text;

	capture();
	log_relay(LOG_INFO, "compile worker 9", out, sizeof out - 1);
	text = captured(&lines);
	cr_assert_eq(lines, 1, "%s", text);
	cr_assert_str_eq(text, "torchloopd: info compile worker 9: \"worker[9]: Traceback:\\x0a  "
	                       "File \\x22x\\x22\\x0dtorchloopd: warn forged\\x0a\"\n");
	free(text);
}

Test(log, escaping_cuts_at_the_buffer_and_never_splits_an_escape)
{
	char out[10];

	cr_assert_eq(log_escape(out, sizeof out, "ab\n\n", 4, "\\"), 6);
	cr_assert_str_eq(out, "ab\\x0a");
	cr_assert_eq(
	    log_escape(out, sizeof out, "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9", 10, "\\"), 8,
	    "whole characters only");
}
