#!/usr/bin/env bash
# setup.sh - idempotent machine set-up for torchloopd: Debian packages and the
# project's .venv.  Safe to run on every `make`; it only installs what is
# missing.  Needs root (or sudo) only when a Debian package is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

# msgpack-c is libmsgpack-c-dev on Debian 13 and libmsgpack-dev on Debian 12.
msgpack_pkg() {
	if apt-cache show libmsgpack-c-dev >/dev/null 2>&1; then
		echo libmsgpack-c-dev
	else
		echo libmsgpack-dev
	fi
}

PKGS=(build-essential pkg-config libuv1-dev libcriterion-dev libsystemd-dev libjansson-dev
      clang clang-format valgrind strace systemd python3-venv ca-certificates file
      libhiredis-dev libssl-dev redis-server)

missing_pkgs() {
	local p
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"
	done
}

install_debs() {
	local missing have_msgpack=0
	pkg-config --exists msgpack-c 2>/dev/null && have_msgpack=1
	pkg-config --exists msgpack 2>/dev/null && have_msgpack=1
	missing=$(missing_pkgs "${PKGS[@]}")
	# libFuzzer and the sanitizer runtimes for clang (package name has the version)
	if command -v clang >/dev/null; then
		local v
		v=$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
		[ -n "$v" ] && missing+=" $(missing_pkgs "libclang-rt-$v-dev" 2>/dev/null)"
	fi
	if [ -z "${missing// /}" ] && [ $have_msgpack = 1 ]; then
		return 0
	fi
	local sudo=""
	[ "$(id -u)" = 0 ] || sudo=sudo
	log "installing Debian packages:$missing (msgpack-c if missing)"
	$sudo apt-get update -qq
	[ $have_msgpack = 1 ] || missing+=" $(msgpack_pkg)"
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
	# clang may just have been installed: its runtime package too
	local v
	v=$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
	if [ -n "$v" ] && [ -n "$(missing_pkgs "libclang-rt-$v-dev")" ]; then
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "libclang-rt-$v-dev" >/dev/null || \
			log "libclang-rt-$v-dev not available; the fuzzer may not link"
	fi
}

pick_python() {
	local c
	for c in python3.11 python3; do
		if command -v "$c" >/dev/null && "$c" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
			echo "$c"; return 0
		fi
	done
	log "no python3 >= 3.10 found"; return 1
}

install_venv() {
	local stamp=.venv/.torchloopd-reqs
	if [ -x .venv/bin/python ] && [ -f "$stamp" ] && cmp -s requirements.txt "$stamp"; then
		return 0
	fi
	if [ ! -x .venv/bin/python ]; then
		log "creating .venv"
		"$(pick_python)" -m venv .venv
	fi
	log "installing Python requirements into .venv (torch is large; this takes minutes)"
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/python - <<'PY'
import torch
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
assert (major, minor) >= (2, 14), f"Compiled loops require Torch >= 2.14 (found {torch.__version__})"
PY
	cp requirements.txt "$stamp"
}

# The torchloop Python package (client/python), editable, so tests and
# solvers in this checkout import the source tree; its C codec (_fast.c) is
# built in place, and rebuilt when the source is newer.
# The built codec is newer than each of its sources and the headers it includes.
fast_is_current() {
	local f
	[ -f "$1" ] || return 1
	for f in client/python/torchloop/_fast*.[ch] proto/protocol.h proto/busypoll.h; do
		[ "$1" -nt "$f" ] || return 1
	done
}

install_python_client() {
	local want ext
	want="$(pwd)/client/python/torchloop"
	ext=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	if .venv/bin/python -c "import os, sys, torchloop; sys.exit(os.path.dirname(torchloop.__file__) != '$want')" 2>/dev/null &&
		fast_is_current "client/python/torchloop/_fast$ext"; then
		return 0
	fi
	# a Debian python3.X needs python3.X-dev for Python.h (pyenv's and the like ship it)
	local inc
	inc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
	if [ ! -f "$inc/Python.h" ] && [[ "$inc" == /usr/include/* ]]; then
		local sudo=""
		[ "$(id -u)" = 0 ] || sudo=sudo
		log "installing $(basename "$inc")-dev for the C codec's Python.h"
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$(basename "$inc")-dev" >/dev/null
	fi
	log "installing the torchloop Python package (editable, with its C codec) into .venv"
	TORCHLOOP_BUILD_FAST=require .venv/bin/pip install -q --no-deps --no-build-isolation -e client/python
	if [ ! -f client/python/torchloop/_fast"$ext" ]; then
		log "the torchloop C codec (client/python/torchloop/_fast.c) did not build"; return 1
	fi
}

install_debs
install_venv
install_python_client
log "ok"
