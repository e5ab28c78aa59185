/*
 * listen.c - the listening socket's file: its directory made, a stale
 * socket left by a dead daemon replaced (never a live one, never another
 * kind of file), bound with --socket-mode, and removed at shutdown if it is
 * ours; connections accepted on it and admitted (max-connections,
 * max-connections-per-uid, not while stopping), then read by conn.c.  Loop
 * thread.
 */
#include "daemon.h"

#include "log.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* A leftover socket file: unlink it only if nothing answers there. */
static int clear_stale(const char *path, struct proto_err *err)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct stat st;
	int fd, rc;

	if (lstat(path, &st) != 0)
		return 0;
	if (!S_ISSOCK(st.st_mode))
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "%s exists and is not a socket; refusing to touch it", path);
	snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "socket: %s", strerror(errno));
	rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
	close(fd);
	if (rc == 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "another torchloopd is listening on %s", path);
	if (errno != ECONNREFUSED)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot probe %s: %s", path,
		                  strerror(errno));
	log_info("removing stale socket %s", path);
	unlink(path);
	return 0;
}

static int make_parent(const char *path, struct proto_err *err)
{
	char dir[PATH_MAX];
	char *slash;

	snprintf(dir, sizeof dir, "%s", path);
	slash = strrchr(dir, '/');
	if (slash == NULL || slash == dir)
		return 0;
	*slash = '\0';
	if (mkdir(dir, 0750) != 0 && errno != EEXIST)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot create %s: %s", dir,
		                  strerror(errno));
	return 0;
}

int listen_open(struct daemon *d, struct proto_err *err)
{
	const char *path = d->cfg.socket_path;
	int rc;

	if (strlen(path) > sizeof(((struct sockaddr_un *)0)->sun_path) - 1)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL,
		                  "socket path is %zu bytes; Unix sockets allow at most 107: %s",
		                  strlen(path), path);
	if (make_parent(path, err) != 0 || clear_stale(path, err) != 0)
		return -1;
	uv_pipe_init(d->loop, &d->server, 0);
	d->server.data = d;
	d->server_open = true;
	rc = uv_pipe_bind(&d->server, path);
	if (rc == 0) {
		d->own_socket = true;
		if (chmod(path, d->cfg.socket_mode) != 0)
			rc = uv_translate_sys_error(errno);
	}
	if (rc == 0)
		listen_start(d, &rc);
	if (rc != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot listen on %s: %s", path,
		                  uv_strerror(rc));
	log_info("listening on %s (mode %04o)", path, d->cfg.socket_mode);
	return 0;
}

void listen_close(struct daemon *d)
{
	if (!d->server_open)
		return;
	d->server_open = false;
	uv_close((uv_handle_t *)&d->server, NULL);
	if (d->own_socket)
		unlink(d->cfg.socket_path);
}

static unsigned uid_connections(const struct daemon *d, uid_t uid)
{
	unsigned n = 0;

	for (const struct conn *c = d->conns; c; c = c->next)
		n += c->uid == uid;
	return n;
}

static void on_connection(uv_stream_t *server, int status)
{
	struct daemon *d = server->data;
	struct proto_err err;
	struct conn *c;

	if (status != 0) {
		log_warn("accept: %s", uv_strerror(status));
		return;
	}
	c = conn_accept(d, server);
	if (c == NULL)
		return;
	if (d->n_conns > (unsigned)d->cfg.max_connections || d->shutting_down) {
		proto_fail(&err, d->shutting_down ? PROTO_E_SHUTTING_DOWN : PROTO_E_BUSY, NULL,
		           d->shutting_down ? "the daemon is stopping"
		                            : "too many connections (max-connections=%lld)",
		           d->cfg.max_connections);
		if (!d->shutting_down)
			d->stats.limit_breaches++;
		conn_frame_error(c, &err, true);
		return;
	}
	if (uid_connections(d, c->uid) > (unsigned)d->cfg.max_conns_per_uid) {
		proto_fail(&err, PROTO_E_BUSY, NULL,
		           "too many connections from uid %d (max-connections-per-uid=%lld)",
		           (int)c->uid, d->cfg.max_conns_per_uid);
		d->stats.limit_breaches++;
		conn_frame_error(c, &err, true);
		return;
	}
	conn_start_reading(c);
}

/* Starts accepting on an already bound (or inherited) socket. */
void listen_start(struct daemon *d, int *rc)
{
	*rc = uv_listen((uv_stream_t *)&d->server, 128, on_connection);
}
