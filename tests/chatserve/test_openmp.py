"""release_thread_team frees the calling thread's OpenMP workers, so a later engine thread's
team is the only one (see chatserve/openmp.py for what a second team costs)."""

import os
import threading

import torch

from chatserve.openmp import release_thread_team


def num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_parallel_op() -> None:
    torch.randn(1 << 20).exp_()  # 1M elements: well above ATen's grain size, so a parallel region


def test_release_frees_the_calling_threads_team():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def in_fresh_thread(out: dict) -> None:  # a fresh thread has no team yet
            before = num_os_threads()
            run_parallel_op()
            out["with_team"] = num_os_threads()
            out["released"] = release_thread_team()
            out["after"] = num_os_threads()
            out["before"] = before

        out: dict = {}
        t = threading.Thread(target=in_fresh_thread, args=(out,))
        t.start()
        t.join()
        assert out["with_team"] == out["before"] + 1  # one OpenMP worker joined the thread
        assert out["released"] is True
        assert out["after"] == out["before"]
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
