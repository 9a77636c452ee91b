"""The C++ CPU kernels (AVX2): one extension built from kernels/*_cpu.cpp by torch.utils.cpp_extension
on first use (~1-2 min, cached per machine and per source content in ~/.cache/torch_extensions), or None.
The weight matmuls also carry AVX-512 VNNI tiles, compiled beside the AVX2 ones and taken at run time
where the CPU has them (same outputs; `CHATSERVE_NO_VNNI=1` or `extension().set_vnni(False)` keeps AVX2).

None where it cannot be built (no compiler or ninja), on a CPU without AVX2/FMA/F16C, or when
CHATSERVE_NO_CPU_KERNELS is set; every caller then takes its plain-torch path (correct, slower).
Users: kernels/quant_matmul.py (int4 / int8 weight matmuls), kernels/decode_ops.py (the decode
step's norms, RoPE, KV store, attention, SiLU), kernels/sampling_ops.py (a row of logits at a temperature),
spec/suffix.py (suffix decoding's draft).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from pathlib import Path

from kernels.cpu_features import cpu_flags

_DIR = Path(__file__).parent
SOURCES = ("quant_matmul_cpu.cpp", "q4k_matmul_cpu.cpp", "decode_ops_cpu.cpp", "decode_stack_cpu.cpp",
           "sampling_cpu.cpp", "suffix_cpu.cpp", "cpu_ext_bindings.cpp")
CPU_FLAGS = ("avx2", "fma", "f16c")
NAME = "chatserve_cpu"


def _build_directory() -> Path:
    """One build directory per content of the sources and headers and per torch installation: two
    checkouts, versions or virtualenvs of chatserve on one machine each keep their own build
    instead of rebuilding the shared one in turn (torch rebuilds whenever a path in build.ninja
    changes; a CI venv and a dev venv did, and a build killed mid-way left a lock that stalled the
    next test run)."""
    import torch
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256()
    digest.update(f"{torch.__version__}\0{Path(torch.__file__).parent}\0".encode())
    for path in sorted([*(_DIR / s for s in SOURCES), *_DIR.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    directory = Path(_get_build_directory(NAME, verbose=False)).parent / f"{NAME}-{digest.hexdigest()[:12]}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _staged_sources(directory: Path) -> Path:
    """The sources and headers copied into directory/src: the paths in build.ninja are then the
    same from every checkout, so git worktrees of one content share one build instead of each
    rebuilding it in turn."""
    src = directory / "src"
    src.mkdir(exist_ok=True)
    for path in [*(_DIR / s for s in SOURCES), *_DIR.glob("*.h")]:
        staged = src / path.name
        data = path.read_bytes()
        if not staged.exists() or staged.read_bytes() != data:
            tmp = staged.with_suffix(staged.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(staged)
    return src


@contextlib.contextmanager
def _builder(directory: Path):
    """Be the only chatserve process loading (and maybe building) in directory, and clear a dead
    build's lock. torch's builder waits, forever, while the directory holds a `lock` file, which a
    build killed midway (Ctrl-C at the first start, a killed test run) leaves behind. Every load
    here holds an flock on directory/builder.flock, which the kernel releases when its holder
    dies: once we hold it, no live build is under way, so a `lock` file is a dead one's."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no flock, nothing cleared
        yield
        return
    with open(directory / "builder.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live build; a dead builder's flock is gone
        lock = directory / "lock"
        if lock.exists():
            print(f"chatserve: removing a killed build's lock ({lock})", file=sys.stderr)
            lock.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _use_one_ninja() -> None:
    """Put pip's ninja (a dependency; it lives beside the interpreter) first on PATH, whatever else
    is installed. torch runs whichever `ninja` PATH finds, and two versions rebuild each other's
    work: Debian's 1.11 and pip's 1.13 keep .ninja_log in formats that hash commands differently,
    so a process started from the activated venv (pip's) after one started as .venv/bin/python
    (Debian's, on PATH) rebuilt all the kernels, ~1.5 min of two cores, and so on at each switch."""
    venv_bin = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(venv_bin, "ninja")):
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != venv_bin:
            os.environ["PATH"] = venv_bin + os.pathsep + path
    # else: whichever ninja PATH finds (none: the build fails and the plain-torch paths serve)


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled module, or None (see the module docstring)."""
    if os.environ.get("CHATSERVE_NO_CPU_KERNELS"):
        return None
    if not set(CPU_FLAGS) <= cpu_flags():
        return None
    _use_one_ninja()
    try:
        from torch.utils.cpp_extension import load

        directory = _build_directory()
        with _builder(directory):
            src = _staged_sources(directory)
            print("chatserve: loading the C++ CPU kernels (built once per machine, ~1-2 min)", file=sys.stderr,
                  flush=True)
            # -fopenmp: at::parallel_for is a header template around `#pragma omp parallel`; without
            # the flag the pragma is dropped and every kernel runs on one thread. The soname
            # libgomp.so.1 resolves to the copy torch already loaded: one OpenMP runtime, one team.
            return load(name=NAME, sources=[str(src / s) for s in SOURCES],
                        extra_include_paths=[str(src)],
                        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                        build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler / ninja: the slow paths still work
        print(f"chatserve: the C++ CPU kernels could not be built ({type(error).__name__}: "
              f"{str(error).splitlines()[0] if str(error) else ''}); using the plain-torch paths",
              file=sys.stderr)
        return None


def is_available() -> bool:
    return extension() is not None


def build_id() -> str:
    """Which build of the kernels this process runs ("none" without one): its directory's name,
    a digest of the sources, headers and torch installation."""
    return _build_directory().name if is_available() else "none"


def build_environment() -> dict:
    """What kernels run here and how, for keys of what is measured or converted on this machine
    (spec_costs.costs_key, converted.converted_key): the CPU's name and flags, torch's version, the
    kernels' build and the CHATSERVE_* switches (the cache dir's aside)."""
    import torch

    from kernels.cpu_features import cpu_name

    switches = {k: v for k, v in os.environ.items() if k.startswith("CHATSERVE_") and k != "CHATSERVE_CACHE"}
    return {"cpu": [cpu_name(), sorted(cpu_flags())], "torch": torch.__version__, "kernels": build_id(),
            "switches": switches}
