#!/usr/bin/env bash
# valgrind-daemon.sh BUILD - the daemon under valgrind, twice: start with an
# adapters directory, scan (compiled the first time, checked by hand),
# SIGTERM; then again, after a corrupt record was appended to the warm-start
# index, loading the graph from the index before ready.  Fails on any memory
# error (an uninitialised read included) or "definitely lost" block.  LeakSanitizer cannot do this part (its
# tracer crashes suspending libtorch's threads), so this is the leak check of
# the daemon itself.  Run by `make test` after the suites (the cache is warm).
#
# valgrind cannot execute AVX-512, which Inductor's -march=native code and
# libtorch's kernels pick on CPUs that have it.  So the daemon runs with
# --target-isa baseline (graphs compiled for plain x86-64, their own cache
# keys) and ATEN_CPU_CAPABILITY=default (libtorch's portable kernels).  If
# valgrind still meets an instruction it cannot run, the check did not
# happen: this script says so in a banner and exits 0 only then, never
# silently (TORCHLOOP_VALGRIND_STRICT=1 makes that a failure too).
set -euo pipefail
build=${1:-build}
tmp=$(mktemp -d /tmp/torchloop-vg.XXXXXX)
# a cache of its own (its index gets a corrupt record each run), kept per checkout
cache=${TORCHLOOP_TEST_CACHE:-$PWD/build/test-cache}-valgrind
sock=$tmp/sock
trap 'cat "$tmp"/vg*.log >/tmp/last-vg.log 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$cache"
# An adapters directory, so the second start loads its graph from the cache's
# warm-start index -- after a record that does not parse was appended to it.
mkdir -p "$tmp/adapters"
printf 'name = vg.cumsum\nbody = %s/examples/bodies/cumsum.py\nmax_steps = 12\n' "$PWD" \
	>"$tmp/adapters/vg.cumsum.adapter"
.venv/bin/python -c "import numpy as np; np.save('$tmp/c.npy', np.zeros(4)); np.save('$tmp/x.npy', np.ones((3, 4)))"
pid=0
cannot_run() {
	grep -qE "unhandled instruction bytes|Illegal opcode|SIGILL" "$tmp"/vg*.log 2>/dev/null
}
skip_loudly() {
	local banner
	banner="################################################################################"
	{
		echo "$banner"
		echo "NOT CHECKED: the valgrind check: valgrind cannot execute an instruction of this CPU"
		echo "# (even with --target-isa baseline and ATEN_CPU_CAPABILITY=default):"
		grep -h -E -m3 "unhandled instruction bytes|Illegal opcode|SIGILL" "$tmp"/vg*.log |
			sed 's/^/#   /'
		echo "# The daemon's memory errors and leaks were NOT checked on this machine."
		echo "$banner"
	} | tee /dev/stderr
	[ "${TORCHLOOP_VALGRIND_STRICT:-0}" = 1 ] && exit 1
	exit 0
}
# run N: the daemon under valgrind, a scan checked by hand, SIGTERM; fails on
# any memory error or definitely lost block (logs in $tmp/vgN.log).
run() {
	local n=$1 rc=0 scan_rc=0
	ATEN_CPU_CAPABILITY=default valgrind --error-exitcode=99 --leak-check=full \
		--show-leak-kinds=definite --errors-for-leak-kinds=definite \
		--suppressions=scripts/valgrind.supp --log-file="$tmp/vg$n.log" \
		"$build/torchloopd" --socket "$sock" --cache-dir "$cache" --no-probe --threads 1 \
		--target-isa baseline --adapters "$tmp/adapters" >"$tmp/daemon$n.log" 2>&1 &
	pid=$!
	for _ in $(seq 600); do
		"$build/torchloop" --socket "$sock" health >/dev/null 2>&1 && break
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.5
	done
	if ! kill -0 "$pid" 2>/dev/null; then
		wait "$pid" || rc=$?
		cannot_run && skip_loudly
		echo "valgrind: the daemon died at start (exit $rc)"
		tail -40 "$tmp/daemon$n.log" "$tmp/vg$n.log"
		exit 1
	fi
	rm -rf "$tmp/out"
	"$build/torchloop" --socket "$sock" scan vg.cumsum --carry "$tmp/c.npy" \
		--inputs "$tmp/x.npy" --out "$tmp/out" >/dev/null || scan_rc=$?
	if [ "$scan_rc" = 0 ]; then
		.venv/bin/python -c "
import numpy as np, sys
c = np.load('$tmp/out/carry_0.npy')
sys.exit(0 if np.array_equal(c, np.full(4, 3.0)) else 'valgrind: wrong carry %s' % c)"
	fi
	"$build/torchloop" --socket "$sock" stats >/dev/null || true
	kill -TERM "$pid" 2>/dev/null || true
	wait "$pid" || rc=$?
	cannot_run && skip_loudly
	grep -E "ERROR SUMMARY|definitely lost|Invalid|uninitialised" "$tmp/vg$n.log" | head -20
	if [ "$rc" != 0 ] || [ "$scan_rc" != 0 ]; then
		echo "valgrind: run $n: daemon exit $rc, scan exit $scan_rc; logs follow"
		tail -30 "$tmp/daemon$n.log"
		tail -60 "$tmp/vg$n.log"
		exit 1
	fi
}
run 1
# a record that is not msgpack, then one that is cut short
for idx in "$cache"/index/*.idx; do
	printf '\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1\x00\x00\x00\x03\x81\xa1x' >>"$idx"
done
run 2
grep -q "preloaded adapters' graphs loaded from the cache (1)" "$tmp/daemon2.log" ||
	{ echo "valgrind: run 2 did not load the graph from the warm-start index"; tail -20 "$tmp/daemon2.log"; exit 1; }
echo "valgrind: clean daemon runs and shutdowns, the second a warm start past a corrupt index record (graphs for --target-isa baseline)"
