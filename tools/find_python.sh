# Sourced by the set-up scripts: sets PYTHON to a Python >= 3.12 interpreter (megatron-core 0.19.2 needs it).
# Order: $PYTHON if given, python3.13/python3.12/python3 on PATH, then pyenv's installed versions.
_py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ] && _py_ok "$PYTHON"; then
  :
else
  PYTHON=""
  for cand in python3.12 python3.13 python3 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python 2>/dev/null); do
    if _py_ok "$cand"; then PYTHON="$cand"; break; fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "error: no Python >= 3.12 found (megatron-core 0.19.2 requires it); set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
