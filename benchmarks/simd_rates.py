"""What this CPU's vector units do a cycle, one thread: the instructions the int4 / Q4_K / int8 weight
tiles spend their time in (kernels/quant_matmul_cpu.cpp, q4k_matmul_cpu.cpp), timed in a loop of
independent operations (throughput, not latency) and converted to cycles with the clock a chain of
dependent adds shows (1 cycle each). No counters needed (a VM has none).

The number to read is int8 multiply-adds a cycle: vpmaddubsw does 32 on a 256-bit register, so at
c cycles an instruction a thread can do at most 32 / c. A verification row costs its weights'
multiply-adds at that rate, whatever the memory does: on a Zen 1 (each 256-bit operation split in
two halves, integer multiplies on one pipe) a row past the first cost +45% of a one-row SmolLM2
step, on a Zen 3 +19% (docs/benchmarks.md, sessions 60-62).

    .venv/bin/python benchmarks/simd_rates.py --out benchmarks/results/simd_rates_<cpu>.json

Builds a small C++ program with the compiler the kernels use (g++, -O2 -mavx2 -mfma); runs it
--rounds times and keeps each number's best. Where the CPU has AVX-512 with VNNI and BF16 it also
times vpdpbusd (256 and 512-bit: the VNNI tiles' multiply-add) and vdpbf16ps (bf16 autocast's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from kernels.cpu_features import cpu_flags, cpu_name

# Flags the 512-bit probes need (AVX-512 with VNNI and BF16: Intel's Cooper Lake on, AMD's Zen 4 on).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")

PROGRAM = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// kIter iterations of 8 independent chains of OP (v the chain's register): throughput-bound, the
// chains' latency hidden. Eight named variables, not an array: an array went through the stack, and
// the loop then timed stores (every instruction ~2 cycles on a Zen 1).
#define STEP(v, OP) { v = OP; asm volatile("" : "+x"(v)); }
#define TIME_8(NAME, TYPE, INIT, OP)                                                       \
  {                                                                                        \
    TYPE v0 = INIT(1), v1 = INIT(2), v2 = INIT(3), v3 = INIT(4), v4 = INIT(5), v5 = INIT(6), \
         v6 = INIT(7), v7 = INIT(8);                                                       \
    double t = now();                                                                      \
    for (long i = 0; i < kIter; ++i) {                                                     \
      STEP(v0, OP(v0)) STEP(v1, OP(v1)) STEP(v2, OP(v2)) STEP(v3, OP(v3))                  \
      STEP(v4, OP(v4)) STEP(v5, OP(v5)) STEP(v6, OP(v6)) STEP(v7, OP(v7))                  \
    }                                                                                      \
    double s = now() - t;                                                                  \
    TYPE all[8] = {v0, v1, v2, v3, v4, v5, v6, v7};                                        \
    sink += reinterpret_cast<const unsigned char*>(all)[0];                                \
    std::printf("%s %.4f\n", NAME, s * ghz * 1e9 / (8.0 * kIter));                        \
  }

int main() {
  constexpr long kIter = 25000000;
  long x = 1;
  double t = now();
  for (long i = 0; i < 4 * kIter; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = 16.0 * kIter / (now() - t) / 1e9;
  std::printf("ghz %.4f\n", ghz);
  const __m256i b8 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  const __m256 cf = _mm256_set1_ps(1.0001f);
  unsigned sink = 0;
#define I8(j) _mm256_set1_epi8(j)
#define I16(j) _mm256_set1_epi16(j)
#define F32(j) _mm256_set1_ps(j)
#define MADDUBS(v) _mm256_maddubs_epi16(v, b8)
#define MADDUBS_ADD(v) _mm256_add_epi16(v, _mm256_maddubs_epi16(v, b8))
#define MADDWD(v) _mm256_madd_epi16(v, ones)
#define FMA(v) _mm256_fmadd_ps(v, cf, cf)
#define ADDW(v) _mm256_add_epi16(v, ones)
#define SHUFB(v) _mm256_shuffle_epi8(v, b8)
  TIME_8("vpmaddubsw", __m256i, I8, MADDUBS)
  TIME_8("vpmaddubsw+vpaddw", __m256i, I16, MADDUBS_ADD)
  TIME_8("vpmaddwd", __m256i, I16, MADDWD)
  TIME_8("vfmadd231ps", __m256, F32, FMA)
  TIME_8("vpaddw", __m256i, I16, ADDW)
  TIME_8("vpshufb", __m256i, I8, SHUFB)
#ifdef WITH_AVX512
  // What the VNNI tiles (the 512-bit ones where the CPU has AVX-512) and bf16 autocast's matmuls run.
  const __m512i b8z = _mm512_set1_epi8(3);
  const __m256i b8y = _mm256_set1_epi8(3);
  const __m512bh bfz = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
#define I32Y(j) _mm256_set1_epi32(j)
#define I32Z(j) _mm512_set1_epi32(j)
#define F32Z(j) _mm512_set1_ps(j)
#define DPBUSD_Y(v) _mm256_dpbusd_epi32(v, b8y, b8y)
#define DPBUSD_Z(v) _mm512_dpbusd_epi32(v, b8z, b8z)
#define DPBF16_Z(v) _mm512_dpbf16_ps(v, bfz, bfz)
#define FMA_Z(v) _mm512_fmadd_ps(v, _mm512_set1_ps(1.0001f), _mm512_set1_ps(1.0001f))
  TIME_8("vpdpbusd-ymm", __m256i, I32Y, DPBUSD_Y)
  TIME_8("vpdpbusd-zmm", __m512i, I32Z, DPBUSD_Z)
  TIME_8("vfmadd231ps-zmm", __m512, F32Z, FMA_Z)
  TIME_8("vdpbf16ps-zmm", __m512, F32Z, DPBF16_Z)
#endif
  std::fprintf(stderr, "%u\n", sink + static_cast<unsigned>(x));  // the results used: nothing optimized away
  return 0;
}
"""


def run_once(binary: Path) -> dict[str, float]:
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    return {name: float(value) for name, value in (line.split() for line in out.splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "rates.cpp", Path(tmp) / "rates"
        source.write_text(PROGRAM)
        with_avx512 = all(flag in cpu_flags() for flag in AVX512_FLAGS)
        extra = ["-DWITH_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"]
        subprocess.run(["g++", "-O2", "-mavx2", "-mfma", *(extra if with_avx512 else []), "-o", str(binary),
                        str(source)], check=True)
        rounds = [run_once(binary) for _ in range(args.rounds)]
    best = {key: (max if key == "ghz" else min)(r[key] for r in rounds) for key in rounds[0]}
    cycles = {key: round(value, 3) for key, value in best.items() if key != "ghz"}
    int8_macs = 32 / cycles["vpmaddubsw"]
    print(f"clock (a chain of dependent adds): {best['ghz']:.2f} GHz")
    for key, value in cycles.items():
        width = 512 if key.endswith("-zmm") else 256
        print(f"  {key:20s} {value:5.2f} cycles a {width}-bit instruction")
    print(f"int8 multiply-adds a cycle a thread (vpmaddubsw): at most {int8_macs:.1f}; "
          f"float32 (vfmadd231ps): at most {8 / cycles['vfmadd231ps']:.1f}")
    if "vpdpbusd-zmm" in cycles:
        vnni_macs = 64 / cycles["vpdpbusd-zmm"]
        print(f"with AVX-512 VNNI (vpdpbusd, 64 a 512-bit instruction): at most {vnni_macs:.1f}; "
              f"bf16 (vdpbf16ps, 32 pairs): at most {32 / cycles['vdpbf16ps-zmm']:.1f} multiply-adds a cycle")
    else:
        vnni_macs = None
        print("no AVX-512 VNNI and BF16 here: the 512-bit probes not run")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "kind": "simd-rates", "ghz": round(best["ghz"], 3), "cycles": cycles,
            "int8_macs_per_cycle": round(int8_macs, 2),
            "vnni_int8_macs_per_cycle": vnni_macs and round(vnni_macs, 2), "rounds": rounds,
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": cpu_name(),
                        "loadavg": os.getloadavg()}}, indent=1))


if __name__ == "__main__":
    main()
