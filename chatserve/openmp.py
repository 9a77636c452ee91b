"""Keep one OpenMP team in the process: free the loading thread's before the engine thread runs.

libgomp (the OpenMP runtime of torch's CPU wheels) gives every thread that enters a parallel
region its own team of worker threads, kept until that thread exits. Once the teams' threads
outnumber the CPUs, libgomp throttles its spin-wait, so each parallel region wakes its workers
through a futex instead. On the 2-core machine that turns a 3 us softmax of 12 x 128 into
25-45 us and makes a Qwen 1.5B int8 decode step ~20% slower on the engine thread than on the
thread that loaded the model (65 vs 80-90 ms TPOT; benchmarks/thread_probe.py).

The model is loaded on one thread (main) and stepped on another (AsyncEngine), so the loading
thread's team has to go before the engine thread starts: omp_pause_resource_all (OpenMP 5.0)
frees the calling thread's team. If that thread runs a parallel torch op again later, a new
team appears and the engine thread is throttled again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os

import torch

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch runs on (dlopen of a loaded library returns that library), or None."""
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    found = ctypes.util.find_library("gomp")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker threads; True if the runtime did so."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
