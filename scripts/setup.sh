#!/usr/bin/env bash
# Set up chatserve in ./.venv from nothing: CPU torch first (a pinned wheel; an unpinned
# torch would pull a multi-GB CUDA build), then the project. `setup.sh test` also installs
# the test extras (and ray, for the scale-out tests) and Debian's chromium for the browser test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip, retried: a dropped connection in the middle of a large wheel (torch, triton) should cost a
# retry, not the set-up. pip resumes a partial download itself (--resume-retries), and a
# whole new attempt follows a failed one, up to three.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    if .venv/bin/python -m pip install -q "$@"; then return 0; fi
    [ "$attempt" = 3 ] && return 1
    echo "pip install $* failed (attempt $attempt of 3); retrying in 10 s..." >&2
    sleep 10
  done
}
pip_install --upgrade pip >/dev/null
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20}
pip_install torch==2.13.0
if [ "${1:-}" = "test" ]; then
  pip_install -e ".[test,scale]"
  if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    echo "installing Debian's chromium for the browser test..." >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
  fi
else
  pip_install -e .
fi
# Build the C++ CPU kernels now (~1-2 min, cached per machine), not in the first request; without
# a compiler this only prints why, and chatserve runs its plain-torch paths.
.venv/bin/python -c "from kernels import cpu_ext; cpu_ext.extension()" || true
echo "chatserve is set up in $(pwd)/.venv" >&2
