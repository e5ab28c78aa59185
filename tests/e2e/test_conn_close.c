/*
 * test_conn_close.c - one log line per closed connection (issue 56: one
 * stalled connection was logged "FRAME_TIMEOUT ... closing" three times).
 * A connection whose error frame cannot leave (its client reads nothing)
 * used to be swept again every second, logged each time, until the client
 * read; now the line that says why it closes is its only one, and it is
 * closed all the same.
 */
#include "harness.h"

#include "frame.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

TestSuite(conn_close, .timeout = 300);

/* {"id": 1, "op": "nope"}: an UNKNOWN_OP reply each, the connection serves on */
static const uint8_t NOPE[] = {0x82, 0xa2, 'i', 'd', 0x01, 0xa2, 'o',
                               'p',  0xa4, 'n', 'o', 'p',  'e'};
#define REQUESTS 4096

static int closing_lines(const struct hd *d)
{
	char *text = h_slurp(d->log);
	int n = 0;

	for (const char *at = text; at && (at = strstr(at, "; closing")) != NULL; at++)
		n++;
	free(text);
	return n;
}

/*
 * Requests whose replies fill the socket (the client reads none of them),
 * then part of a frame and silence: FRAME_TIMEOUT (or, if the sweep sees the
 * replies first, "have not moved"), one line, and the connection is closed.
 * Waits on the daemon's state: its open connections, its log.
 */
Test(conn_close, a_stalled_connection_that_reads_nothing_is_logged_once_and_closed)
{
	const char *args[] = {"--no-probe", "--frame-timeout", "1", NULL};
	size_t one = 4 + sizeof NOPE, len = REQUESTS * one + 4 + 8;
	uint8_t *bytes = calloc(1, len);
	struct hd d;
	struct tl_client *c;
	int fd;

	for (size_t k = 0; k < REQUESTS; k++) {
		frame_put_header(bytes + k * one, sizeof NOPE);
		memcpy(bytes + k * one + 4, NOPE, sizeof NOPE);
	}
	frame_put_header(bytes + REQUESTS * one, 64); /* 8 of its 64 bytes come */
	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	fd = raw_connect(d.sock);
	raw_send(fd, bytes, len);
	while (h_stat(c, "stalled_closed") == 0)
		usleep(50 * 1000);
	/* before the fix it was never closed: a line a second, for ever */
	while (h_stat(c, "open_connections") > 1 && closing_lines(&d) < 2)
		usleep(50 * 1000);
	cr_assert_eq(closing_lines(&d), 1, "one line for the connection; log %s", d.log);
	cr_assert_eq(h_stat(c, "stalled_closed"), 1, "counted once");
	cr_assert_eq(h_stat(c, "open_connections"), 1, "closed");
	close(fd);
	free(bytes);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "clean exit; log %s", d.log);
}
