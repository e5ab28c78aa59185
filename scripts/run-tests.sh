#!/usr/bin/env bash
# run-tests.sh BUILD BIN... - runs each Criterion test binary, then the
# Python package's pytest suite, prints their output, and ends with one
# summary line "tests: N passed, M failed, K skipped, J not checked" (a
# skipped test says why above it: "[SKIP]" or pytest's "SKIPPED"; a check a
# test could not make on this machine or build, and what it checked instead,
# is a "NOT CHECKED:" line: tests/e2e/harness.h h_not_checked, a Python
# test's warning), after the slowest Criterion tests and a recap of what
# failed.
# Exits 1 if any test failed or crashed, or if a binary exited non-zero.
set -uo pipefail
build=$1; shift
passed=0 failed=0 skipped=0 unchecked=0 status=0
times=$(mktemp) failures=$(mktemp)
export TORCHLOOP_TEST_BUILD="$build"
# One compile cache per checkout, shared by `make test` and `make sanitize`, so
# each specialization compiles once; scratch (sockets, logs) under /tmp keeps
# socket paths short.
export TORCHLOOP_TEST_CACHE="${TORCHLOOP_TEST_CACHE:-$PWD/build/test-cache}"
export TORCHLOOP_TEST_TMP="${TORCHLOOP_TEST_TMP:-$(mktemp -d /tmp/torchloop-tests.XXXXXX)}"
mkdir -p "$TORCHLOOP_TEST_CACHE"
# Inductor's own cache (precompiled headers, in-process compiles): torch's
# default place, shared by every daemon of the run whatever its --cache-dir
# (a daemon uses <cache-dir>/inductor only when this is unset)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}"
# The suite starts hundreds of short-lived daemons; most of their compile workers
# never get a job: each imports torch's compile path (~3.5 s of CPU) only
# when its first job comes (docs/operations.md, inductor/)
export TORCHLOOP_WORKER_PRELOAD="${TORCHLOOP_WORKER_PRELOAD:-0}"
# the access-control test connects as uid 65534: scratch must be traversable
chmod 755 "$TORCHLOOP_TEST_TMP"
start=$(date +%s)
# Inductor compiles so far: the daemons' logs (the C suites' and, under
# pytest's basetemp, the Python suite's) say "compiling" once each
compiles() { find "$TORCHLOOP_TEST_TMP" -name log -type f -exec grep -h 'compiling ' {} + 2>/dev/null | wc -l; }
# compile workers that got a job: each imported torch's compile path (~4.5 s
# of CPU here) for it
imports() { find "$TORCHLOOP_TEST_TMP" -name log -type f -exec grep -h 'compile path imported' {} + 2>/dev/null | wc -l; }
# the machine's busy share of the run, from /proc/stat (all CPUs)
cpu_busy_idle() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }
read -r busy0 idle0 < <(cpu_busy_idle)
for bin in "$@"; do
	[ -x "$bin" ] || continue
	echo "=== $bin"
	t0=$(date +%s) c0=$(compiles)
	# --verbose: a line per test, so that skips are seen and counted (Criterion
	# leaves them out of "Tested") and times kept; the RUN/PASS lines are not shown
	out=$("$bin" --jobs "${CRITERION_JOBS:-2}" --verbose 2>&1); rc=$?
	printf '%s\n' "$out" | grep -vE '^\[(RUN |PASS)\] '
	printf '%s\n' "$out" | sed -n 's/^\[PASS\] \(.*\): (\([0-9.]*\)s)$/\2 \1/p' >>"$times"
	skipped=$((skipped + $(printf '%s\n' "$out" | grep -c '^\[SKIP\]')))
	unchecked=$((unchecked + $(printf '%s\n' "$out" | grep -c 'NOT CHECKED:')))
	echo "(${bin##*/}: $(( $(date +%s) - t0 )) s, $(( $(compiles) - c0 )) compiles)"
	line=$(printf '%s\n' "$out" | grep 'Synthesis:' | tail -1)
	t=$(sed -n 's/.*Tested: \([0-9]*\).*/\1/p' <<<"$line")
	p=$(sed -n 's/.*Passing: \([0-9]*\).*/\1/p' <<<"$line")
	if [ -z "$t" ] || [ "$rc" != 0 ]; then
		status=1
		# kept for the recap at the end, where a log's tail shows it
		{ echo "${bin##*/} (exit $rc):"
		  printf '%s\n' "$out" | grep -E '^\[(FAIL|----)\] ' | grep -v 'Criterion v' | sed 's/^/  /'
		} >>"$failures"
	fi
	passed=$((passed + ${p:-0}))
	failed=$((failed + ${t:-0} - ${p:-0}))
done
# the Python package (client/python) against the same build, with pytest
echo "=== pytest tests/python"
pyenv=()
if [ "${TORCHLOOP_TEST_SAN:-0}" = 1 ]; then
	# the package's C codec under ASan + UBSan too: a copy of the package with
	# an instrumented _fast, first on the path, the runtimes preloaded
	pkg="$TORCHLOOP_TEST_TMP/pyasan/torchloop"
	mkdir -p "$pkg"
	cp client/python/torchloop/*.py "$pkg/"
	ext=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	inc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
	gcc -std=c11 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
		-fno-omit-frame-pointer -Wall -Wextra -Werror -shared -fPIC -I"$inc" -Iproto \
		client/python/torchloop/_fast.c client/python/torchloop/_fast_enc.c \
		client/python/torchloop/_fast_dec.c -o "$pkg/_fast$ext" || status=1
	pyenv=(env PYTHONPATH="$TORCHLOOP_TEST_TMP/pyasan" TORCHLOOP_TEST_FAST_DIR="$pkg"
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
		LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)")
fi
t0=$(date +%s) c0=$(compiles)
# two processes, a file each at a time (a file's tests share their daemons):
# while one waits on a compile, the other runs
xdist=()
if .venv/bin/python -c 'import xdist' 2>/dev/null; then
	xdist=(-n 2 --dist loadfile)
else
	echo "!!! pytest-xdist is not installed (make setup): the Python tests run in one process"
fi
out=$("${pyenv[@]}" .venv/bin/python -m pytest -q -rfEs -p no:cacheprovider "${xdist[@]}" --durations=15 \
	--basetemp "$TORCHLOOP_TEST_TMP/pytest" tests/python 2>&1); rc=$?
printf '%s\n' "$out" | tail -45
# pytest prints each warning once per place in its summary
# (the warning's message, not the source line pytest prints under it)
nc=$(printf '%s\n' "$out" | grep -E '(^|Warning: )NOT CHECKED:' | sort -u)
[ -z "$nc" ] || { printf '%s\n' "$nc"; unchecked=$((unchecked + $(printf '%s\n' "$nc" | wc -l))); }
echo "(pytest: $(( $(date +%s) - t0 )) s, $(( $(compiles) - c0 )) compiles)"
line=$(printf '%s\n' "$out" | grep -E '[0-9]+ (passed|failed)' | tail -1)
count() { grep -oE "[0-9]+ $1" <<<"$line" | grep -oE '[0-9]+' | head -1; }
p=$(count passed)
f=$(count failed)
e=$(count error)
k=$(count skipped)
if [ -z "$line" ] || [ "$rc" != 0 ]; then status=1; fi
passed=$((passed + ${p:-0}))
failed=$((failed + ${f:-0} + ${e:-0}))
skipped=$((skipped + ${k:-0}))
[ "$failed" = 0 ] || status=1
if [ "$rc" != 0 ]; then
	{ echo "pytest (exit $rc):"; printf '%s\n' "$out" | grep -E '^(FAILED|ERROR) ' | sed 's/^/  /'; } >>"$failures"
fi
echo "slowest Criterion tests (s):"
sort -rn "$times" | head -10 | sed 's/^/  /'
if [ -s "$failures" ]; then
	echo "failed:"
	sed 's/^/  /' "$failures"
fi
rm -f "$times" "$failures"
echo "compiles in this run: $(compiles) (cache: $TORCHLOOP_TEST_CACHE); compile workers that imported torch: $(imports)"
read -r busy1 idle1 < <(cpu_busy_idle)
echo "CPU busy: $(( 100 * (busy1 - busy0) / (busy1 - busy0 + idle1 - idle0 + 1) ))% of $(nproc) CPUs over the run"
echo "test time: $(( $(date +%s) - start )) s"
echo "tests: $passed passed, $failed failed, $skipped skipped, $unchecked not checked"
exit $status
