// Small AVX2 helpers shared by the C++ CPU kernels (kernels/cpu_ext.py builds them), and the switch
// to their AVX-512 VNNI variants.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

// AVX-512 VNNI on 256-bit registers (EVEX vpdpbusd: four u8 x s8 products added into each int32
// lane, one instruction where AVX2 needs vpmaddubsw, then an add, and for int32 a vpmaddwd): Intel
// from Ice Lake and Sapphire Rapids, AMD from Zen 4. The extension is built for AVX2; functions
// marked CHATSERVE_VNNI are compiled for VNNI as well and run only where vnni_enabled().
#define CHATSERVE_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// AMX (Intel from Sapphire Rapids): eight 1 KiB tile registers and a unit that multiplies tiles of
// bfloat16 pairs into float32 (tdpbf16ps: a 16 x 32 by 32 x 16 product in one instruction), with
// AVX-512 BF16 for the roundings to bfloat16 around it. Functions marked CHATSERVE_AMX run only
// where amx_enabled().
#define CHATSERVE_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// AMX-INT8 (Intel from Sapphire Rapids): tdpbusd multiplies a tile of unsigned bytes by a tile of
// signed bytes, four products summed into each int32 of a 16 x 16 accumulator tile, exactly as
// vpdpbusd does. Functions marked CHATSERVE_AMX_INT8 run only where amx_int8_enabled().
#define CHATSERVE_AMX_INT8 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

namespace chatserve {

// Whether the paged attention over a bfloat16 cache takes its AMX path: the CPU has AMX-BF16 and
// AVX-512 BF16, the kernel let this process use the tiles, and CHATSERVE_NO_AMX is unset, unless
// set_amx changed it. Unlike VNNI, AMX changes the numbers (queries and attention weights are
// rounded to bfloat16), so decode and verification rows must agree on it: it is read once per call.
bool amx_enabled();
// Turns the AMX attention on (where the CPU has it) or off; returns whether it was on.
bool set_amx(bool on);

// Whether the Q4_K matmul takes its AMX-INT8 path for chunks of many rows (prefill): the CPU has
// AMX-INT8 and AVX-512 VNNI, the kernel let this process use the tiles, and CHATSERVE_NO_AMX is
// unset, unless set_amx_int8 changed it. The tiles give the same integers as the VNNI path, so
// the same outputs bit for bit (a prefill's rows equal its decode rows' numbers).
bool amx_int8_enabled();
// Turns the AMX-INT8 matmul on (where the CPU has it) or off; returns whether it was on.
bool set_amx_int8(bool on);

// Whether the matmul kernels take their VNNI tiles: the CPU has AVX-512 VNNI + VL and
// CHATSERVE_NO_VNNI is unset, unless set_vnni changed it (tests compare both paths; a VNNI tile
// gives the same integers, so the same outputs bit for bit).
bool vnni_enabled();
// Turns the VNNI tiles on (where the CPU has them) or off; returns whether they were on.
bool set_vnni(bool on);

// Software prefetch ahead of a stream of weights: a decode step reads every weight once, and the
// hardware prefetchers alone kept one thread at ~9 GB/s of the ~13 it streams (an Intel Xeon,
// Qwen 1.5B's Q4_K layers, cold): prefetching 4 KiB ahead took a layer from 0.88 to 0.67 ms.
constexpr int64_t kPrefetchAhead = 4096;  // bytes, for the main stream of codes or weights

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// 32 bytes at a, then 32 at b, in one 512-bit register (a lambda would not take the target).
CHATSERVE_VNNI inline __m512i halves(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// 8 floats at a, then 8 at b.
CHATSERVE_VNNI inline __m512 halves_ps(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// Rows per tile of the 512-bit tiles over pairs of groups (Q4_K, int8): 32 zmm registers hold 8.
constexpr int kPairRows = 8;

// Where a prefetch `ahead` of offset `at` in one group's stream (of `per_group`) lands when groups are
// read in pairs, g beside g + 1: past the group's end it goes to the same offset in the next pair
// (g + 2 beside g + 3), which is what is read next, not into g + 1, which is being read already.
// (Prefetching straight on left a third of a cold 1536-wide layer's codes to demand misses.)
inline int64_t next_pair(int64_t at, int64_t ahead, int64_t per_group) {
  const int64_t o = at + ahead;
  return o < per_group ? o : o + per_group;
}

// Four bytes at p (any alignment) in every 32-bit lane: activations against weights interleaved
// by 8 output features (Q4_K, int8).
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// A sub-block of 32 codes for 8 interleaved output features (Q4_K's sub-block, the int4 groups
// of 32 interleaved by 8): 4 steps of 32 bytes, byte 4 n + i of step q holding feature n's codes
// for k = 4 q + i (low nibble) and k + 16 (high nibble). Adds each feature's pair sums against the
// 32 activation bytes of R rows (row r at x + r * stride) into sum16[r], in int16: 8 pair sums of
// at most 2 * 15 * 127 each stay below 32768 from zero.
template <int R>
inline void nibble_sub_block(const uint8_t* codes, const int8_t* x, int64_t stride, __m256i* sum16) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // Not unrolled: unrolled, gcc hoisted every product of the sub-block and spilled them (Q4_K's
  // tile ran 1.2x slower at 4+ rows).
#pragma GCC unroll 1
  for (int q = 0; q < 4; ++q) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 32));
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = x + r * stride + 4 * q;
      sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(lo, broadcast4(xr)));
      sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(hi, broadcast4(xr + 16)));
    }
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), relative
// error ~2e-7 over the float range; x is clamped to [-88.4, 88.4] (so -inf gives ~1e-38).
// Cephes' expf constants, shared by exp256 and the tile path's 16-lane exp512 (decode_ops_cpu.cpp).
struct ExpConst {
  static constexpr float kMax = 88.3762626647949f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

inline __m256 exp256(__m256 x) {
  using C = ExpConst;
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(C::kMax)), _mm256_set1_ps(-C::kMax));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(C::kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2Hi), x));
  __m256 y = _mm256_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(C::kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The tile unit's configuration (ldtilecfg's 64-byte operand): palette 1, then per tile register
// its bytes per row and its rows.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// r[i] (16 vectors of 16 32-bit words) transposed in place: r[i] word j <- r[j] word i.
__attribute__((target("avx512f"))) inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4a + b], in its 128-bit lane L: word b + 4L of rows 4a .. 4a + 3.
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x44), v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xee);
    r[b] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[b + 4] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[b + 8] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[b + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// The remaining `left` (< R + 1) rows from r0 in one tile of their own.
template <int R, typename F>
inline void rest_tile(int64_t left, int64_t r0, F& tile) {
  if (left == R) {
    tile(std::integral_constant<int, R>{}, r0);
  } else if constexpr (R > 1) {
    rest_tile<R - 1>(left, r0, tile);
  }
}

// Calls tile(std::integral_constant<int, R>{}, r0) over rows [0, M) in tiles of Max, then one of
// the remaining 1..Max - 1 rows: the register tiling every matmul kernel here shares (Max = 4 on
// 16 ymm registers; the AVX-512 Q4_K tile takes 8 in 32 zmm).
template <int Max = 4, typename F>
inline void for_row_tiles(int64_t M, F&& tile) {
  int64_t r = 0;
  for (; r + Max <= M; r += Max) tile(std::integral_constant<int, Max>{}, r);
  if constexpr (Max > 1) {
    if (r < M) rest_tile<Max - 1>(M - r, r, tile);
  }
}

}  // namespace chatserve
