#!/usr/bin/env bash
# The test command of the README: builds the environment from scratch if needed, then runs the whole suite.
# Extra arguments go to pytest (e.g. bash tools/test.sh -k upipe -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# Two pytest workers (at most 4 with more CPUs), each test module on one of them (--dist loadfile: a module's shared
# gloo world is built once); tests/conftest.py starts the slowest modules first so that both end together.
workers=$(.venv/bin/python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "$workers" --dist loadfile tests "$@"
