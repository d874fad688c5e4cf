#!/usr/bin/env bash
# fault_run.sh <max_seconds> <pattern> -- <command...>
# Runs a job in which a rank fails. Passes when the job ended by itself within max_seconds
# (a hang is killed by `timeout` and fails), with a non-zero exit status (a failed job must
# not look successful), and its output has a line matching the extended regex <pattern>
# (what the survivors must print). Prints the job's output and how long it took.
set -u
max=$1
pattern=$2
shift 2
[ "${1:-}" = "--" ] && shift
start=$(date +%s.%N)
out=$(timeout -k 5 "$max" "$@" 2>&1)
rc=$?
end=$(date +%s.%N)
printf '%s\n' "$out"
elapsed=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
echo "fault_run: exit status $rc after $elapsed s (limit $max s)"
if [ "$rc" -eq 124 ] || awk -v e="$elapsed" -v m="$max" 'BEGIN { exit !(e >= m) }'; then
  echo "fault_run: FAIL: the job did not end within $max s"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "fault_run: FAIL: exit status 0, but a rank failed"
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$out"; then
  echo "fault_run: FAIL: no line matches: $pattern"
  exit 1
fi
echo "fault_run: PASS"
