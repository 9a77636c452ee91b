"""What a second OpenMP team costs one small parallel op: a 12 x 128 softmax (2 threads) timed on
the main thread, on a worker thread while main's team is alive, and on a worker thread after
main freed its team (chatserve/openmp.py).

    python benchmarks/omp_teams_micro.py
"""
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatserve.openmp import release_thread_team  # noqa: E402

torch.set_num_threads(2)
SMALL = torch.randn(12, 128)


def softmax_us(tag: str, n: int = 2000) -> None:
    for _ in range(50):
        SMALL.softmax(-1)
    start = time.perf_counter()
    for _ in range(n):
        SMALL.softmax(-1)
    print(f"{tag:34s} {(time.perf_counter() - start) / n * 1e6:6.2f} us", flush=True)


def in_worker(tag: str) -> None:
    t = threading.Thread(target=softmax_us, args=(tag,))
    t.start()
    t.join()


softmax_us("main thread")
in_worker("worker, main's team alive")
print("main frees its team:", release_thread_team())
in_worker("worker, main's team freed")
