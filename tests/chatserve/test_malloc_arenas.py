"""`chatserve serve` caps glibc's malloc arenas (chatserve/loading.limit_malloc_arenas), unless
MALLOC_ARENA_MAX is set, which then rules. Each case in a fresh process: the cap is process-wide."""

import os
import subprocess
import sys

import pytest

CHECK = "from chatserve.loading import limit_malloc_arenas; print(limit_malloc_arenas())"


def run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env_extra
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_cap_and_a_users_variable_wins():
    assert run({}) == "True"
    assert run({"MALLOC_ARENA_MAX": "4"}) == "False"
