#!/usr/bin/env bash
# Set up chatserve in ./.venv from nothing: CPU torch first (a pinned wheel; an unpinned
# torch would pull a multi-GB CUDA build), then the project. `setup.sh test` also installs
# the test extras (and ray, for the scale-out tests) and Debian's chromium for the browser test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e ".[test,scale]"
  if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    echo "installing Debian's chromium for the browser test..." >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
  fi
else
  .venv/bin/python -m pip install -q -e .
fi
# Build the C++ CPU kernels now (~1-2 min, cached per machine), not in the first request; without
# a compiler this only prints why, and chatserve runs its plain-torch paths.
.venv/bin/python -c "from kernels import cpu_ext; cpu_ext.extension()" || true
echo "chatserve is set up in $(pwd)/.venv" >&2
