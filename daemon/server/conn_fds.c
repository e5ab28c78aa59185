/*
 * conn_fds.c - descriptors a client passes (SCM_RIGHTS) with its frames: the
 * one an attach request maps (op_attach.c), the strays closed.  Loop thread
 * only.
 */
#include "daemon.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

static void free_handle(uv_handle_t *h)
{
	free(h);
}

/*
 * Descriptors passed with SCM_RIGHTS (the pipe is an IPC pipe for this)
 * wait in libuv until accepted.  Each is taken at once: the first, while the
 * connection has no region, is kept for its attach request; any other is
 * closed, so a client cannot make the daemon hold descriptors.
 *
 * A descriptor rides on the first byte of the sendmsg that carried it, and
 * the kernel hands it over with the read that holds that byte: it belongs to
 * a frame that begins in that read (or the one under way, when none does).
 * Those frames are its window; once they have all been dispatched without an
 * attach taking it, it is closed (a stray), so an attach can never pick up a
 * descriptor some earlier frame brought.
 */
void conn_drop_stray_fd(struct conn *c)
{
	if (c->pending_fd < 0 || c->fd_window_open || c->frames_done < c->fd_last)
		return;
	close(c->pending_fd);
	c->pending_fd = -1;
	c->d->stats.shm_stray_fds++;
}

int conn_take_fd(struct conn *c)
{
	int fd = c->pending_fd;
	uint64_t n = c->frames_done; /* the frame being dispatched */

	if (fd < 0 || n < c->fd_first)
		return -1; /* none, or one for a later frame */
	if (!c->fd_window_open && n > c->fd_last) {
		conn_drop_stray_fd(c);
		return -1;
	}
	c->pending_fd = -1;
	return fd;
}

/* The read that brought a descriptor is fed entirely: its window is known. */
void conn_close_fd_window(struct conn *c)
{
	if (!c->fd_window_open)
		return;
	c->fd_window_open = false;
	c->fd_last = c->frames_begun;
	conn_drop_stray_fd(c);
}

void conn_take_fds(struct conn *c)
{
	while (uv_pipe_pending_count(&c->handle) > 0) {
		uv_pipe_t *tmp = malloc(sizeof *tmp);
		uv_os_fd_t fd = -1;
		int own = -1;

		if (tmp == NULL)
			return;
		uv_pipe_init(c->d->loop, tmp, 0);
		if (uv_accept((uv_stream_t *)&c->handle, (uv_stream_t *)tmp) == 0 &&
		    uv_fileno((uv_handle_t *)tmp, &fd) == 0)
			own = fcntl(fd, F_DUPFD_CLOEXEC, 3);
		uv_close((uv_handle_t *)tmp, free_handle); /* closes libuv's copy */
		if (own < 0)
			continue;
		if (c->pending_fd < 0 && c->region.base == NULL) {
			c->pending_fd = own;
			c->fd_window_open = true;
			c->fd_first = c->frames_begun + (c->reader.header_have == 0);
		} else {
			close(own);
			c->d->stats.shm_stray_fds++;
		}
	}
}
