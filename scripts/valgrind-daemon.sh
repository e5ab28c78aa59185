#!/usr/bin/env bash
# valgrind-daemon.sh BUILD - the daemon under valgrind: start (probe from the
# test cache), register, scan a cached graph, SIGTERM; fails on any memory
# error or "definitely lost" block.  LeakSanitizer cannot do this part (its
# tracer crashes suspending libtorch's threads), so this is the leak check of
# the daemon itself.  Run by `make test` after the suites (the cache is warm).
set -euo pipefail
build=${1:-build}
tmp=$(mktemp -d /tmp/torchloop-vg.XXXXXX)
cache=${TORCHLOOP_TEST_CACHE:-$PWD/build/test-cache}
sock=$tmp/sock
trap 'cp "$tmp/vg.log" /tmp/last-vg.log 2>/dev/null; rm -rf "$tmp"' EXIT
valgrind --error-exitcode=99 --leak-check=full --show-leak-kinds=definite \
	--errors-for-leak-kinds=definite --suppressions=scripts/valgrind.supp \
	--log-file="$tmp/vg.log" "$build/torchloopd" --socket "$sock" --cache-dir "$cache" \
	--no-probe --threads 1 >"$tmp/daemon.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
	"$build/torchloop" --socket "$sock" health >/dev/null 2>&1 && break
	sleep 0.5
done
"$build/torchloop" --socket "$sock" register vg.cumsum --body examples/bodies/cumsum.py --max-steps 12 >/dev/null
.venv/bin/python -c "import numpy as np; np.save('$tmp/c.npy', np.zeros(4)); np.save('$tmp/x.npy', np.ones((3, 4)))"
"$build/torchloop" --socket "$sock" scan vg.cumsum --carry "$tmp/c.npy" --inputs "$tmp/x.npy" --out "$tmp/out" >/dev/null
"$build/torchloop" --socket "$sock" stats >/dev/null
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
grep -E "ERROR SUMMARY|definitely lost|Invalid|uninitialised" "$tmp/vg.log" | head -20
if [ "$rc" != 0 ]; then
	echo "valgrind: daemon exit $rc; log follows"; tail -60 "$tmp/vg.log"; exit 1
fi
echo "valgrind: clean daemon run and shutdown"
