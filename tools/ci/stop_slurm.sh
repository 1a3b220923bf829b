#!/usr/bin/env bash
# Stop the cluster that tools/ci/start_slurm.sh DIR started: slurmd, slurmctld, munged, by their pid files.
set -uo pipefail
DIR=${1:?usage: stop_slurm.sh DIR}
for name in slurmd slurmctld munged; do
  pidfile=$DIR/$name.pid
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
done
exit 0
