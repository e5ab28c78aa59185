/*
 * fdpass.h - one descriptor riding on a frame's first bytes (SCM_RIGHTS):
 * the client's attach of its shared region, and the tests that forge one.
 */
#ifndef TORCHLOOP_FDPASS_H
#define TORCHLOOP_FDPASS_H

#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

/*
 * sendmsg(2) of iov[0 .. iovcnt) on sock with MSG_NOSIGNAL (a peer that
 * closed gives EPIPE, never SIGPIPE), and pass_fd attached when >= 0.
 * Returns what sendmsg returns; the caller sends any rest without the fd.
 */
ssize_t fdpass_sendmsg(int sock, struct iovec *iov, size_t iovcnt, int pass_fd);

#endif
