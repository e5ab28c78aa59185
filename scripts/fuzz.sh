#!/usr/bin/env bash
# fuzz.sh BIN SECONDS - runs the libFuzzer harness over a working copy of the
# seed corpus for SECONDS.  Any crash, leak or sanitizer report fails.
set -euo pipefail
bin=$1; secs=$2
work=$(dirname "$bin")/corpus
mkdir -p "$work"
cp -n tests/fuzz/corpus/* "$work"/ 2>/dev/null || true
echo "fuzz: $bin for ${secs}s over $(ls "$work" | wc -l) seeds"
"$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	-artifact_prefix="$(dirname "$bin")/" "$work" 2>&1 | tail -15
echo "fuzz: no crash in ${secs}s"
