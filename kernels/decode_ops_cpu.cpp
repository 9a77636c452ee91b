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
// decode step at its position bit for bit.
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

}  // namespace

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
  struct Item {
    int64_t t0, t1, kh, p;
  };
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
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
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
