#!/usr/bin/env bash
# The test command of the README: builds the environment from scratch if needed, then runs the whole suite.
# Extra arguments go to pytest (e.g. bash tools/test.sh -k upipe -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
