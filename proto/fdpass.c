/* fdpass.c - see fdpass.h. */
#include "fdpass.h"

#include <string.h>
#include <sys/socket.h>

ssize_t fdpass_sendmsg(int sock, struct iovec *iov, size_t iovcnt, int pass_fd)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct msghdr mh = {.msg_iov = iov, .msg_iovlen = iovcnt};

	if (pass_fd >= 0) {
		memset(&ctl, 0, sizeof ctl);
		mh.msg_control = ctl.buf;
		mh.msg_controllen = sizeof ctl.buf;
		CMSG_FIRSTHDR(&mh)->cmsg_level = SOL_SOCKET;
		CMSG_FIRSTHDR(&mh)->cmsg_type = SCM_RIGHTS;
		CMSG_FIRSTHDR(&mh)->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(CMSG_FIRSTHDR(&mh)), &pass_fd, sizeof(int));
	}
	return sendmsg(sock, &mh, MSG_NOSIGNAL);
}
