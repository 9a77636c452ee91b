"""A model's weights in 2 MiB pages (Linux transparent huge pages) on the CPU.

A decode step streams every weight once: ~1 GB for Qwen2.5-Coder-1.5B in int4, ~250,000 pages of
4 KiB, each a TLB miss (the second-level TLB of a Zen 3 holds 2,048 entries), and the hardware
prefetchers stop at every 4 KiB boundary. The same bytes in 2 MiB pages read faster: a cold Q4_K
layer of the 1.5B at one row 1.10x, decode ~1.05x (Qwen 1.5B with and without its draft, SmolLM2;
docs/benchmarks.md, session 46). torch's allocator gives no huge pages (the kernel's default gives
them only to memory marked with madvise), so `move_to_huge_pages` copies a loaded model's large
tensors into one anonymous mapping marked MADV_HUGEPAGE, where the kernel backs each aligned 2 MiB
with one page as it is first written.

Nothing changes but where the bytes live: the same values, dtypes, shapes and strides, tensors
that shared memory still share it. Where the kernel has no transparent huge pages, or
CHATSERVE_NO_HUGE_PAGES is set, nothing moves.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases) stay where they are: they are read from cache
ALIGN = 64  # each tensor's start in the mapping: a cache line (the kernels' loads are unaligned anyway)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give huge pages here: Linux with transparent huge pages
    not set to "never", and CHATSERVE_NO_HUGE_PAGES unset."""
    if os.environ.get("CHATSERVE_NO_HUGE_PAGES") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _mapping(nbytes: int) -> tuple[torch.Tensor, int]:
    """A new anonymous mapping of at least nbytes marked MADV_HUGEPAGE, as a uint8 tensor (which
    keeps it alive), and the offset of its first 2 MiB boundary."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before any page of it is touched
    whole = torch.frombuffer(region, dtype=torch.uint8)
    return whole, -whole.data_ptr() % HUGE_PAGE  # (the mapping starts on a 4 KiB boundary)


def move_to_huge_pages(module: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move module's CPU parameters and buffers of at least min_bytes into one mapping in huge
    pages; returns the bytes moved (0 where not available()). Call it before anything keeps raw
    pointers to the old memory (a LayerStack built from the layers: reset it after). Moved tensors
    that shared a storage move together and keep sharing it (a smaller one beside them stays)."""
    if not available():
        return 0
    # storage address -> its users: (owner, kind, name, byte offset into the storage); tensors are
    # not held, so that each old storage is freed as soon as its users have moved
    users: dict[int, list[tuple[nn.Module, str, str, int]]] = {}
    spans: dict[int, tuple[int, int]] = {}  # storage address -> the bytes [lo, hi) of it they read
    for owner in module.modules():
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.nbytes < min_bytes:
                    continue
                key = t.untyped_storage().data_ptr()
                lo, hi = _byte_span(t)
                old_lo, old_hi = spans.get(key, (lo, hi))
                spans[key] = (min(lo, old_lo), max(hi, old_hi))
                users.setdefault(key, []).append((owner, kind, name, lo))
    size = sum(_aligned(hi - lo) for lo, hi in spans.values())
    if size == 0:
        return 0
    whole, at = _mapping(size)
    for key, (lo, hi) in spans.items():  # one storage at a time: the old one is freed once its users moved
        for n, (owner, kind, name, offset) in enumerate(users[key]):
            t = getattr(owner, name)  # (a parameter two modules share, a tied LM head's, may have moved already)
            if n == 0:
                whole[at : at + hi - lo].copy_(_bytes_of(t.untyped_storage())[lo:hi])
            moved = torch.empty(0, dtype=t.dtype).set_(whole.untyped_storage(), (at + offset - lo) // t.element_size(),
                                                       t.shape, t.stride())
            if kind == "param":
                t.data = moved
            else:
                owner._buffers[name] = moved
        at += _aligned(hi - lo)
    return size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [lo, hi) of t's storage that t reads."""
    lo = t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return lo, lo + extent * t.element_size()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor that shares them."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
