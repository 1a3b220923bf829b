#!/usr/bin/env bash
# Run a command on a fresh clone of this repository's HEAD, as CI does, then delete the clone.
#
#   bash tools/ci/fresh_clone.sh                               # the README's test command (.ci/run)
#   bash tools/ci/fresh_clone.sh bash examples/run_cpu_demo.sh # the README's CPU demo
#
# Each clone builds its own .venv (about 5 GiB: torch's CUDA build). Clones left behind in /tmp once filled the
# disk that CI ran on, and CI's install stopped at tools/setup_env.sh's free-space check; so the clone goes away when
# the command ends, passed or failed. KEEP=1 keeps it (its path is printed first). Exit status: the command's.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/fresh_clone.XXXXXX")
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$dir"' EXIT; fi
git clone -q "$src" "$dir/repo"
cd "$dir/repo"
echo "fresh_clone.sh: $(git log -1 --format='%h %s') in $dir/repo" >&2
if [ $# -eq 0 ]; then set -- bash .ci/run; fi
"$@"
