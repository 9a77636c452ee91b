"""release_thread_team frees the calling thread's OpenMP workers, so a later engine thread's
team is the only one (see chatserve/openmp.py for what a second team costs)."""

import os
import threading
import time

import torch

from chatserve.openmp import release_thread_team


def os_thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def wait_until_gone(tids: set[str], timeout: float = 5.0) -> set[str]:
    """Which of `tids` are still listed once they are gone or the timeout passes. A joined thread
    can stay listed in /proc for a moment after pthread_join returns (the kernel clears its tid
    before it finishes exiting), so one read straight after the release can race."""
    deadline = time.monotonic() + timeout
    while (left := tids & os_thread_ids()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def run_parallel_op() -> None:
    torch.randn(1 << 20).exp_()  # 1M elements: well above ATen's grain size, so a parallel region


def test_release_frees_the_calling_threads_team():
    """Thread ids, not counts: other threads of the test process (a server from an earlier test
    winding down) may come and go meanwhile."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def in_fresh_thread(out: dict) -> None:  # a fresh thread has no team yet
            before = os_thread_ids()
            run_parallel_op()
            out["team"] = os_thread_ids() - before
            out["released"] = release_thread_team()
            out["left"] = wait_until_gone(out["team"])

        out: dict = {}
        t = threading.Thread(target=in_fresh_thread, args=(out,))
        t.start()
        t.join()
        assert len(out["team"]) >= 1  # an OpenMP worker joined the thread
        assert out["released"] is True
        assert out["left"] == set()
    finally:
        torch.set_num_threads(saved)


def test_async_engine_releases_the_loading_threads_team(tiny_llama_dir):
    from chatserve.async_engine import AsyncEngine
    from chatserve.config import EngineConfig
    from chatserve.engine import Engine

    ae = AsyncEngine(Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20)), "tiny")
    try:
        assert ae.released_openmp_team is True
    finally:
        ae.shutdown()
