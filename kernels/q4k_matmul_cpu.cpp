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
      chatserve::nibble_sub_block<R>(cj, xq + r0 * K + s * kSuper + j * kSub, K, sum16);
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sum16[r], scale));
    }
    superblock_end<R>(sg + s * kSubBytes, dg + s * kDdFloats, xd, bsums, sumi, acc, K, r0, s);
  }
  store_tile<R>(acc, bias, y, N, r0, g);
}

// VNNI: tile's integers, each step's products added into int32 lanes by vpdpbusd (one instruction
// where tile spends vpmaddubsw and vpaddw). A sub-block's 32 products sum to up to 32 * 15 * 127
// = 60960, past int16, so the scales multiply the int32 sums (vpmulld; a vpmaddwd against (sc, 0)
// pairs, used before, read only their low 16 bits): the same integers as tile, same outputs.
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
      // the 8 features' scales, one per int32 lane
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
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(total, scale));
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
      const __m512i scale = _mm512_cvtepu8_epi32(sc8);  // 16 features' scales
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
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(total, scale));
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

// ---- AMX-INT8: chunks of many rows (prefill) ----
//
// The VNNI tiles' integers on the tile unit. A superblock's integer sum for feature n and row r is
// sum_k xq[r, k] * (sc_j(k) * code[n, k]): with the sub-block scales applied to the codes first,
// the weight is one integer per k (up to 15 * 255, two bytes), and the whole superblock is
// tdpbusd's product (unsigned weight bytes x signed activations, int32 sums) with no work per
// sub-block: low bytes + 256 x high bytes, two products of 64 k at a time. For 16 features (a pair
// of groups) and two tiles of 16 rows, four accumulator tiles; then per feature (a vector over 16
// rows) the mins' term and the floats exactly as tile_pair_vnni computes them, in its order: the
// integers are the same, so every output equals the VNNI path's bit for bit (and a prefill's rows
// still equal the decode rows' numbers). The weight bytes are made once per pair of groups and
// serve every row; the activations are rearranged once per call into the unit's 4-byte runs.
// (Measured on an Intel Xeon with AMX, 2 threads: 1.3-1.9x the VNNI tiles from 64 rows; a 2,048-
// token prefill of Qwen 1.5B in chunks of 256, 10.7 -> 7.9 s; docs/benchmarks.md, session 29.)
constexpr int64_t kAmxMinRows = 64;  // fewer rows: the VNNI tiles (at 32 both ran alike: benchmarks/q4k_kernels.py)
constexpr int64_t kRowTile = 16;

// Activations of rows [16 t, 16 t + 16) laid out for the tile unit (rows past M are zeros).
struct AmxActs {
  std::vector<int32_t> b;  // [T][K/64][16 words][16 rows]: row r's bytes 4 w .. 4 w + 3 of a 64-byte chunk
  std::vector<float> xd;   // [T][S][16 rows]
  std::vector<int32_t> bs;  // [T][S][4][16 rows]: the pair (bsum 2 jp, bsum 2 jp + 1) as two int16
};

// Row tile t of amx_arrange (a lambda does not take the target attribute).
CHATSERVE_AMX_INT8 void arrange_tile(const int8_t* q, const float* d, const int16_t* bs, int64_t M, int64_t K,
                                     int64_t t, AmxActs& a) {
  const int64_t S = K / kSuper, C = K / 64;
  const int64_t rows = std::min<int64_t>(kRowTile, M - t * kRowTile);
  for (int64_t c = 0; c < C; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_loadu_si512(q + (t * kRowTile + i) * K + c * 64) : _mm512_setzero_si512();
    chatserve::transpose16(r);
    for (int w = 0; w < 16; ++w) _mm512_storeu_si512(a.b.data() + ((t * C + c) * 16 + w) * 16, r[w]);
  }
  for (int64_t s = 0; s < S; ++s)
    for (int i = 0; i < 16; ++i) {
      const bool in = i < rows;
      a.xd[(t * S + s) * 16 + i] = in ? d[(t * kRowTile + i) * S + s] : 0.f;
      for (int jp = 0; jp < 4; ++jp) {
        int32_t pair = 0;
        if (in) std::memcpy(&pair, bs + (t * kRowTile + i) * (K / kSub) + s * 8 + 2 * jp, 4);
        a.bs[((t * S + s) * 4 + jp) * 16 + i] = pair;
      }
    }
}

void amx_arrange(const int8_t* q, const float* d, const int16_t* bs, int64_t M, int64_t K, AmxActs& a) {
  const int64_t T = ((M + 2 * kRowTile - 1) / (2 * kRowTile)) * 2, S = K / kSuper, C = K / 64;  // even: tiles go in pairs
  a.b.resize(T * C * 256);
  a.xd.resize(T * S * 16);
  a.bs.resize(T * S * 64);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) arrange_tile(q, d, bs, M, K, t, a);
  });
}

// The weight of groups g, g + 1 (16 features) with the sub-block scales applied, code * sc (up to
// 15 * 255), split into its low and high bytes: lo, hi [S][4 chunks of 64 k][16 features][64]
// unsigned bytes, a feature's 64 bytes its values at 64 consecutive k.
CHATSERVE_AMX_INT8 void amx_unpack(const uint8_t* codes, const uint8_t* subs, int64_t S, int64_t g, uint8_t* lo,
                                   uint8_t* hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* ca = codes + g * S * kCodeBytes;
  const uint8_t* cb = ca + S * kCodeBytes;
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sc[2] = {subs + g * S * kSubBytes + s * kSubBytes, subs + (g + 1) * S * kSubBytes + s * kSubBytes};
    for (int c = 0; c < 4; ++c) {
      __m512i r[16];  // r[8 h + q]: step q's low nibbles (k = 4 q ..), r[8 h + 4 + q]: its high ones (k = 16 + 4 q ..)
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 4; ++q) {
          const int64_t at = s * kCodeBytes + (2 * c + h) * 128 + q * 32;
          const __m512i v = chatserve::halves(ca + at, cb + at);
          r[8 * h + q] = _mm512_and_si512(v, low4);
          r[8 * h + 4 + q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      chatserve::transpose16(r);  // r[f]: feature f's codes of sub-blocks 2 c, 2 c + 1 in k order
      for (int f = 0; f < 16; ++f) {
        uint8_t* at_lo = lo + ((s * 4 + c) * 16 + f) * 64;
        uint8_t* at_hi = hi + ((s * 4 + c) * 16 + f) * 64;
        for (int h = 0; h < 2; ++h) {
          const __m256i code8 = h == 0 ? _mm512_castsi512_si256(r[f]) : _mm512_extracti64x4_epi64(r[f], 1);
          const __m512i w = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(code8),
                                               _mm512_set1_epi16(sc[f / 8][(2 * c + h) * 8 + f % 8]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_lo + 32 * h), _mm512_cvtepi16_epi8(w));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_hi + 32 * h), _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
        }
      }
    }
  }
}

CHATSERVE_AMX_INT8 void amx_configure_int8() {
  alignas(64) chatserve::TileConfig cfg;
  for (int i = 0; i < 8; ++i) {  // C: 0-3 (16 features x 16 int32), A: 4, 6 (16 features x 64 bytes), B: 5, 7 (16 x 64)
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One superblock for 16 features and two tiles of 16 rows: sums [4][16 features][16 rows] int32,
// sums[0] / sums[1] the low / high bytes' products for the first row tile, sums[2] / sums[3] the second's.
CHATSERVE_AMX_INT8 inline void amx_superblock(const uint8_t* lo, const uint8_t* hi, const int32_t* b0,
                                              const int32_t* b1, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < 4; ++c) {
    _tile_loadd(4, lo + c * 1024, 64);
    _tile_loadd(6, hi + c * 1024, 64);
    _tile_loadd(5, b0 + c * 256, 64);
    _tile_loadd(7, b1 + c * 256, 64);
    _tile_dpbusd(0, 4, 5);
    _tile_dpbusd(1, 6, 5);
    _tile_dpbusd(2, 4, 7);
    _tile_dpbusd(3, 6, 7);
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + 768, 64);
}

// A row tile's superblock end, per feature (a vector over its 16 rows): sumi = lo + 256 hi (the
// integer tile_pair_vnni sums), the mins' term and the floats in tile_pair_vnni's order.
CHATSERVE_AMX_INT8 inline void amx_superblock_end(const int32_t* sums, const int32_t* mins, const float* const* dg,
                                                  const AmxActs& a, int64_t t, int64_t S, int64_t s, __m512* acc) {
  const __m512 x_d = _mm512_loadu_ps(a.xd.data() + (t * S + s) * 16);
  __m512i bsp[4];
  for (int jp = 0; jp < 4; ++jp) bsp[jp] = _mm512_loadu_si512(a.bs.data() + ((t * S + s) * 4 + jp) * 16);
  for (int f = 0; f < 16; ++f) {
    const __m512i sumi = _mm512_add_epi32(_mm512_load_si512(sums + f * 16),
                                          _mm512_slli_epi32(_mm512_load_si512(sums + 256 + f * 16), 8));
    __m512i msum = _mm512_setzero_si512();
    for (int jp = 0; jp < 4; ++jp)
      msum = _mm512_add_epi32(msum, _mm512_madd_epi16(_mm512_set1_epi32(mins[jp * 16 + f]), bsp[jp]));
    const float* ddp = dg[f / 8] + s * kDdFloats;
    const int n = f % 8;
    acc[f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(_mm512_set1_ps(ddp[n]), x_d), acc[f]);
    acc[f] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(_mm512_set1_ps(ddp[8 + n]), x_d), acc[f]);
  }
}

// acc[f] lane i -> y[16 t + i, 16 p + f] (+ bias), rows past M dropped.
CHATSERVE_AMX_INT8 inline void amx_store(const __m512* acc, const float* bias, float* y, int64_t M, int64_t N,
                                         int64_t t, int64_t p) {
  __m512i rows[16];
  for (int f = 0; f < 16; ++f) rows[f] = _mm512_castps_si512(acc[f]);
  chatserve::transpose16(rows);
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + 16 * p) : _mm512_setzero_ps();
  const int64_t live = std::min<int64_t>(kRowTile, M - t * kRowTile);
  for (int i = 0; i < live; ++i)
    _mm512_storeu_ps(y + (t * kRowTile + i) * N + 16 * p, _mm512_add_ps(_mm512_castsi512_ps(rows[i]), b));
}

// y [M, N] (+ bias) for the features of the groups [2 p0, 2 p1) and every row, two row tiles at a time.
CHATSERVE_AMX_INT8 void amx_pairs(const AmxActs& a, const uint8_t* codes, const uint8_t* subs, const float* dd,
                                  const float* bias, float* y, int64_t M, int64_t K, int64_t N, int64_t p0,
                                  int64_t p1) {
  const int64_t S = K / kSuper, C = K / 64, T = (M + kRowTile - 1) / kRowTile;
  thread_local std::vector<uint8_t> lo, hi;
  thread_local std::vector<int32_t> mins;
  mins.resize(S * 4 * 16);
  lo.resize(S * 4 * 16 * 64);
  hi.resize(S * 4 * 16 * 64);
  alignas(64) int32_t sums[4 * 256];
  amx_configure_int8();
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = 2 * p;
    amx_unpack(codes, subs, S, g, lo.data(), hi.data());
    const float* dg[2] = {dd + g * S * kDdFloats, dd + (g + 1) * S * kDdFloats};
    for (int64_t s = 0; s < S; ++s)  // the mins as int16 pairs (m 2 jp, m 2 jp + 1), per feature
      for (int f = 0; f < 16; ++f) {
        const uint8_t* m = subs + (g + f / 8) * S * kSubBytes + s * kSubBytes + 64 + (f % 8) * 2;
        for (int jp = 0; jp < 4; ++jp) mins[(s * 4 + jp) * 16 + f] = m[jp * 16] | (m[jp * 16 + 1] << 16);
      }
    for (int64_t t = 0; t < T; t += 2) {  // (amx_arrange pads to an even number of tiles)
      __m512 acc[2][16];
      for (int u = 0; u < 2; ++u)
        for (int f = 0; f < 16; ++f) acc[u][f] = _mm512_setzero_ps();
      for (int64_t s = 0; s < S; ++s) {
        amx_superblock(lo.data() + s * 4096, hi.data() + s * 4096, a.b.data() + (t * C + s * 4) * 256,
                       a.b.data() + ((t + 1) * C + s * 4) * 256, sums);
        amx_superblock_end(sums, mins.data() + s * 64, dg, a, t, S, s, acc[0]);
        amx_superblock_end(sums + 512, mins.data() + s * 64, dg, a, t + 1, S, s, acc[1]);
      }
      amx_store(acc[0], bias, y, M, N, t, p);
      if (t + 1 < T) amx_store(acc[1], bias, y, M, N, t + 1, p);
    }
  }
  _tile_release();
}

void q4k_run_amx(const int8_t* q, const float* d, const int16_t* bs, const uint8_t* c, const uint8_t* sb,
                 const float* dn, const float* bias, float* out, int64_t M, int64_t K, int64_t N) {
  thread_local AmxActs mine;
  AmxActs& acts = mine;  // (a lambda names a thread_local as the running thread's own, not this one)
  amx_arrange(q, d, bs, M, K, acts);
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    amx_pairs(acts, c, sb, dn, bias, out, M, K, N, p0, p1);
  });
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
  if (vnni && M >= kAmxMinRows && groups % 2 == 0 && chatserve::amx_int8_enabled()) {
    q4k_run_amx(q, d, bs, c, sb, dn, bias, out, M, K, N);
    return;
  }
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
