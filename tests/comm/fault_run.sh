#!/usr/bin/env bash
# fault_run.sh <max_seconds> <pattern> -- <command...>
# Runs a job (mpirun ...) in which a rank fails. Passes when the job ended by itself within
# max_seconds (a hang is killed and fails), with a non-zero exit status (a failed job must
# not look successful), and its output has a line matching the extended regex <pattern>
# (what the survivors must print). Prints the job's output and how long it took.
#
# Open MPI 4.1's mpirun sometimes deadlocks in its own teardown after a rank died: every
# rank has ended (its children are all zombies) but mpirun never exits (the same futex wait
# as open-mpi/ompi#7790). That is the launcher's hang, not a rank's: when every child has
# been dead for 5 s, this script says so, kills mpirun and runs the job again (twice at most).
set -u
max=$1
pattern=$2
shift 2
[ "${1:-}" = "--" ] && shift
out_file=$(mktemp)
trap 'rm -f "$out_file"' EXIT

now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
later() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }  # true when $1 >= $2

for attempt in 1 2 3; do
  start=$(now)
  "$@" >"$out_file" 2>&1 &
  pid=$!
  status=done
  seen_child=0
  dead_since=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    t=$(now)
    if later "$(seconds "$start" "$t")" "$max"; then
      status=hang
      break
    fi
    states=$(ps -o stat= --ppid "$pid" 2>/dev/null)
    [ -n "$states" ] && seen_child=1
    if [ "$seen_child" = 1 ] && ! grep -qv '^Z' <<<"$states"; then
      [ -z "$dead_since" ] && dead_since=$t
      if later "$(seconds "$dead_since" "$t")" 5; then
        status=launcher
        break
      fi
    else
      dead_since=""
    fi
  done
  if [ "$status" = done ]; then
    wait "$pid"
    rc=$?
    break
  fi
  pkill -9 -P "$pid" 2>/dev/null
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  cat "$out_file"
  if [ "$status" = hang ]; then
    echo "fault_run: FAIL: the job did not end within $max s"
    exit 1
  fi
  echo "fault_run: every rank ended after $(seconds "$start" "$dead_since") s but mpirun hung in its own teardown (attempt $attempt); killed it"
  [ "$attempt" = 3 ] && { echo "fault_run: FAIL: mpirun hung 3 times"; exit 1; }
done
end=$(now)
cat "$out_file"
echo "fault_run: exit status $rc after $(seconds "$start" "$end") s (limit $max s)"
if [ "$rc" -eq 0 ]; then
  echo "fault_run: FAIL: exit status 0, but a rank failed"
  exit 1
fi
if ! grep -Eq -- "$pattern" "$out_file"; then
  echo "fault_run: FAIL: no line matches: $pattern"
  exit 1
fi
echo "fault_run: PASS"
