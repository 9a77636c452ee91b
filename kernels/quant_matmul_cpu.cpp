// Weight-only quantized matmuls for x86 CPUs with AVX2 (kernels/quant_matmul.py): int4 weights
// (below) and int8 weights (q8_matmul, further down), both against activations quantized to int8.
//
// Weight layout (groups of 32 as GGUF's Q4_1 block; K % 64 == 0), one row per output feature:
//   codes  [N, K/2] uint8: groups 2p and 2p + 1 of row n share bytes [32p, 32p + 32); byte j
//          holds the code of k = 64p + j in its low nibble and of k = 64p + 32 + j in its high
//          nibble (0..15), so one 32-byte load splits into two groups with two masks
//   params [N, 2, K/32] fp16: d of every group, then m of every group; w = d * code + m
// Activations are quantized per row and group of 32 (as llama.cpp's Q8_1):
//   xq [M, K] int8, xd [M, K/32] float (x ~= xd * xq), xs [M, K/32] float (= xd * sum(xq))
// so that  y[r, n] = sum_g d_g * xd_g * dot(code_g, xq_g) + m_g * xs_g.
// Every output element is computed the same way whatever M is: rows never mix, which keeps
// greedy speculation (verification rows) equal to one-row decoding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "cpu_simd.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace chatserve {

namespace {
bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
std::atomic<bool> vnni_on{cpu_has_vnni() && std::getenv("CHATSERVE_NO_VNNI") == nullptr};
}  // namespace

bool vnni_enabled() { return vnni_on.load(std::memory_order_relaxed); }

bool set_vnni(bool on) { return vnni_on.exchange(on && cpu_has_vnni()); }

namespace {
// The OS saving the tile state (XCR0 bits 17, 18) and Linux's per-process permission for it
// (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile instruction kills the process).
bool tiles_granted() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24, 22), AVX512-BF16 (leaf 7 subleaf 1: EAX bit 5).
bool cpu_has_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
  return cpu_has_vnni() && tiles_granted();
}
// AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25).
bool cpu_has_amx_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  return cpu_has_vnni() && __builtin_cpu_supports("avx512dq") && tiles_granted();
}
const bool amx_present = cpu_has_amx();
const bool amx_int8_present = cpu_has_amx_int8();
std::atomic<bool> amx_on{amx_present && std::getenv("CHATSERVE_NO_AMX") == nullptr};
std::atomic<bool> amx_int8_on{amx_int8_present && std::getenv("CHATSERVE_NO_AMX") == nullptr};
}  // namespace

bool amx_enabled() { return amx_on.load(std::memory_order_relaxed); }

bool set_amx(bool on) { return amx_on.exchange(on && amx_present); }

bool amx_int8_enabled() { return amx_int8_on.load(std::memory_order_relaxed); }

bool set_amx_int8(bool on) { return amx_int8_on.exchange(on && amx_int8_present); }

}  // namespace chatserve

namespace {

using chatserve::broadcast4;
using chatserve::hsum;
using chatserve::kPrefetchAhead;
using chatserve::prefetch;

constexpr int kGroup = 32;

// int32 lanes of code . xq for one group (u8 x s8 pairs -> i16, |.| <= 2 * 15 * 127), as float.
inline __m256 group_dot(__m256i codes, const int8_t* xq, __m256i ones) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, a), ones));
}

// The end of both Q4_1 tiles for one output feature: groups [g, G) (the last G % 8; G is even: K %
// 64 == 0) into acc (even and odd groups), then y[r * N] for the R rows from acc, macc (the m * xs
// terms of the groups before g) and the tail's own m * xs terms.
template <int R>
inline void finish_rows(const uint8_t* c, const uint16_t* dh, const uint16_t* mh, const int8_t* xq, const float* xd,
                        const float* xs, int64_t K, int64_t g, int64_t r0, __m256 (&acc)[R][2], const __m256* macc,
                        float* y, int64_t N) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  float tail[R] = {};
  for (; g < G; g += 2) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (g / 2) * 32));
    const __m256i wa = _mm256_and_si256(v, low4);
    const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const float da = _cvtsh_ss(dh[g]), db = _cvtsh_ss(dh[g + 1]);
    const float ma = _cvtsh_ss(mh[g]), mb = _cvtsh_ss(mh[g + 1]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xr = xq + row * K + g * kGroup;
      acc[r][0] = _mm256_fmadd_ps(group_dot(wa, xr, ones), _mm256_set1_ps(da * xd[row * G + g]), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(group_dot(wb, xr + kGroup, ones), _mm256_set1_ps(db * xd[row * G + g + 1]), acc[r][1]);
      tail[r] += ma * xs[row * G + g] + mb * xs[row * G + g + 1];
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * N] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + hsum(macc[r]) + tail[r];
}

// Output rows [n0, n1) for activation rows [r0, r0 + R), R <= 4 (a register tile). Groups go
// 8 at a time: their 8 scales d * xd come from one fp16 load and one multiply, and each group
// takes its lane by a permute; the m * xs terms are one FMA per 8 groups. Two accumulators per
// row (even / odd groups) keep the FMA latency off the critical path at R = 1.
template <int R>
void tile(const uint8_t* codes, const at::Half* params, const int8_t* xq, const float* xd, const float* xs,
          float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(params) + n * 2 * G;  // d [G], then m [G]
    const uint16_t* mh = dh + G;
    __m256 acc[R][2], macc[R];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = macc[r] = _mm256_setzero_ps();
    prefetch(dh + 8 * 2 * G);  // this row's d and m, 8 rows on (~0.9 KiB at K = 896)
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      prefetch(c + g / 2 * 32 + kPrefetchAhead);
      prefetch(c + g / 2 * 32 + kPrefetchAhead + 64);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + g)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + g)));
      __m256 sv[R];
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        sv[r] = _mm256_mul_ps(dv, _mm256_loadu_ps(xd + row * G + g));
        macc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + row * G + g), macc[r]);
      }
      for (int q = 0; q < 4; ++q) {  // a pair of groups: 32 bytes, low nibbles then high nibbles
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (g / 2 + q) * 32));
        const __m256i wa = _mm256_and_si256(v, low4);
        const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256i ia = _mm256_set1_epi32(2 * q), ib = _mm256_set1_epi32(2 * q + 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + (r0 + r) * K + (g + 2 * q) * kGroup;
          acc[r][0] = _mm256_fmadd_ps(group_dot(wa, xr, ones), _mm256_permutevar8x32_ps(sv[r], ia), acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(group_dot(wb, xr + kGroup, ones), _mm256_permutevar8x32_ps(sv[r], ib), acc[r][1]);
        }
      }
    }
    finish_rows<R>(c, dh, mh, xq, xd, xs, K, g, r0, acc, macc, y + n, N);
  }
}


// The same groups of 32 interleaved by 8 output features (quant/int4.interleave; N % 8 == 0), for
// features 8 g .. 8 g + 8 and group b:
//   codes8  [N/8, K/32, 128] uint8: step q (0..3) is 32 bytes at 32 q; byte 4 n + i holds feature
//           n's code for k = 32 b + 4 q + i in its low nibble, k + 16 in its high one
//   params8 [N/8, K/32, 16] fp16: d of the 8 features, then m
// As in the Q4_K tile, vpmaddubsw of one step against 4 activation bytes broadcast gives the 8
// features' pair sums, and the group's 8 steps add up in int16 (|sum| <= 8 * 2 * 15 * 127 =
// 30480); then one vpmaddwd, one conversion and two multiply-adds per group and row (d * xd,
// then m * xs, into one accumulator). The row-major tile spends a load, vpmaddubsw, vpmaddwd, a
// conversion, a permute and an FMA per group, feature and row: on a Zen 3 it ran 1.1-1.3x slower
// at one row and 1.4-2.2x from 3 rows (docs/benchmarks.md, session 38). The 8 outputs are one
// vector: no horizontal sums.
template <int R>
void tile_x8(const uint8_t* codes, const at::Half* params, const int8_t* xq, const float* xd, const float* xs,
             const float* bias, float* y, int64_t K, int64_t N, int64_t r0, int64_t g) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* cg = codes + g * G * 128;
  const uint16_t* pg = reinterpret_cast<const uint16_t*>(params) + g * G * 16;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    const uint8_t* cb = cg + b * 128;
    prefetch(cb + kPrefetchAhead);
    prefetch(cb + kPrefetchAhead + 64);
    prefetch(pg + b * 16 + kPrefetchAhead / 8);  // the params' stream, 1/4 the codes' bytes
    __m256i sum16[R];
    for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
    chatserve::nibble_sub_block<R>(cb, xq + r0 * K + b * kGroup, K, sum16);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + b * 16)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + b * 16 + 8)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xd[row * G + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[row * G + b]), acc[r]);
    }
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + g * 8) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + g * 8, _mm256_add_ps(acc[r], bv));
}


// tile on 512-bit registers where AVX-512 VNNI is: a pair of groups (32 bytes of codes, low nibbles
// group a, high nibbles group b) in one register, the codes broadcast to both halves and shifted by
// 0 and 4, against the two groups' 64 activation bytes in one load; vpdpbusd gives each group's
// int32 lanes (tile's vpmaddubsw + vpmaddwd, the same integers), and one multiply-add scales both
// (low half tile's acc[r][0], high half acc[r][1]). The tail and the sums are tile's (finish_rows): the same
// outputs bit for bit, with about half the instructions per group and row.
template <int R>
CHATSERVE_VNNI void tile_vnni(const uint8_t* codes, const at::Half* params, const int8_t* xq, const float* xd,
                              const float* xs, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // 0 | 4
  __m512i lanes[4];  // the scales of groups 2 q and 2 q + 1, each in its half
  for (int q = 0; q < 4; ++q)
    lanes[q] = _mm512_inserti64x4(_mm512_set1_epi32(2 * q), _mm256_set1_epi32(2 * q + 1), 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(params) + n * 2 * G;  // d [G], then m [G]
    const uint16_t* mh = dh + G;
    __m512 acc[R];
    __m256 macc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      macc[r] = _mm256_setzero_ps();
    }
    prefetch(dh + 8 * 2 * G);
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      prefetch(c + g / 2 * 32 + kPrefetchAhead);
      prefetch(c + g / 2 * 32 + kPrefetchAhead + 64);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + g)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + g)));
      __m512 sv[R];
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        sv[r] = _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_loadu_ps(xd + row * G + g)));
        macc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + row * G + g), macc[r]);
      }
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (g / 2 + q) * 32)));
        const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(v, shifts), low4);
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_loadu_si512(xq + (r0 + r) * K + (g + 2 * q) * kGroup);
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes[q], sv[r]), acc[r]);
        }
      }
    }
    __m256 split[R][2];  // tile's acc[r][0] and acc[r][1]
    for (int r = 0; r < R; ++r) {
      split[r][0] = _mm512_castps512_ps256(acc[r]);
      split[r][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
    }
    finish_rows<R>(c, dh, mh, xq, xd, xs, K, g, r0, split, macc, y + n, N);
  }
}

// int8 weights, one scale per output row (quant/int8.py: w = q * s, |q| <= 127), against the same
// quantized activations: y[r, n] = s_n * sum_g xd_g * dot(q_g, xq_g). Signed x signed products go
// through vpmaddubsw as |q| x (xq with q's sign) (llama.cpp's Q8_0 trick); |q|, |xq| <= 127 keep
// the pair sums inside int16. Same tiling and per-row independence as the int4 tile.
template <int R>
void tile8(const int8_t* w, const float* ws, const int8_t* xq, const float* xd, float* y,
           int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m256 acc[R][2];
    float tail[R];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      tail[r] = 0.f;
    }
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      __m256 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm256_loadu_ps(xd + (r0 + r) * G + g);
      for (int q = 0; q < 8; ++q) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + (g + q) * kGroup));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        const __m256i iq = _mm256_set1_epi32(q);
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r0 + r) * K + (g + q) * kGroup));
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
          acc[r][q & 1] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(sv[r], iq), acc[r][q & 1]);
        }
      }
    }
    for (; g < G; ++g) {  // the last G % 8 groups
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * kGroup));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + row * K + g * kGroup));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
        acc[r][g & 1] = _mm256_fmadd_ps(dot, _mm256_set1_ps(xd[row * G + g]), acc[r][g & 1]);
      }
    }
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) * ws[n];
  }
}


// The same int8 weights interleaved by 8 output features (quant/int8.pack_int8; N % 8 == 0): for
// features 8 g .. 8 g + 8, step t of K / 4 is 32 bytes, byte 4 i + j the weight of feature 8 g + i
// at k = 4 t + j. vpmaddubsw of a step against 4 activation bytes broadcast gives the 8 features'
// pair sums at once, so a row costs sign, vpmaddubsw, vpmaddwd and an add per 32 multiply-adds,
// and one float multiply-add per 8 steps (a group of 32: the activation's scale), where the
// row-major tile8 spends six vector ops per 32 (a float conversion, a permute and an FMA per
// group and feature). The 8 outputs are one vector: no horizontal sums.

// A group of 32 inputs of 8 interleaved features is 256 bytes: its 4 cache lines, kPrefetchAhead on.
inline void prefetch_group8(const int8_t* p) {
  for (int line = 0; line < 4; ++line) prefetch(p + kPrefetchAhead + 64 * line);
}

template <int R>
void tile8x8(const int8_t* w, const float* ws, const int8_t* xq, const float* xd, float* y,
             int64_t K, int64_t N, int64_t r0, int64_t g) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* wg = w + g * 8 * K;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < G; ++kb) {
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    prefetch_group8(wg + kb * 256);
    for (int t = 0; t < kGroup / 4; ++t) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (kb * 8 + t) * 32));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast4(xq + (r0 + r) * K + kb * kGroup + 4 * t);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(xd[(r0 + r) * G + kb]), acc[r]);
  }
  const __m256 scale = _mm256_loadu_ps(ws + g * 8);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + g * 8, _mm256_mul_ps(acc[r], scale));
}

// tile8x8 with vpdpbusd: |w| against xq with w's sign, four products into each int32 lane at once
// (no vpmaddubsw pair sums to widen). The pair sums never saturate (|.| <= 2 * 127 * 127), so the
// integers, and the outputs, are tile8x8's. Two accumulators per row (even and odd steps) for latency.
template <int R>
CHATSERVE_VNNI void tile8x8_vnni(const int8_t* w, const float* ws, const int8_t* xq, const float* xd, float* y,
                                 int64_t K, int64_t N, int64_t r0, int64_t g) {
  const int64_t G = K / kGroup;
  const int8_t* wg = w + g * 8 * K;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < G; ++kb) {
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    prefetch_group8(wg + kb * 256);
#pragma GCC unroll 8
    for (int t = 0; t < kGroup / 4; ++t) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (kb * 8 + t) * 32));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast4(xq + (r0 + r) * K + kb * kGroup + 4 * t);
        sum[r][t & 1] = _mm256_dpbusd_epi32(sum[r][t & 1], aw, _mm256_sign_epi8(xv, wv));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum[r][0], sum[r][1])),
                               _mm256_set1_ps(xd[(r0 + r) * G + kb]), acc[r]);
  }
  const __m256 scale = _mm256_loadu_ps(ws + g * 8);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + g * 8, _mm256_mul_ps(acc[r], scale));
}

// tile8x8_vnni for groups g and g + 1 in one 512-bit register (as Q4_K's tile_pair_vnni), and without
// the per-row sign: vpdpbusd takes the weights as its signed operand and the activations shifted to
// unsigned, xu = xq + 128 (xq ^ 0x80, made once per call), so sum xu w = sum xq w + 128 sum w, and
// sum w comes from one more vpdpbusd against ones per step, shared by every row. The integers are
// tile8x8's (|sum| < 2^31), then the same float operations per lane: same outputs. Per step and
// row one broadcast and one vpdpbusd for 16 features, where tile8x8_vnni spends a sign and a
// vpdpbusd for 8.
template <int R>
CHATSERVE_VNNI void tile8x8_pair_vnni(const int8_t* w, const float* ws, const uint8_t* xu, const float* xd, float* y,
                                      int64_t K, int64_t N, int64_t r0, int64_t g) {
  const int64_t G = K / kGroup;
  const int8_t* wa = w + g * 8 * K;
  const int8_t* wb = wa + 8 * K;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < G; ++kb) {
    __m512i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    __m512i sw[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int line = 0; line < 4; ++line) {
      const int64_t o = chatserve::next_pair(kb * 256 + 64 * line, kPrefetchAhead, 8 * K);
      prefetch(wa + o);
      prefetch(wb + o);
    }
#pragma GCC unroll 8
    for (int t = 0; t < kGroup / 4; ++t) {
      const __m512i wv = chatserve::halves(wa + (kb * 8 + t) * 32, wb + (kb * 8 + t) * 32);
      sw[t & 1] = _mm512_dpbusd_epi32(sw[t & 1], ones, wv);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xu + (r0 + r) * K + kb * kGroup + 4 * t, 4);
        sum[r][t & 1] = _mm512_dpbusd_epi32(sum[r][t & 1], _mm512_set1_epi32(x4), wv);
      }
    }
    const __m512i shift = _mm512_slli_epi32(_mm512_add_epi32(sw[0], sw[1]), 7);  // 128 sum w
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(sum[r][0], sum[r][1]), shift)),
                               _mm512_set1_ps(xd[(r0 + r) * G + kb]), acc[r]);
  }
  const __m512 scale = _mm512_loadu_ps(ws + g * 8);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + g * 8, _mm512_mul_ps(acc[r], scale));
}

// xq ^ 0x80 = xq + 128 as unsigned bytes (tile8x8_pair_vnni's activations).
CHATSERVE_VNNI void to_unsigned(const int8_t* xq, uint8_t* xu, int64_t n) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    _mm512_storeu_si512(xu + i, _mm512_xor_si512(_mm512_loadu_si512(xq + i), flip));
  for (; i < n; ++i) xu[i] = static_cast<uint8_t>(xq[i]) ^ 0x80;
}

// float32 weights [N, K] (K % 8 == 0): each output a dot product in a fixed order (8-wide chunks,
// even and odd chunks in two accumulators), so a row's result never depends on the row count,
// which MKL's sgemm / sgemv switch does not promise (a decode row and the same row verified among
// others differed in the last bits, enough to flip a greedy near-tie).
template <int R>
void tile_f32(const float* w, const float* x, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (r0 + r) * K + k;
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
      }
    }
    if (k < K) {  // one last chunk of 8
      const __m256 w0 = _mm256_loadu_ps(wr + k);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (r0 + r) * K + k), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

}  // namespace

namespace {

// Activations per row and group of 32: q int8, d the group's scale, s = d * sum(q).
void quantize_rows_raw(const float* src, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  at::parallel_for(0, M * (K / kGroup), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* v = src + i * kGroup;
      float amax = 0.f;
      for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const int qv = static_cast<int>(std::nearbyint(v[j] * inv));
        q[i * kGroup + j] = static_cast<int8_t>(qv);
        sum += qv;
      }
      d[i] = scale;
      s[i] = scale * static_cast<float>(sum);
    }
  });
}

// out [M, N] = x @ W.T (+ bias) for activations quantized by quantize_rows_raw.
void q4_run(const int8_t* q, const float* d, const float* s, const uint8_t* c, const at::Half* p, const float* bias,
            float* out, int64_t M, int64_t K, int64_t N) {
  // Split the output features over threads. Each thread walks its rows of W in chunks small
  // enough to stay in L2 (~128 KiB of codes) and runs every activation row over a chunk before
  // the next (tiles of 4 activation rows share each unpacked group): W is read from memory once.
  const int64_t chunk = std::max<int64_t>(16, (128 * 1024) / (K / 2));
  const bool vnni = chatserve::vnni_enabled();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += chunk) {
      const int64_t ne = std::min(nb + chunk, n1);
      chatserve::for_row_tiles(M, [&](auto rows, int64_t r) {
        constexpr int R = decltype(rows)::value;
        if (vnni) {
          tile_vnni<R>(c, p, q, d, s, out, K, N, r, nb, ne);
        } else {
          tile<R>(c, p, q, d, s, out, K, N, r, nb, ne);
        }
      });
      if (bias != nullptr)
        for (int64_t r = 0; r < M; ++r)
          for (int64_t n = nb; n < ne; ++n) out[r * N + n] += bias[n];
    }
  });
}

void check_q4_weight(const torch::Tensor& codes, const torch::Tensor& params, int64_t K) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && params.scalar_type() == torch::kHalf);
  TORCH_CHECK(codes.is_contiguous() && params.is_contiguous());
  const int64_t N = codes.size(0);
  TORCH_CHECK(K % (2 * kGroup) == 0 && codes.size(1) * 2 == K && params.size(0) == N && params.size(1) == 2 &&
              params.size(2) * kGroup == K);
}

}  // namespace

// x [M, K] float32 -> (xq [M, K] int8, xd [M, K/32] float32, xs [M, K/32] float32)
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, G}, x.options());
  auto xs = torch::empty({M, G}, x.options());
  quantize_rows_raw(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
  return {xq, xd, xs};
}

// y [M, N] float32 = x @ W.T for the quantized activations of quantize_rows.
torch::Tensor q4_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor xs, torch::Tensor codes,
                        torch::Tensor params) {
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && xd.scalar_type() == torch::kFloat32);
  TORCH_CHECK(xq.is_contiguous() && xd.is_contiguous() && xs.is_contiguous());
  const int64_t M = xq.size(0), K = xq.size(1), N = codes.size(0);
  check_q4_weight(codes, params, K);
  auto y = torch::empty({M, N}, xd.options());
  q4_run(xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(), codes.data_ptr<uint8_t>(),
         params.data_ptr<at::Half>(), nullptr, y.data_ptr<float>(), M, K, N);
  return y;
}

namespace {

// x [M, K] float32 quantized by quantize_rows_raw into this thread's scratch: (q, d, s), valid
// until this thread's next call (the int4 layers' one-call paths allocate nothing but their output).
struct Int4Acts {
  const int8_t* q;
  const float* d;
  const float* s;
};
Int4Acts quantize_to_scratch(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1);
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  q.resize(M * K);
  d.resize(M * (K / kGroup));
  s.resize(M * (K / kGroup));
  quantize_rows_raw(x.data_ptr<float>(), M, K, q.data(), d.data(), s.data());
  return {q.data(), d.data(), s.data()};
}

// The bias [N] float32, checked, or nullptr.
const float* bias_of(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N);
  return bias->data_ptr<float>();
}

}  // namespace

// The int4 layer in one call: quantize x [M, K] float32 (thread-local scratch), multiply, add the
// bias [N] float32 if given. The same numbers as quantize_rows + q4_matmul + bias, ~3 calls fewer.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor params, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_q4_weight(codes, params, K);
  const float* b = bias_of(bias, N);
  const Int4Acts a = quantize_to_scratch(x);
  auto y = torch::empty({M, N}, x.options());
  q4_run(a.q, a.d, a.s, codes.data_ptr<uint8_t>(), params.data_ptr<at::Half>(), b, y.data_ptr<float>(), M, K, N);
  return y;
}

// int4_linear for a weight interleaved by 8 output features (tile_x8), any number of rows: groups
// of 8 features split over threads, each thread's in chunks that stay in L2, every row tile over
// a chunk before the next (W read from memory once per call).
torch::Tensor int4x8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor params,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && params.scalar_type() == torch::kHalf &&
              codes.is_contiguous() && params.is_contiguous() && codes.dim() == 3 && params.dim() == 3);
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, groups = codes.size(0), N = groups * 8;
  TORCH_CHECK(K % (2 * kGroup) == 0 && codes.size(1) == G && codes.size(2) == 128 && params.size(0) == groups &&
              params.size(1) == G && params.size(2) == 16,
              "int4 weight interleaved by 8: codes [N/8, K/32, 128], params [N/8, K/32, 16] (quant/int4.interleave)");
  const float* b = bias_of(bias, N);
  const Int4Acts a = quantize_to_scratch(x);  // (pointers: inside the region below, a thread_local is that thread's)
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const at::Half* p = params.data_ptr<at::Half>();
  float* out = y.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(1, (128 * 1024) / (K / 2 * 8));
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t gb = g0; gb < g1; gb += chunk) {
      const int64_t ge = std::min(gb + chunk, g1);
      chatserve::for_row_tiles(M, [&](auto rows, int64_t r) {
        for (int64_t g = gb; g < ge; ++g) tile_x8<decltype(rows)::value>(c, p, a.q, a.d, a.s, b, out, K, N, r, g);
      });
    }
  });
  return y;
}

// rows [T, K] float32 = qweight's rows ids times their scales: an Int8Embedding's lookup (quant/int8.py),
// each value the float32 product of its int8 and its row's scale, as rows_numpy computes it. qweight [N, K]
// row-major, or (packed) interleaved by 8 as pack_int8 leaves it: row i's 4 bytes of step t at
// ((i / 8) * (K / 4) + t) * 32 + (i % 8) * 4. One call where numpy's indexing, conversion and product
// took ~150 us served a head forward on SmolLM2 (the target's forward had left the caches cold).
torch::Tensor int8_rows(torch::Tensor qweight, torch::Tensor scales, torch::Tensor ids, bool packed) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.dim() == 2 && qweight.is_contiguous());
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == qweight.size(0));
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1);
  const int64_t N = qweight.size(0), K = qweight.size(1), T = ids.size(0);
  TORCH_CHECK(!packed || (N % 8 == 0 && K % 4 == 0), "an interleaved table has N % 8 == 0 and K % 4 == 0");
  const auto id = ids.contiguous();
  const int64_t* ip = id.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK_INDEX(0 <= ip[r] && ip[r] < N, "token ids must be in [0, ", N, ")");
  auto out = torch::empty({T, K}, scales.options());
  const int8_t* q = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) {
    const int64_t i = ip[r];
    const float scale = s[i];
    float* row = o + r * K;
    if (packed) {
      const int8_t* base = q + (i / 8) * K * 8 + (i % 8) * 4;
      for (int64_t t = 0; t < K / 4; ++t)
        for (int j = 0; j < 4; ++j) row[4 * t + j] = static_cast<float>(base[t * 32 + j]) * scale;
    } else {
      const int8_t* src = q + i * K;
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(src[k]) * scale;
    }
  }
  return out;
}

// y [M, N] float32 = x @ (q * s).T for the quantized activations of quantize_rows; q [N, K] int8
// with |q| <= 127, s [N] float32; row-major, or interleaved by 8 output features (tile8x8; N % 8
// == 0). Output features are split over threads, each walking its share in chunks of ~128 KiB of
// weights and running every activation row over a chunk before the next (as q4_matmul): W is
// read from memory once per call.
static torch::Tensor q8_run(torch::Tensor xq, torch::Tensor xd, torch::Tensor qweight, torch::Tensor scales, bool packed) {
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && qweight.scalar_type() == torch::kInt8);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && xd.scalar_type() == torch::kFloat32);
  TORCH_CHECK(xq.is_contiguous() && xd.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous());
  const int64_t M = xq.size(0), K = xq.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) == K && scales.numel() == N && xd.size(1) * kGroup == K);
  TORCH_CHECK(!packed || N % 8 == 0, "an int8 weight interleaved by 8 needs N % 8 == 0");
  auto y = torch::empty({M, N}, xd.options());
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* ws = scales.data_ptr<float>();
  const int8_t* q = xq.data_ptr<int8_t>();
  const float* d = xd.data_ptr<float>();
  float* out = y.data_ptr<float>();
  if (packed) {
    const bool vnni = chatserve::vnni_enabled();
    thread_local std::vector<uint8_t> xu_buffer;  // this (the calling) thread's: workers see xu
    if (vnni) {
      xu_buffer.resize(M * K);
      to_unsigned(q, xu_buffer.data(), M * K);
    }
    const uint8_t* xu = xu_buffer.data();
    // groups of 8 features, an even number (the VNNI tile takes them in pairs)
    const int64_t chunk = std::max<int64_t>(2, (128 * 1024) / (8 * K)) & ~int64_t{1};
    at::parallel_for(0, N / 8, 2, [&](int64_t g0, int64_t g1) {
      for (int64_t gb = g0; gb < g1; gb += chunk) {
        const int64_t ge = std::min(gb + chunk, g1);
        if (vnni) {
          chatserve::for_row_tiles<chatserve::kPairRows>(M, [&](auto rows, int64_t r) {
            constexpr int R = decltype(rows)::value;
            int64_t g = gb;
            for (; g + 2 <= ge; g += 2) tile8x8_pair_vnni<R>(w, ws, xu, d, out, K, N, r, g);
            if (g < ge) {  // an odd group at the end of a thread's range
              chatserve::for_row_tiles(R, [&](auto part, int64_t p) {
                tile8x8_vnni<decltype(part)::value>(w, ws, q, d, out, K, N, r + p, g);
              });
            }
          });
        } else {
          chatserve::for_row_tiles(M, [&](auto rows, int64_t r) {
            for (int64_t g = gb; g < ge; ++g) tile8x8<decltype(rows)::value>(w, ws, q, d, out, K, N, r, g);
          });
        }
      }
    });
  } else {
    const int64_t chunk = std::max<int64_t>(16, (128 * 1024) / K);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t nb = n0; nb < n1; nb += chunk) {
        const int64_t ne = std::min(nb + chunk, n1);
        chatserve::for_row_tiles(M, [&](auto rows, int64_t r) { tile8<decltype(rows)::value>(w, ws, q, d, out, K, N, r, nb, ne); });
      }
    });
  }
  return y;
}

torch::Tensor q8_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor qweight, torch::Tensor scales) {
  return q8_run(xq, xd, qweight, scales, false);
}

torch::Tensor q8x8_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor packed, torch::Tensor scales) {
  return q8_run(xq, xd, packed, scales, true);
}

// y [M, N] float32 = x [M, K] @ w [N, K].T, rows independent of M (see tile_f32).
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0 && w.size(1) == K);
  auto y = torch::empty({M, N}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(4, (128 * 1024) / (4 * K));  // as q4_matmul: W read once
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += chunk) {
      const int64_t ne = std::min(nb + chunk, n1);
      chatserve::for_row_tiles(M, [&](auto rows, int64_t r) { tile_f32<decltype(rows)::value>(wp, xp, out, K, N, r, nb, ne); });
    }
  });
  return y;
}

// codes [N, K/2], params [N, 2, K/32] -> out [N, K] float32 (for long prefill chunks, where a
// dense GEMM beats the integer kernel; the caller reuses `out` across row chunks).
torch::Tensor q4_dequantize(torch::Tensor codes, torch::Tensor params, torch::Tensor w) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && params.scalar_type() == torch::kHalf);
  TORCH_CHECK(codes.is_contiguous() && params.is_contiguous());
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / kGroup;
  TORCH_CHECK(K % (2 * kGroup) == 0 && params.size(0) == N && params.size(1) == 2 && params.size(2) == G);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(0) == N && w.size(1) == K);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* pm = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  float* out = w.data_ptr<float>();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // One pair of groups (64 weights, 32 bytes of codes) per iteration.
  at::parallel_for(0, N * G / 2, 512, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / (G / 2), g = 2 * (i % (G / 2));
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 32));
      const __m256i halves[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(pm[n * 2 * G + g + h]));
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(pm[n * 2 * G + G + g + h]));
        const __m128i lo = _mm256_castsi256_si128(halves[h]), hi = _mm256_extracti128_si256(halves[h], 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        float* dst = out + n * K + (g + h) * kGroup;
        for (int j = 0; j < 4; ++j) {
          const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
          _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(x, d, m));
        }
      }
    }
  });
  return w;
}

// How many threads at::parallel_for ran `items` items on (a check that the build has OpenMP).
int64_t parallel_threads(int64_t items) {
  std::vector<int> seen(at::get_num_threads(), 0);
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}
