// The small operations around a decode step's weight matmuls, in float32 (kernels/decode_ops.py
// holds the launchers and the plain-torch references they are tested against).
//
// Each op computes one row (token) the same way whatever the number of rows in the call, so a
// verification row equals the decode row for the same position bit for bit, as the matmul
// kernels do.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "cpu_simd.h"

using chatserve::exp256;
using chatserve::TileConfig;
using chatserve::transpose16;
using chatserve::hmax;
using chatserve::hsum;

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, ": float32, contiguous");
}

// A KV cache's element type: float32 (the model's), or 16 bits (half the bytes a long context's
// attention reads: kv_cache_dtype "fp16" / "bf16"). The attention widens 16-bit keys and values
// to float32 (exactly) before any arithmetic, so a 16-bit cache gives the numbers of a float32
// cache holding the same rounded values.
enum class KvType { kF32, kF16, kBF16 };

KvType check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, ": contiguous");
  switch (t.scalar_type()) {
    case torch::kFloat32: return KvType::kF32;
    case torch::kFloat16: return KvType::kF16;
    case torch::kBFloat16: return KvType::kBF16;
    default: TORCH_CHECK(false, name, ": float32, float16 or bfloat16");
  }
  return KvType::kF32;
}

// n (a multiple of 8) 16-bit values at src -> float32 at dst, exactly.
void widen(KvType type, const uint16_t* src, int64_t n, float* dst) {
  if (type == KvType::kF16) {
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  } else {  // bfloat16: the high half of a float32
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
}

}  // namespace

// out [T, D] = x * rsqrt(mean(x^2) + eps) * w, as F.rms_norm in float32. With `residual`
// (same shape), x += residual first, in place: the decoder's "add, then normalize".
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual) {
  check_f32(x, "rms_norm x");
  check_f32(w, "rms_norm w");
  const int64_t D = x.size(-1), T = x.numel() / D;
  TORCH_CHECK(D % 8 == 0 && w.numel() == D);
  float* xp = x.data_ptr<float>();
  const float* rp = nullptr;
  if (residual.has_value()) {
    check_f32(*residual, "rms_norm residual");
    TORCH_CHECK(residual->numel() == x.numel());
    rp = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  float* op = out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = xp + t * D;
      __m256 ss = _mm256_setzero_ps();
      for (int64_t j = 0; j < D; j += 8) {
        __m256 v = _mm256_loadu_ps(row + j);
        if (rp) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(rp + t * D + j));
          _mm256_storeu_ps(row + j, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
      }
      const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum(ss) / static_cast<float>(D) + static_cast<float>(eps)));
      for (int64_t j = 0; j < D; j += 8)
        _mm256_storeu_ps(op + t * D + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), inv), _mm256_loadu_ps(wp + j)));
    }
  });
  return out;
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] = [gate | up].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "silu_mul");
  const int64_t I = gate_up.size(-1) / 2, T = gate_up.numel() / (2 * I);
  TORCH_CHECK(I % 8 == 0);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
  at::parallel_for(0, T * (I / 8), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / (I / 8), j = (i % (I / 8)) * 8;
      const __m256 g = _mm256_loadu_ps(gp + t * 2 * I + j), u = _mm256_loadu_ps(gp + t * 2 * I + I + j);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_xor_ps(g, neg))));
      _mm256_storeu_ps(op + t * I + j, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
  });
  return out;
}

// Rotate-half RoPE in place on the first `heads` heads of x [T, N, D] (query and key heads of a
// fused qkv output; x may be a row-strided view): with x = [a | b] per head and c, s the
// position's cos, sin [D/2]: [a c - b s | b c + a s]. cos, sin [P, D/2] float32.
void rope_(torch::Tensor x, int64_t heads, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2));
  check_f32(cos, "rope cos");
  check_f32(sin, "rope sin");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == x.size(0));
  const int64_t T = x.size(0), D = x.size(2), H2 = D / 2, row_stride = x.stride(0);
  TORCH_CHECK(H2 % 8 == 0 && cos.size(1) == H2 && heads <= x.size(1));
  float* xp = x.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      float* a = xp + t * row_stride + h * D;
      float* b = a + H2;
      const float* c = cp + pos[t] * H2;
      const float* s = sp + pos[t] * H2;
      for (int64_t j = 0; j < H2; j += 8) {
        const __m256 va = _mm256_loadu_ps(a + j), vb = _mm256_loadu_ps(b + j);
        const __m256 vc = _mm256_loadu_ps(c + j), vs = _mm256_loadu_ps(s + j);
        _mm256_storeu_ps(a + j, _mm256_fmsub_ps(va, vc, _mm256_mul_ps(vb, vs)));
        _mm256_storeu_ps(b + j, _mm256_fmadd_ps(vb, vc, _mm256_mul_ps(va, vs)));
      }
    }
  });
}

// Write key, value [T, Hkv, D] (row-strided views allowed) into the paged caches [NB, BS, Hkv, D]
// (float32, float16 or bfloat16) at slots [T] (block * BS + offset); a slot < 0 is skipped. A 16-bit
// cache gets each value rounded as torch's .to(dtype) rounds it (to nearest, ties to even).
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(key.scalar_type() == torch::kFloat32 && value.scalar_type() == torch::kFloat32);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2));
  const KvType kt = check_cache(k_cache, "store_kv k_cache");
  TORCH_CHECK(check_cache(v_cache, "store_kv v_cache") == kt, "store_kv: k_cache and v_cache of one dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == key.size(0));
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (sl[t] < 0) continue;
    TORCH_CHECK(sl[t] < num_slots, "store_kv: slot out of range");
    const float* ks = key.data_ptr<float>() + t * key.stride(0);
    const float* vs = value.data_ptr<float>() + t * value.stride(0);
    const int64_t at = sl[t] * row;
    switch (kt) {
      case KvType::kF32:
        std::copy_n(ks, row, k_cache.data_ptr<float>() + at);
        std::copy_n(vs, row, v_cache.data_ptr<float>() + at);
        break;
      case KvType::kF16:
        std::copy_n(ks, row, k_cache.data_ptr<at::Half>() + at);  // c10::Half(float): torch's rounding
        std::copy_n(vs, row, v_cache.data_ptr<at::Half>() + at);
        break;
      case KvType::kBF16:
        std::copy_n(ks, row, k_cache.data_ptr<at::BFloat16>() + at);
        std::copy_n(vs, row, v_cache.data_ptr<at::BFloat16>() + at);
        break;
    }
  }
}

// Paged attention of query rows over a float32 or 16-bit cache (KvType), no gather:
//   out[t, h] = softmax_j(scale * q[t, h] . K[j, h / G]) . V[j, h / G],  j < ctx[t]
// for the G = H / Hkv query heads that share kv head h / G. Row t belongs to sequence seq[t]
// (its block table) and sees its first ctx[t] tokens. q, out [T, H, D]; caches [NB, BS, Hkv, D];
// block_tables [B, max_blocks] int32.
//
// Keys are cut into partitions of kPart (split-K, "flash decoding"): a work item is (the rows of
// one sequence, kv head, partition) and leaves, per row, its partition's max score, sum of
// exponentials and unnormalized output; a second pass merges a row's partitions in order. Why
// (SmolLM2's shape, 30 layers, 2 threads):
// - one item per (row, kv head) gave 3 items to 2 threads and read 7.6 GB/s: 12.2 ms a step at
//   2k tokens of context;
// - each verification row re-read the whole context: 5 rows cost 3x one row (37 ms at 2k). Items
//   were then ordered (kv head, partition, row), so each row read the partition from L2: still
//   2.5-2.8x on Qwen's shape (12 heads, 2 kv heads, D 128). Now one item scores every row of a
//   verification against each group of 8 keys while it is in L1 (attend_partition).
// A row's numbers depend only on its own context (partition edges at multiples of kPart, merged
// in order), never on the rows beside it or the thread count: a verification row equals the
// decode step at its position bit for bit. A bfloat16 cache on a CPU with AMX takes the tile
// path (attend_partition_amx, below) for every row of the call.
namespace {

constexpr int64_t kPart = 256;  // keys per partition; a multiple of the 32-key V blocks below

struct AttnShape {
  int64_t H, Hkv, G, D, BS, MB;
};

// o[g * D ..] += sum_j p[g * n + j] V[j] over keys [jb, je) for GN heads, 16 columns at a time
// (n: the stride of p's rows).
// GN is a template argument: with a run-time head count gcc kept the sums on the stack and
// stored and reloaded one per multiply-add (perf: ~40% of the kernel's time in this loop).
template <int GN>
inline void weigh_values(const float* vp, const int64_t* kv_rows, const float* p, int64_t n, int64_t jb, int64_t je,
                         int64_t D, float* o) {
  for (int64_t d = 0; d < D; d += 16) {
    __m256 acc[GN][2];
    for (int g = 0; g < GN; ++g) {
      acc[g][0] = _mm256_loadu_ps(o + g * D + d);
      acc[g][1] = _mm256_loadu_ps(o + g * D + d + 8);
    }
    for (int64_t j = jb; j < je; ++j) {
      const float* v = vp + kv_rows[j] + d;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
      for (int g = 0; g < GN; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * n + j);
        acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      _mm256_storeu_ps(o + g * D + d, acc[g][0]);
      _mm256_storeu_ps(o + g * D + d + 8, acc[g][1]);
    }
  }
}

// weigh_values on 512-bit registers, up to 8 heads: one register holds the 16 columns that
// weigh_values keeps in two, and each lane runs the same multiply-adds in the same order, so the
// outputs are the same bit for bit; half the instructions, and a head group of up to 8 (Qwen's 6
// query heads per kv head in one pass over V, where weigh_values made a pass of 4 and one of 2).
template <int GN>
CHATSERVE_VNNI void weigh_values_wide(const float* vp, const int64_t* kv_rows, const float* p, int64_t n, int64_t jb,
                                      int64_t je, int64_t D, float* o) {
  for (int64_t d = 0; d < D; d += 16) {
    __m512 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_loadu_ps(o + g * D + d);
    for (int64_t j = jb; j < je; ++j) {
      const __m512 v = _mm512_loadu_ps(vp + kv_rows[j] + d);
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * n + j]), v, acc[g]);
    }
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(o + g * D + d, acc[g]);
  }
}

// The 8 dot products of acc's 8 vectors (each 8 partial sums), in one vector, times scale: one
// transposing reduction (6 hadds) instead of 8 horizontal sums.
inline __m256 dots8(const __m256* acc, __m256 scale) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)), scale);
}

// Scores of 8 keys (rows kr) for two query heads qa and qb at once, on 512-bit registers: the low
// half of each register is qa's 8 partial sums, the high half qb's, against the key broadcast to
// both halves; the same multiply-adds per lane in the same order as the 256-bit loop, then the
// same reduction per head: the same scores bit for bit.
CHATSERVE_VNNI inline __attribute__((always_inline)) void score8_two_heads(const float* qa, const float* qb,
                                                                           const float* const* kr, int64_t D,
                                                                           float scale, float* out_a, float* out_b) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m512 qv = chatserve::halves_ps(qa + d, qb + d);
    for (int i = 0; i < 8; ++i) {
      const __m512 kv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(kr[i] + d))));
      acc[i] = _mm512_fmadd_ps(qv, kv, acc[i]);
    }
  }
  __m256 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) {
    lo[i] = _mm512_castps512_ps256(acc[i]);
    hi[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
  }
  _mm256_storeu_ps(out_a, dots8(lo, _mm256_set1_ps(scale)));
  _mm256_storeu_ps(out_b, dots8(hi, _mm256_set1_ps(scale)));
}

// Scores of 8 keys (rows kr) for one query head qh on 256-bit registers: 8 partial sums per key,
// then the transposing reduction.
inline void score8_one_head(const float* qh, const float* const* kr, int64_t D, __m256 vscale, float* out) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qh + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[i] + d), acc[i]);
  }
  _mm256_storeu_ps(out, dots8(acc, vscale));
}

// The scores of 8 keys kr for the G query heads of rows [t0, t1) (row t's heads at q + t * H * D,
// D apart) into score rows npad apart from out: heads in pairs on 512-bit registers, an odd head
// as score_group_avx2 does it (8 partial sums per key on 256-bit registers, reduced the same way):
// the same scores either way. One call per group of keys: called per head pair (a function of
// another target is not inlined), the loop was prologue, zeroing and spills as much as
// multiply-adds (Qwen 1.5B's shape, 2k keys, float32: 1 row 10.0 -> 7.8 ms, 8 rows 26.2 -> 24.7).
CHATSERVE_VNNI void score_group_f32(const float* q, int64_t t0, int64_t t1, int64_t H, int64_t G,
                                    const float* const* kr, int64_t D, float scale, float* out, int64_t npad) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = t0; t < t1; ++t) {
    int64_t g = 0;
    float* row_out = out + (t - t0) * G * npad;
    for (; g + 2 <= G; g += 2)
      score8_two_heads(q + (t * H + g) * D, q + (t * H + g + 1) * D, kr, D, scale, row_out + g * npad,
                       row_out + (g + 1) * npad);
    for (; g < G; ++g) score8_one_head(q + (t * H + g) * D, kr, D, vscale, row_out + g * npad);
  }
}

// The same for a CPU without AVX-512 (score_group_f32 may not run there): the 256-bit loop only.
void score_group_avx2(const float* q, int64_t t0, int64_t t1, int64_t H, int64_t G, const float* const* kr,
                      int64_t D, float scale, float* out, int64_t npad) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) score8_one_head(q + (t * H + g) * D, kr, D, vscale, out + ((t - t0) * G + g) * npad);
}

// Item (rows [t0, t1) of one sequence, kv head kh, partition p of keys [j0, j0 + kPart)): for each
// of those rows that sees keys of the partition, m[g], l[g] and o[g * D ..] of its G heads at
// item index (t * Hkv + kh) * P + p. The rows share every load of K: a group of 8 keys is read
// once and scored against all rows' G queries while it is in L1 (row by row, each verification
// row read the partition's K again: 5 rows cost 2.5-2.8x one at 1-4k tokens on Qwen's shape).
// Every key is scored in a group of 8 (the last group padded with a copy of the last key) and a
// score depends on its own key only, so a row's numbers do not depend on the rows beside it.
// A 16-bit cache's keys are widened a group of 8 at a time, and its values a block of 32 at a
// time, into float32 scratch in L1 that every row and head then reads: the loops below are the
// float32 cache's, on the same values.
struct Scratch {
  std::vector<float> scores, keys, values;
  std::vector<int64_t> kv_rows, block_rows;
};

void attend_partition(const AttnShape& s, const float* qp, const void* kbase, const void* vbase, KvType kt,
                      const int32_t* table, const int64_t* cx, int64_t t0, int64_t t1, int64_t kh, int64_t p,
                      int64_t P, float fscale, float* part_m, float* part_l, float* part_o, Scratch& scratch,
                      bool wide) {
  std::vector<float>& scores = scratch.scores;
  std::vector<int64_t>& kv_rows = scratch.kv_rows;
  const int64_t G = s.G, D = s.D, BS = s.BS, Hkv = s.Hkv, j0 = p * kPart;
  const auto keys_of = [&](int64_t t) { return std::max<int64_t>(0, std::min(j0 + kPart, cx[t]) - j0); };  // row t's
  int64_t n = 0;
  for (int64_t t = t0; t < t1; ++t) n = std::max(n, keys_of(t));
  if (n <= 0) return;
  const int64_t npad = (n + 7) / 8 * 8, R = t1 - t0;
  scores.resize(R * G * npad);
  kv_rows.resize(npad);
  for (int64_t j = 0; j < npad; ++j) {
    const int64_t key = j0 + std::min(j, n - 1);
    kv_rows[j] = ((static_cast<int64_t>(table[key / BS]) * BS + key % BS) * Hkv + kh) * D;
  }
  const bool f32 = kt == KvType::kF32;
  const float* kp = f32 ? static_cast<const float*>(kbase) : nullptr;
  const uint16_t* k16 = static_cast<const uint16_t*>(kbase);
  const float* vp = f32 ? static_cast<const float*>(vbase) : nullptr;
  const int64_t* v_rows = kv_rows.data();  // V row offsets from vp
  if (!f32) {
    scratch.keys.resize(8 * D);
    scratch.values.resize(32 * D);
    vp = scratch.values.data();
    scratch.block_rows.resize(npad);  // key j's row in the widened block of 32 that holds it
    for (int64_t j = 0; j < npad; ++j) scratch.block_rows[j] = (j % 32) * D;
    v_rows = scratch.block_rows.data();
  }
  // Scores, 8 keys at a time per head: 8 accumulators share each q load, and one transposing
  // reduction (6 hadds) gives the 8 dot products in one vector instead of 8 horizontal sums.
  const int64_t elem = f32 ? 4 : 2, row_bytes = D * elem;
  const char* kbytes = static_cast<const char*>(kbase);
  const char* vbytes = static_cast<const char*>(vbase);
  // The next group's keys to L1 and this group's values to L2 (read after the scores), for a
  // decode step (Qwen 1.5B's shape, 2k keys, 1 row: 11.1 -> 10.0 ms float32, 6.2 -> 5.8 ms
  // float16): the rows lie block by block across the pool. Not for more rows, whose scoring
  // outlasts the loads, and where the burst of prefetches stalled (8 rows: 24.8 -> 26.2 ms).
  const bool prefetch = R <= 2;
  for (int64_t j8 = 0; j8 < npad; j8 += 8) {
    if (prefetch) {
      for (int64_t j = j8 + 8; j < std::min(j8 + 16, npad); ++j)
        for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(kbytes + kv_rows[j] * elem + c, _MM_HINT_T0);
      for (int64_t j = j8; j < j8 + 8; ++j)
        for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(vbytes + kv_rows[j] * elem + c, _MM_HINT_T1);
    }
    const float* kr[8];
    for (int i = 0; i < 8; ++i) {
      if (f32) {
        kr[i] = kp + kv_rows[j8 + i];
      } else {
        widen(kt, k16 + kv_rows[j8 + i], D, scratch.keys.data() + i * D);
        kr[i] = scratch.keys.data() + i * D;
      }
    }
    // Every row's scores, also a row that sees none of these keys (its scores go unread): the
    // keys exist, another row of the sequence sees them.
    if (wide)
      score_group_f32(qp + kh * G * D, t0, t1, s.H, G, kr, D, fscale, scores.data() + j8, npad);
    else
      score_group_avx2(qp + kh * G * D, t0, t1, s.H, G, kr, D, fscale, scores.data() + j8, npad);
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nt = keys_of(t), item = (t * Hkv + kh) * P + p;
    if (nt == 0) continue;
    float* m_out = part_m + item * G;
    float* l_out = part_l + item * G;
    // exp(score - the partition's max) per head, and their sum, over the row's own nt keys.
    for (int64_t g = 0; g < G; ++g) {
      float* sc = scores.data() + ((t - t0) * G + g) * npad;
      __m256 mv = _mm256_set1_ps(-INFINITY);
      int64_t j = 0;
      for (; j + 8 <= nt; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
      float mx = hmax(mv);
      for (; j < nt; ++j) mx = std::max(mx, sc[j]);
      const __m256 mb = _mm256_set1_ps(mx);
      __m256 sv = _mm256_setzero_ps();
      j = 0;
      for (; j + 8 <= nt; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mb));
        _mm256_storeu_ps(sc + j, e);
        sv = _mm256_add_ps(sv, e);
      }
      float sum = hsum(sv);
      if (j < nt) {  // the tail through the same vector exp, padded
        alignas(32) float buf[8];
        std::fill_n(buf, 8, -INFINITY);
        std::copy(sc + j, sc + nt, buf);
        alignas(32) float e[8];
        _mm256_store_ps(e, exp256(_mm256_sub_ps(_mm256_load_ps(buf), mb)));
        for (int64_t r = 0; r < nt - j; ++r) {
          sc[j + r] = e[r];
          sum += e[r];
        }
      }
      m_out[g] = mx;
      l_out[g] = sum;
    }
    std::fill_n(part_o + item * G * D, G * D, 0.f);
  }
  // Output: keys in blocks of 32, whose V rows stay in L1 across the passes of every row and
  // head group over them: 16 columns at a time for up to 4 heads in registers, carried from
  // block to block in o.
  const uint16_t* v16 = static_cast<const uint16_t*>(vbase);
  for (int64_t jb = 0; jb < n; jb += 32) {
    if (!f32)
      for (int64_t j = jb; j < std::min<int64_t>(jb + 32, n); ++j)
        widen(kt, v16 + kv_rows[j], D, scratch.values.data() + (j - jb) * D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nt = keys_of(t);
      if (jb >= nt) continue;
      const int64_t je = std::min<int64_t>(jb + 32, nt), item = (t * Hkv + kh) * P + p;
      const int64_t step = wide ? 8 : 4;
      for (int64_t g0 = 0; g0 < G; g0 += step) {
        const float* w = scores.data() + ((t - t0) * G + g0) * npad;
        float* o = part_o + (item * G + g0) * D;
        auto run = [&](auto heads, int64_t) {  // a head count known to the compiler: the sums stay in registers
          constexpr int GN = decltype(heads)::value;
          if (wide) {
            weigh_values_wide<GN>(vp, v_rows, w, npad, jb, je, D, o);
          } else if constexpr (GN <= 4) {
            weigh_values<GN>(vp, v_rows, w, npad, jb, je, D, o);
          }
        };
        chatserve::rest_tile<8>(std::min<int64_t>(step, G - g0), 0, run);
      }
    }
  }
}

// ---- The AMX path (a bfloat16 cache on a CPU with AMX-BF16) ----
//
// The same items, partitions and merge as attend_partition, but the two products run on the tile
// unit: scores^T [16 keys x 16 queries] = K [16 keys x 32 dims] . Q^T, straight from the cache (16
// keys of one block are 16 rows Hkv * D apart), and out [16 queries x 16 dims] = P [16 queries x
// 32 keys] . V. The queries (a row's G heads, then the next row's) and the attention weights P are
// rounded to bfloat16 (round to nearest even), and each product sums in float32. Every element of
// a tile product depends on its own row and column only, and the softmax runs per query lane, so
// a row's numbers still do not depend on the rows beside it. The operands the tile unit wants in
// pairs (Q^T and V: two consecutive dims or keys in each 32-bit word) are rearranged once per item
// in L1/L2 scratch and shared by every row.

// Tiles 0-3: float32 accumulators, 4: the A operand, 5: the B operand; each 16 rows of 64 bytes.
CHATSERVE_AMX void amx_configure() {
  alignas(64) TileConfig c;
  for (int i = 0; i < 6; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// _tile_dpbf16ps takes tile numbers as immediates.
CHATSERVE_AMX inline void dp_into(int c) {
  switch (c) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}
CHATSERVE_AMX inline void zero_tile(int c) {
  switch (c) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}
CHATSERVE_AMX inline void store_tile(int c, void* dst, int64_t stride) {
  switch (c) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
  }
}

// exp256's polynomial (the same constants and steps) on 16 lanes.
CHATSERVE_AMX inline __m512 exp512(__m512 x) {
  using C = chatserve::ExpConst;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(C::kMax)), _mm512_set1_ps(-C::kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(C::kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Hi), x));
  __m512 y = _mm512_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(C::kPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Word 2i <- word i, word 2i + 1 <- word 16 + i: two rows of 16 bfloat16 (low and high half) into
// the 32-bit pairs the tile unit multiplies.
CHATSERVE_AMX inline __m512i pair_index() {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<int16_t>(i);
    idx[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  return _mm512_load_si512(idx);
}

// Key j's weight for 16 query lanes: exp(scale * s - m) for the lanes that see key j (nt > j), else 0
// (also for a key past the partition's n, whose score is not computed).
CHATSERVE_AMX inline __m512 attention_weight(const float* score, int64_t j, int64_t n, __m512i nt, __m512 vscale,
                                            __m512 msc) {
  if (j >= n) return _mm512_setzero_ps();
  const __mmask16 live = _mm512_cmpgt_epi32_mask(nt, _mm512_set1_epi32(static_cast<int>(j)));
  return _mm512_maskz_mov_ps(live, exp512(_mm512_fmsub_ps(_mm512_loadu_ps(score), vscale, msc)));
}

struct AmxScratch {
  std::vector<uint16_t> qb;     // Q^T in pairs: [query tile][D / 32][16 dim pairs][16 queries x 2]
  std::vector<float> scores;    // raw q . k: [n16 keys][64 queries] (a chunk of up to 4 query tiles)
  std::vector<uint16_t> p;      // attention weights in bfloat16: [64 queries][n32 keys]
  std::vector<uint16_t> vb;     // V in pairs: [n32 / 32][D / 16][16 key pairs][16 dims x 2]
  std::vector<int64_t> rows;    // key j's offset in the caches
  std::vector<int32_t> keys;    // keys each query sees in this partition
  alignas(64) float out[16 * 64];
};

CHATSERVE_AMX void attend_partition_amx(const AttnShape& s, const float* qp, const uint16_t* kc, const uint16_t* vc,
                                        const int32_t* table, const int64_t* cx, int64_t t0, int64_t t1, int64_t kh,
                                        int64_t p, int64_t P, float fscale, float* part_m, float* part_l,
                                        float* part_o, AmxScratch& sc) {
  const int64_t G = s.G, D = s.D, BS = s.BS, Hkv = s.Hkv, j0 = p * kPart, KS = D / 32, DC = D / 16;
  const auto keys_of = [&](int64_t t) { return std::max<int64_t>(0, std::min(j0 + kPart, cx[t]) - j0); };
  int64_t n = 0;
  for (int64_t t = t0; t < t1; ++t) n = std::max(n, keys_of(t));
  if (n <= 0) return;
  const int64_t n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32, Q = (t1 - t0) * G, QT = (Q + 15) / 16;
  sc.rows.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = j0 + j;
    sc.rows[j] = ((static_cast<int64_t>(table[key / BS]) * BS + key % BS) * Hkv + kh) * D;
  }
  sc.keys.resize(QT * 16);
  for (int64_t q = 0; q < QT * 16; ++q) sc.keys[q] = q < Q ? static_cast<int32_t>(keys_of(t0 + q / G)) : 0;
  const auto query = [&](int64_t q) { return qp + ((t0 + q / G) * s.H + kh * G + q % G) * D; };
  // Q^T in pairs: a query's 32 dims of one step, rounded, are 16 pairs; transposed, row i holds
  // pair i of the tile's 16 queries.
  sc.qb.resize(QT * KS * 512);
  for (int64_t qt = 0; qt < QT; ++qt)
    for (int64_t ks = 0; ks < KS; ++ks) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int64_t q = qt * 16 + c;
        if (q < Q) {
          const float* x = query(q) + ks * 32;
          r[c] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
        } else {
          r[c] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(sc.qb.data() + ((qt * KS + ks) * 16 + i) * 32, r[i]);
    }
  const __m512i pairs = pair_index();
  const int64_t kstride = Hkv * D * 2;  // bytes from one key's row to the next within a block
  sc.scores.resize(n16 * 64);
  sc.p.resize(64 * n32);
  float* scores = sc.scores.data();
  uint16_t* pw = sc.p.data();
  for (int64_t qc = 0; qc < QT; qc += 4) {  // up to 4 query tiles share each load of K
    const int nq = static_cast<int>(std::min<int64_t>(4, QT - qc));
    for (int64_t j = 0; j < n16; j += 16) {  // 16 keys of one block (BS a multiple of 16)
      // The next tile's keys to L1, and (the first pass) this tile's values to L2 for the
      // rearranging below: a long context's caches come from L3 or memory, and perf put most of a
      // decode row's samples on the loads of K and V without these (Qwen 1.5B's shape, 2k keys,
      // 1 row, one thread, a busy machine: 6.8 -> 6.3 ms; the row then reads ~9 GB/s, near what
      // one thread streams here).
      if (j + 16 < n16)
        for (int64_t i = j + 16; i < std::min(j + 32, n); ++i)
          for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(kc + sc.rows[i]) + b, _MM_HINT_T0);
      if (qc == 0)
        for (int64_t i = j; i < std::min(j + 16, n); ++i)
          for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vc + sc.rows[i]) + b, _MM_HINT_T1);
      for (int c = 0; c < nq; ++c) zero_tile(c);
      const uint16_t* k = kc + sc.rows[j];
      for (int64_t ks = 0; ks < KS; ++ks) {
        _tile_loadd(4, k + ks * 32, kstride);
        for (int c = 0; c < nq; ++c) {
          _tile_loadd(5, sc.qb.data() + ((qc + c) * KS + ks) * 512, 64);
          dp_into(c);
        }
      }
      for (int c = 0; c < nq; ++c) store_tile(c, scores + j * 64 + c * 16, 64 * 4);
    }
    if (qc == 0) {
    // V in pairs: keys 2i and 2i + 1 of a step of 32, 16 dims at a time; keys past n are zeros (their
    // weights are 0, and 0 times a stale NaN would not be).
    sc.vb.resize(n32 / 32 * DC * 512);
    for (int64_t j2 = 0; j2 < n32; j2 += 32)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t ka = j2 + 2 * i, kb = ka + 1;
        for (int64_t c = 0; c < DC; ++c) {
          const __m256i a = ka < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + sc.rows[ka] + c * 16))
                                   : _mm256_setzero_si256();
          const __m256i b = kb < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + sc.rows[kb] + c * 16))
                                   : _mm256_setzero_si256();
          _mm512_storeu_si512(sc.vb.data() + (((j2 / 32) * DC + c) * 16 + i) * 32,
                              _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
        }
      }
    }
    for (int c = 0; c < nq; ++c) {
      // Softmax per query lane over its own keys: the max, then exp(scale * (s - max)) (0 past the
      // query's keys) rounded to bfloat16 and transposed 32 keys at a time into P's rows.
      const __m512i nt = _mm512_loadu_si512(sc.keys.data() + (qc + c) * 16);
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < n; ++j)
        mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(nt, _mm512_set1_epi32(static_cast<int>(j))), mx,
                                _mm512_loadu_ps(scores + j * 64 + c * 16));
      const __mmask16 seen = _mm512_cmpgt_epi32_mask(nt, _mm512_setzero_si512());
      const __m512 vscale = _mm512_set1_ps(fscale), msc = _mm512_maskz_mul_ps(seen, mx, vscale);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j2 = 0; j2 < n32; j2 += 32) {
        __m512i w[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t ja = j2 + 2 * i;
          const __m512 e0 = attention_weight(scores + ja * 64 + c * 16, ja, n, nt, vscale, msc);
          const __m512 e1 = attention_weight(scores + (ja + 1) * 64 + c * 16, ja + 1, n, nt, vscale, msc);
          sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
          w[i] = _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
        }
        transpose16(w);
        for (int q = 0; q < 16; ++q) _mm512_storeu_si512(pw + (c * 16 + q) * n32 + j2, w[q]);
      }
      alignas(64) float m_lane[16], l_lane[16];
      _mm512_store_ps(m_lane, msc);
      _mm512_store_ps(l_lane, sum);
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t q = (qc + c) * 16 + lane;
        if (q >= Q || sc.keys[q] == 0) continue;
        const int64_t item = ((t0 + q / G) * Hkv + kh) * P + p;
        part_m[item * G + q % G] = m_lane[lane];
        part_l[item * G + q % G] = l_lane[lane];
      }
      // out = P . V, 4 tiles of 16 dims at a time.
      for (int64_t dg = 0; dg < DC; dg += 4) {
        const int nd = static_cast<int>(std::min<int64_t>(4, DC - dg));
        for (int d = 0; d < nd; ++d) zero_tile(d);
        for (int64_t j2 = 0; j2 < n32; j2 += 32) {
          _tile_loadd(4, pw + c * 16 * n32 + j2, n32 * 2);
          for (int d = 0; d < nd; ++d) {
            _tile_loadd(5, sc.vb.data() + ((j2 / 32) * DC + dg + d) * 512, 64);
            dp_into(d);
          }
        }
        for (int d = 0; d < nd; ++d) store_tile(d, sc.out + d * 16, 64 * 4);
        for (int lane = 0; lane < 16; ++lane) {
          const int64_t q = (qc + c) * 16 + lane;
          if (q >= Q || sc.keys[q] == 0) continue;
          const int64_t item = ((t0 + q / G) * Hkv + kh) * P + p;
          std::copy_n(sc.out + lane * 64, nd * 16, part_o + (item * G + q % G) * D + dg * 16);
        }
      }
    }
  }
}

// Work items [i0, i1) on the AMX path: this thread's tiles configured once, released after.
struct Item {
  int64_t t0, t1, kh, p;  // rows [t0, t1) of one sequence, kv head, partition
};

CHATSERVE_AMX void attend_items_amx(const AttnShape& s, const Item* items, int64_t i0, int64_t i1, const float* qp,
                                    const uint16_t* kc, const uint16_t* vc, const int32_t* bt, const int64_t* sq,
                                    const int64_t* cx, int64_t P, float fscale, float* part_m, float* part_l,
                                    float* part_o) {
  AmxScratch scratch;
  amx_configure();
  for (int64_t i = i0; i < i1; ++i) {
    const Item& it = items[i];
    attend_partition_amx(s, qp, kc, vc, bt + sq[it.t0] * s.MB, cx, it.t0, it.t1, it.kh, it.p, P, fscale, part_m,
                         part_l, part_o, scratch);
  }
  _tile_release();
}

}  // namespace

// Whether paged_attention_rows over this cache runs on the AMX tiles: a bfloat16 cache whose blocks hold whole
// tiles of 16 keys, head_dim % 32 == 0, AMX on. Python asks it too (decode_ops.tiles_attend), to send a prefill
// chunk's rows here rather than to SDPA: one condition, stated once.
bool attention_on_tiles(torch::Tensor k_cache, int64_t head_dim) {
  return k_cache.scalar_type() == torch::kBFloat16 && k_cache.dim() == 4 && k_cache.size(1) % 16 == 0 &&
         head_dim % 32 == 0 && chatserve::amx_enabled();
}

void paged_attention_rows(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor block_tables, torch::Tensor seq, torch::Tensor ctx, double scale) {
  check_f32(out, "attention out");
  check_f32(q, "attention q");
  const KvType kt = check_cache(k_cache, "attention k_cache");
  TORCH_CHECK(check_cache(v_cache, "attention v_cache") == kt, "attention: k_cache and v_cache of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous());
  TORCH_CHECK(seq.scalar_type() == torch::kInt64 && ctx.scalar_type() == torch::kInt64);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && D % 16 == 0 && out.sizes() == q.sizes());
  const AttnShape s{H, Hkv, H / Hkv, D, BS, MB};
  const int64_t G = s.G, num_blocks = k_cache.size(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  int64_t P = 1;  // partitions of the longest row
  for (int64_t t = 0; t < T; ++t) {  // checked here: nothing may throw inside the parallel region
    TORCH_CHECK(sq[t] >= 0 && sq[t] < block_tables.size(0), "attention: bad sequence index");
    TORCH_CHECK(cx[t] >= 1 && (cx[t] + BS - 1) / BS <= MB, "attention: context beyond the block table");
    for (int64_t b = 0; b < (cx[t] + BS - 1) / BS; ++b)
      TORCH_CHECK(bt[sq[t] * MB + b] >= 0 && bt[sq[t] * MB + b] < num_blocks, "attention: bad block id");
    P = std::max(P, (cx[t] + kPart - 1) / kPart);
  }
  // Items (a run of rows of one sequence, kv head, partition): the rows of a verification read
  // each partition's keys together.
  std::vector<Item> items;
  for (int64_t r0 = 0; r0 < T;) {
    int64_t r1 = r0 + 1, parts = (cx[r0] + kPart - 1) / kPart;
    for (; r1 < T && sq[r1] == sq[r0]; ++r1) parts = std::max(parts, (cx[r1] + kPart - 1) / kPart);
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int64_t p = 0; p < parts; ++p) items.push_back({r0, r1, kh, p});
    r0 = r1;
  }
  std::vector<float> part_m(T * Hkv * P * G), part_l(T * Hkv * P * G), part_o(T * Hkv * P * G * D);
  const float* qp = q.data_ptr<float>();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  const float fscale = static_cast<float>(scale);
  const bool wide = chatserve::vnni_enabled();  // the 512-bit loops (same numbers), where AVX-512 is
  const bool amx = attention_on_tiles(k_cache, D);  // the tile unit
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    if (amx) {
      attend_items_amx(s, items.data(), i0, i1, qp, static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp),
                       bt, sq, cx, P, fscale, part_m.data(), part_l.data(), part_o.data());
      return;
    }
    Scratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      attend_partition(s, qp, kp, vp, kt, bt + sq[it.t0] * MB, cx, it.t0, it.t1, it.kh, it.p, P, fscale,
                       part_m.data(), part_l.data(), part_o.data(), scratch, wide);
    }
  });
  // Merge each row's partitions in order: out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p.
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, kh = i % Hkv, parts = (cx[t] + kPart - 1) / kPart;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_m[(i * P + p) * G + g]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float w = std::exp(part_m[(i * P + p) * G + g] - mx);
          sum += w * part_l[(i * P + p) * G + g];
          const __m256 wv = _mm256_set1_ps(w);
          const float* o = part_o.data() + ((i * P + p) * G + g) * D;
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc.data() + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(o + d), _mm256_loadu_ps(acc.data() + d)));
        }
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        float* dst = op + (t * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + d), inv));
      }
    }
  });
}
