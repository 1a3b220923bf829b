#!/usr/bin/env bash
# Stop the cluster that tools/ci/start_slurm.sh DIR started (slurmd, slurmctld, munged) by their pid files:
# SIGTERM to all, then SIGKILL to any still running after 10 s.
set -uo pipefail
DIR=${1:?usage: stop_slurm.sh DIR}
pids=()
for name in slurmd slurmctld munged; do
  if [ -s "$DIR/$name.pid" ] && kill "$(cat "$DIR/$name.pid")" 2>/dev/null; then pids+=("$(cat "$DIR/$name.pid")"); fi
done
for _ in $(seq 100); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && exit 0
  sleep 0.1
done
for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
exit 0
