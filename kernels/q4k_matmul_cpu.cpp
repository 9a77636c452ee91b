// GGUF's Q4_K weights against activations quantized as llama.cpp's Q8_K, for x86 CPUs with AVX2
// (and AVX-512 VNNI where present; kernels/quant_matmul.py, quant/q4k.py).
//
// A superblock of 256 weights has a float d and dmin and 8 sub-blocks of 32 with integer scales
// sc_j and mins m_j: w = d * sc_j * code - dmin * m_j. The weight is stored interleaved by 8
// output features (quant/q4k.interleave; K % 256 == 0, N % 8 == 0), for group g of 8 features and
// superblock s:
//   codes [G, S, 1024] uint8: sub-block j, step q (0..3) is 32 bytes at 128 j + 32 q; byte 4 n + i
//         holds feature n's code for k = 32 j + 4 q + i in its low nibble, k + 16 in its high one
//   subs  [G, S, 128] uint8: scales [8 j][8 n], then mins [4 jp][8 n][2] (sub-blocks 2 jp, 2 jp + 1)
//   dd    [G, S, 16] float32: d [8 n], then dmin [8 n]
// Activations, per row and superblock: xq [M, K] int8, xd [M, K/256] float (x ~= xd * xq), bsums
// [M, K/32] int16 (the sum of xq over each sub-block), so that
//   y[r, n] = sum_s xd[r, s] * (d[n, s] * sum_j sc_j * (code_j . xq_j) - dmin[n, s] * sum_j m_j * bsum_j)
//
// Why interleaved: vpmaddubsw of one 32-byte step (8 features x 4 codes) against 4 activation
// bytes broadcast gives 8 features' pair sums; the 8 steps of a sub-block add up in int16
// (|sum| <= 8 * 2 * 15 * 127 = 30480) before one vpmaddwd applies the 8 features' scales. That
// is 9 multiplies per 256 multiply-adds where the row-major layout (one feature's sub-block per
// vpmaddubsw, each followed by its own vpmaddwd by the scale) needed 16; on Zen 3 both share the
// same two pipes, and the kernel ran ~1.5x faster from 2 rows up (docs/benchmarks.md).
// Where the CPU has AVX-512 VNNI, tile_pair_vnni adds each step's products into int32 lanes with
// vpdpbusd on 512-bit registers, two groups at once and up to 8 rows a tile (tile_vnni, 256-bit,
// takes an odd group left over); same integers, same outputs. Rows never mix: every output is computed the
// same way whatever M is (greedy speculation relies on it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "cpu_simd.h"
#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using chatserve::broadcast4;
using chatserve::halves;
using chatserve::halves_ps;
using chatserve::next_pair;
using chatserve::kPrefetchAhead;
using chatserve::prefetch;

constexpr int kSuper = 256;
constexpr int kSub = 32;

inline int hsum_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(v);
}

constexpr int kGroup = 8;  // output features interleaved
constexpr int64_t kCodeBytes = 1024, kSubBytes = 128, kDdFloats = 16;  // per group and superblock


// The small streams beside the codes, 1 KiB ahead: a superblock's scales and mins (128 bytes) and
// its d, dmin (64 bytes). (+2-3% on a cold layer beyond prefetching the codes.)
inline void prefetch_superblock(const uint8_t* sub, const float* ddp) {
  prefetch(sub + 1024);
  prefetch(sub + 1024 + 64);
  prefetch(ddp + 256);
}

// A superblock's end for R rows: its integer sums sumi (scales applied) and the mins' term against
// the activations' sub-block sums, scaled by d, dmin and the row's xd, added into acc.
template <int R>
inline void superblock_end(const uint8_t* sub, const float* ddp, const float* xd, const int16_t* bsums,
                           const __m256i* sumi, __m256* acc, int64_t K, int64_t r0, int64_t s) {
  const int64_t S = K / kSuper;
  const __m256 d = _mm256_loadu_ps(ddp), dmin = _mm256_loadu_ps(ddp + 8);
  __m256i mins[4];
  for (int jp = 0; jp < 4; ++jp)
    mins[jp] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + 64 + jp * 16)));
  for (int r = 0; r < R; ++r) {
    const int8_t* bs = reinterpret_cast<const int8_t*>(bsums + (r0 + r) * (K / kSub) + s * 8);
    __m256i msum = _mm256_setzero_si256();
    for (int jp = 0; jp < 4; ++jp) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[jp], broadcast4(bs + 4 * jp)));
    const __m256 x_d = _mm256_set1_ps(xd[(r0 + r) * S + s]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, x_d), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, x_d), acc[r]);
  }
}

template <int R>
inline void store_tile(const __m256* acc, const float* bias, float* y, int64_t N, int64_t r0, int64_t g) {
  const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + g * kGroup) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + g * kGroup, _mm256_add_ps(acc[r], b));
}

// y[r0 .. r0 + R, 8 g .. 8 g + 8]: each unpacked step of the 8 features' codes serves R rows.
template <int R>
inline void tile(const uint8_t* codes, const uint8_t* subs, const float* dd, const int8_t* xq, const float* xd,
                 const int16_t* bsums, const float* bias, float* y, int64_t K, int64_t N, int64_t r0, int64_t g) {
  const int64_t S = K / kSuper;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* cg = codes + g * S * kCodeBytes;
  const uint8_t* sg = subs + g * S * kSubBytes;
  const float* dg = dd + g * S * kDdFloats;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    prefetch_superblock(sg + s * kSubBytes, dg + s * kDdFloats);
    for (int j = 0; j < 8; ++j) {
      // the 8 features' scales as int16 pairs (sc, sc), one per int32 lane
      const __m256i sc32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + s * kSubBytes + j * 8)));
      const __m256i scale = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));
      __m256i sum16[R];
      for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
      const uint8_t* cj = cg + s * kCodeBytes + j * 128;
      prefetch(cj + kPrefetchAhead);
      prefetch(cj + kPrefetchAhead + 64);
      // Not unrolled: unrolled, gcc hoisted every product of the sub-block and spilled them
      // (1.2x slower at 4+ rows).
#pragma GCC unroll 1
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cj + q * 32));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + (r0 + r) * K + s * kSuper + j * kSub + 4 * q;
          sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(lo, broadcast4(xr)));
          sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(hi, broadcast4(xr + 16)));
        }
      }
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sum16[r], scale));
    }
    superblock_end<R>(sg + s * kSubBytes, dg + s * kDdFloats, xd, bsums, sumi, acc, K, r0, s);
  }
  store_tile<R>(acc, bias, y, N, r0, g);
}

// VNNI: tile's integers, each step's products added into int32 lanes by vpdpbusd (one instruction
// where tile spends vpmaddubsw and vpaddw). A sub-block's sums fit in int16 (see the top), so
// vpmaddwd against (sc, 0) pairs applies the scales to them exactly as tile does: same outputs.
// Four accumulators per row (low and high nibbles of even and odd steps) keep vpdpbusd's latency
// off the critical path; the 32 ymm registers of AVX-512 hold them for 4 rows.
template <int R>
CHATSERVE_VNNI void tile_vnni(const uint8_t* codes, const uint8_t* subs, const float* dd, const int8_t* xq,
                              const float* xd, const int16_t* bsums, const float* bias, float* y, int64_t K, int64_t N,
                              int64_t r0, int64_t g) {
  const int64_t S = K / kSuper;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* cg = codes + g * S * kCodeBytes;
  const uint8_t* sg = subs + g * S * kSubBytes;
  const float* dg = dd + g * S * kDdFloats;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    prefetch_superblock(sg + s * kSubBytes, dg + s * kDdFloats);
    for (int j = 0; j < 8; ++j) {
      // the 8 features' scales as (sc, 0) int16 pairs, one per int32 lane
      const __m256i scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + s * kSubBytes + j * 8)));
      __m256i sum[R][4];
      for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = sum[r][2] = sum[r][3] = _mm256_setzero_si256();
      const uint8_t* cj = cg + s * kCodeBytes + j * 128;
      prefetch(cj + kPrefetchAhead);
      prefetch(cj + kPrefetchAhead + 64);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cj + q * 32));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + (r0 + r) * K + s * kSuper + j * kSub + 4 * q;
          sum[r][2 * (q & 1)] = _mm256_dpbusd_epi32(sum[r][2 * (q & 1)], lo, broadcast4(xr));
          sum[r][2 * (q & 1) + 1] = _mm256_dpbusd_epi32(sum[r][2 * (q & 1) + 1], hi, broadcast4(xr + 16));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(sum[r][0], sum[r][1]), _mm256_add_epi32(sum[r][2], sum[r][3]));
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(total, scale));
      }
    }
    superblock_end<R>(sg + s * kSubBytes, dg + s * kDdFloats, xd, bsums, sumi, acc, K, r0, s);
  }
  store_tile<R>(acc, bias, y, N, r0, g);
}

// Two groups in one 512-bit register: tile_vnni's integers for groups g and g + 1 (16 features),
// the low half of each register group g, the high half g + 1. Both halves take the same four
// activation bytes, so one broadcast feeds 16 features where tile_vnni's feeds 8: a vpdpbusd on
// zmm does twice the multiply-adds of one on ymm at nearly the same rate on this CPU (measured
// 5.6 against 4.7 G/s on an Intel Xeon), which is what a verification's rows are bound by once
// the weights are in L2. The 32 zmm registers take tiles of up to 8 rows (chatserve::kPairRows): a
// verification of 5-8 rows is one pass, not a tile of 4 and a second over the rest. Every lane
// runs tile_vnni's operations in its order (integer sums in any order are the same): same outputs.
template <int R>
CHATSERVE_VNNI void tile_pair_vnni(const uint8_t* codes, const uint8_t* subs, const float* dd, const int8_t* xq,
                                   const float* xd, const int16_t* bsums, const float* bias, float* y, int64_t K,
                                   int64_t N, int64_t r0, int64_t g) {
  constexpr int A = R <= 4 ? 4 : 2;  // accumulators per row (R > 4: 2, or 32 zmm do not hold them)
  const int64_t S = K / kSuper;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* ca = codes + g * S * kCodeBytes;
  const uint8_t* cb = ca + S * kCodeBytes;
  const uint8_t* sa = subs + g * S * kSubBytes;
  const uint8_t* sb = sa + S * kSubBytes;
  const float* da = dd + g * S * kDdFloats;
  const float* db = da + S * kDdFloats;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* ss_a = sa + s * kSubBytes;
    const uint8_t* ss_b = sb + s * kSubBytes;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (const int64_t ahead : {int64_t{1024}, int64_t{1024 + 64}}) {
      const int64_t o = next_pair(s * kSubBytes, ahead, S * kSubBytes);
      prefetch(sa + o);
      prefetch(sb + o);
    }
    const int64_t od = next_pair(s * kDdFloats, 256, S * kDdFloats);
    prefetch(da + od);
    prefetch(db + od);
    for (int j = 0; j < 8; ++j) {
      const __m128i sc8 = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ss_a + j * 8)),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ss_b + j * 8)));
      const __m512i scale = _mm512_cvtepu8_epi32(sc8);  // (sc, 0) int16 pairs, 16 features
      __m512i sum[R][A];
      for (int r = 0; r < R; ++r)
        for (int a = 0; a < A; ++a) sum[r][a] = _mm512_setzero_si512();
      const uint8_t* cja = ca + s * kCodeBytes + j * 128;
      const uint8_t* cjb = cb + s * kCodeBytes + j * 128;
      for (const int64_t ahead : {kPrefetchAhead, kPrefetchAhead + 64}) {
        const int64_t o = next_pair(s * kCodeBytes + j * 128, ahead, S * kCodeBytes);
        prefetch(ca + o);
        prefetch(cb + o);
      }
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512i v = halves(cja + q * 32, cjb + q * 32);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + (r0 + r) * K + s * kSuper + j * kSub + 4 * q;
          int32_t a, b;
          std::memcpy(&a, xr, 4);
          std::memcpy(&b, xr + 16, 4);
          constexpr int kLo = 0 % A, kHi = 1 % A;  // (A = 4: even and odd steps apart, below)
          const int lo_at = (kLo + 2 * (q & 1)) % A, hi_at = (kHi + 2 * (q & 1)) % A;
          sum[r][lo_at] = _mm512_dpbusd_epi32(sum[r][lo_at], lo, _mm512_set1_epi32(a));
          sum[r][hi_at] = _mm512_dpbusd_epi32(sum[r][hi_at], hi, _mm512_set1_epi32(b));
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512i total = sum[r][0];
        for (int a = 1; a < A; ++a) total = _mm512_add_epi32(total, sum[r][a]);
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(total, scale));
      }
    }
    // superblock_end's terms, 16 features at a time
    const __m512 d = halves_ps(da + s * kDdFloats, db + s * kDdFloats);
    const __m512 dmin = halves_ps(da + s * kDdFloats + 8, db + s * kDdFloats + 8);
    __m512i mins[4];
    for (int jp = 0; jp < 4; ++jp)
      mins[jp] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss_b + 64 + jp * 16)),
                                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(ss_a + 64 + jp * 16))));
    for (int r = 0; r < R; ++r) {
      const int16_t* bs = bsums + (r0 + r) * (K / kSub) + s * 8;
      __m512i msum = _mm512_setzero_si512();
      for (int jp = 0; jp < 4; ++jp) {
        int32_t pair;
        std::memcpy(&pair, bs + 2 * jp, 4);
        msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mins[jp], _mm512_set1_epi32(pair)));
      }
      const __m512 x_d = _mm512_set1_ps(xd[(r0 + r) * S + s]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(d, x_d), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, x_d), acc[r]);
    }
  }
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + g * kGroup) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + g * kGroup, _mm512_add_ps(acc[r], b));
}

// Rows [0, M) of x [M, K] -> xq, xd, bsums (see quantize_rows_k), one superblock per item.
void quantize_k(const float* src, int64_t M, int64_t K, int8_t* q, float* d, int16_t* bs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto one = [&](int64_t i) {
    const float* v = src + i * kSuper;
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < kSuper; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    const float top = chatserve::hmax(amax);
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    d[i] = top / 127.f;
    for (int g = 0; g < kSuper / kSub; ++g) {  // 32 values: 4 x 8 int32 -> 32 int8
      __m256i part[4];
      for (int t = 0; t < 4; ++t) part[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + g * kSub + 8 * t), inv));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]), _mm256_add_epi32(part[2], part[3]));
      bs[i * 8 + g] = static_cast<int16_t>(hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1))));
      // packs work within 128-bit lanes: the permute puts the 32 bytes back in order
      const __m256i w16a = _mm256_packs_epi32(part[0], part[1]), w16b = _mm256_packs_epi32(part[2], part[3]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kSuper + g * kSub),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order));
    }
  };
  const int64_t items = M * (K / kSuper);
  if (items <= 64) {  // a decode step's rows: an OpenMP region would cost more than the work
    for (int64_t i = 0; i < items; ++i) one(i);
  } else {
    at::parallel_for(0, items, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) one(i);
    });
  }
}

// y [M, N] = the quantized rows times the Q4_K weight (+ bias). Groups of 8 output features are
// split over threads; each thread walks its groups in chunks that stay in L2 (~128 KiB of codes)
// and runs every activation row over a chunk before the next: W is read from memory once per
// call whatever M is.
void q4k_run(const int8_t* q, const float* d, const int16_t* bs, const uint8_t* c, const uint8_t* sb,
             const float* dn, const float* bias, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t groups = N / kGroup;
  const int64_t chunk = std::max<int64_t>(2, (128 * 1024) / (K / 2 * kGroup)) & ~int64_t{1};  // even: pairs of groups
  const bool vnni = chatserve::vnni_enabled();
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t gb = g0; gb < g1; gb += chunk) {
      const int64_t ge = std::min(gb + chunk, g1);
      if (vnni) {
        chatserve::for_row_tiles<chatserve::kPairRows>(M, [&](auto rows, int64_t r) {
          constexpr int R = decltype(rows)::value;
          int64_t g = gb;
          for (; g + 2 <= ge; g += 2) tile_pair_vnni<R>(c, sb, dn, q, d, bs, bias, out, K, N, r, g);
          if (g < ge) {  // an odd group at the end of a thread's range
            chatserve::for_row_tiles(R, [&](auto part, int64_t p) {
              tile_vnni<decltype(part)::value>(c, sb, dn, q, d, bs, bias, out, K, N, r + p, g);
            });
          }
        });
      } else {
        chatserve::for_row_tiles(M, [&](auto rows, int64_t r) {
          for (int64_t g = gb; g < ge; ++g) tile<decltype(rows)::value>(c, sb, dn, q, d, bs, bias, out, K, N, r, g);
        });
      }
    }
  });
}

// The weight's N (out_features), checked against K.
int64_t check_weight(const torch::Tensor& codes, const torch::Tensor& subs, const torch::Tensor& dd, int64_t K) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && subs.scalar_type() == torch::kUInt8 &&
              dd.scalar_type() == torch::kFloat32);
  TORCH_CHECK(codes.is_contiguous() && subs.is_contiguous() && dd.is_contiguous());
  TORCH_CHECK(codes.dim() == 3 && K % kSuper == 0, "Q4_K weight: interleaved codes [N/8, K/256, 1024] (quant/q4k.interleave)");
  const int64_t G = codes.size(0), S = K / kSuper;
  TORCH_CHECK(codes.size(1) == S && codes.size(2) == kCodeBytes && subs.numel() == G * S * kSubBytes &&
              dd.numel() == G * S * kDdFloats, "Q4_K weight and activations do not match");
  return G * kGroup;
}

}  // namespace

// x [M, K] float32 -> (xq [M, K] int8, xd [M, K/256] float32, bsums [M, K/32] int16), per row and
// superblock of 256: xd = max|x| / 127, xq = round-half-even(x / xd) (llama.cpp's Q8_K).
std::vector<torch::Tensor> quantize_rows_k(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kSuper == 0, "in_features must be a multiple of 256");
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, K / kSuper}, x.options());
  auto bsums = torch::empty({M, K / kSub}, x.options().dtype(torch::kInt16));
  quantize_k(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), bsums.data_ptr<int16_t>());
  return {xq, xd, bsums};
}

// y [M, N] float32 = x @ W.T for the activations of quantize_rows_k and a Q4_K weight.
torch::Tensor q4k_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor bsums, torch::Tensor codes,
                         torch::Tensor subs, torch::Tensor dd) {
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && xd.scalar_type() == torch::kFloat32 &&
              bsums.scalar_type() == torch::kInt16 && xq.is_contiguous() && xd.is_contiguous() && bsums.is_contiguous());
  const int64_t M = xq.size(0), K = xq.size(1);
  const int64_t N = check_weight(codes, subs, dd, K);
  TORCH_CHECK(xd.numel() == M * (K / kSuper) && bsums.numel() == M * (K / kSub));
  auto y = torch::empty({M, N}, xd.options());
  q4k_run(xq.data_ptr<int8_t>(), xd.data_ptr<float>(), bsums.data_ptr<int16_t>(), codes.data_ptr<uint8_t>(),
          subs.data_ptr<uint8_t>(), dd.data_ptr<float>(), nullptr, y.data_ptr<float>(), M, K, N);
  return y;
}

// The whole layer in one call: y [M, N] = x [M, K] @ W.T (+ bias), the activations quantized into
// this thread's scratch (no tensors allocated but y): a decode step makes ~110 of these calls.
torch::Tensor q4k_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor subs, torch::Tensor dd,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = check_weight(codes, subs, dd, K);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N);
    b = bias->data_ptr<float>();
  }
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> bs;
  q.resize(M * K);
  d.resize(M * (K / kSuper));
  bs.resize(M * (K / kSub));
  quantize_k(x.data_ptr<float>(), M, K, q.data(), d.data(), bs.data());
  auto y = torch::empty({M, N}, x.options());
  q4k_run(q.data(), d.data(), bs.data(), codes.data_ptr<uint8_t>(), subs.data_ptr<uint8_t>(), dd.data_ptr<float>(),
          b, y.data_ptr<float>(), M, K, N);
  return y;
}
