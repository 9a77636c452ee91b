// GGUF's Q4_K weights against activations quantized as llama.cpp's Q8_K, for x86 CPUs with AVX2
// (kernels/quant_matmul.py, quant/q4k.py).
//
// Weight layout (K % 256 == 0), one row per output feature, superblocks of 256 weights made of 8
// sub-blocks of 32:
//   codes [N, K/2] uint8: GGUF's Q4_K `qs` (and quant/int4.py's codes): bytes [32p, 32p + 32)
//         hold sub-block 2p in their low nibbles and 2p + 1 in their high nibbles
//   subs  [N, K/256, 16] uint8: the 8 sub-block scales sc_j, then the 8 sub-block mins m_j
//   dd    [N, K/256, 2] float32: d, dmin;   w = d * sc_j * code - dmin * m_j
// Activations, per row and superblock: xq [M, K] int8, xd [M, K/256] float (x ~= xd * xq), bsums
// [M, K/32] int16 (the sum of xq over each sub-block), so that
//   y[r, n] = sum_s xd[r, s] * (d[n, s] * sum_j sc_j * (code_j . xq_j) - dmin[n, s] * sum_j m_j * bsum_j)
// The sub-block sums stay in int32 across a superblock (vpmaddubsw, then vpmaddwd by the integer
// scale): one float multiply-add per 256 weights instead of one per 32 as in the int4 kernel of
// quant_matmul_cpu.cpp, which left that kernel bound by its float chain. Rows never mix: every
// output is computed the same way whatever M is (greedy speculation relies on it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "cpu_simd.h"
#include <algorithm>
#include <cmath>

namespace {

using chatserve::hsum;

constexpr int kSuper = 256;
constexpr int kSub = 32;

inline int hsum_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(v);
}

// vpshufb controls that broadcast int16 element j of each 128-bit lane to the whole lane.
struct ScaleShuffles {
  __m256i s[8];
  ScaleShuffles() {
    for (int j = 0; j < 8; ++j) s[j] = _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
  }
};

// Output y[r0 .. r0 + R, n]: each unpacked weight vector serves R activation rows. (Tiles of 2 or 4
// weight rows as well were slower at every row count measured, 1 to 128: decode is bound by
// memory, and more streams of W at once only lowered the read rate; docs/benchmarks.md.)
template <int R>
inline void tile(const uint8_t* codes, const uint8_t* subs, const float* dd, const int8_t* xq, const float* xd,
                 const int16_t* bsums, const float* bias, float* y, int64_t K, int64_t N, int64_t r0, int64_t n,
                 const ScaleShuffles& shuf) {
  const int64_t S = K / kSuper;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* row_codes = codes + n * (K / 2);
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.f;
  }
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = subs + (n * S + s) * 16;
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb))));
    const __m128i mvec = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 8)));
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p and 2p + 1: one 32-byte load
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_codes + s * 128 + p * 32));
      const __m256i wa = _mm256_and_si256(v, low4);
      const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const __m256i sa = _mm256_shuffle_epi8(scales, shuf.s[2 * p]);
      const __m256i sc = _mm256_shuffle_epi8(scales, shuf.s[2 * p + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + (r0 + r) * K + s * kSuper + p * 2 * kSub;
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + kSub));
        // u8 x s8 pairs -> i16 (|.| <= 2 * 15 * 127), times the sub-block's scale -> i32
        const __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xa), sa);
        const __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(wb, xb), sc);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pa, pb));
      }
    }
    const float* dn = dd + (n * S + s) * 2;
    for (int r = 0; r < R; ++r) {
      const float x_d = xd[(r0 + r) * S + s];
      const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums + (r0 + r) * (K / kSub) + s * 8));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(dn[0] * x_d), acc[r]);
      mins[r] += dn[1] * x_d * static_cast<float>(hsum_epi32(_mm_madd_epi16(mvec, bs)));
    }
  }
  const float b = bias != nullptr ? bias[n] : 0.f;
  for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = hsum(acc[r]) - mins[r] + b;
}

template <int R>
inline void tiles(const uint8_t* codes, const uint8_t* subs, const float* dd, const int8_t* xq, const float* xd,
                  const int16_t* bsums, const float* bias, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0,
                  int64_t n1, const ScaleShuffles& shuf) {
  for (int64_t n = n0; n < n1; ++n) tile<R>(codes, subs, dd, xq, xd, bsums, bias, y, K, N, r0, n, shuf);
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

// y [M, N] = the quantized rows times the Q4_K weight (+ bias). Output features are split over
// threads; each thread walks its rows of W in chunks that stay in L2 (~128 KiB of codes) and
// runs every activation row over a chunk before the next: W is read from memory once per call
// whatever M is.
void q4k_run(const int8_t* q, const float* d, const int16_t* bs, const uint8_t* c, const uint8_t* sb,
             const float* dn, const float* bias, float* out, int64_t M, int64_t K, int64_t N) {
  const ScaleShuffles shuf;
  const int64_t chunk = std::max<int64_t>(16, (128 * 1024) / (K / 2));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += chunk) {
      const int64_t ne = std::min(nb + chunk, n1);
      chatserve::for_row_tiles(M, [&](auto rows, int64_t r) { tiles<decltype(rows)::value>(c, sb, dn, q, d, bs, bias, out, K, N, r, nb, ne, shuf); });
    }
  });
}

void check_weight(const torch::Tensor& codes, const torch::Tensor& subs, const torch::Tensor& dd, int64_t K) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && subs.scalar_type() == torch::kUInt8 &&
              dd.scalar_type() == torch::kFloat32);
  TORCH_CHECK(codes.is_contiguous() && subs.is_contiguous() && dd.is_contiguous());
  const int64_t N = codes.size(0), S = K / kSuper;
  TORCH_CHECK(K % kSuper == 0 && codes.size(1) * 2 == K && subs.numel() == N * S * 16 && dd.numel() == N * S * 2,
              "Q4_K weight and activations do not match");
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
  const int64_t M = xq.size(0), K = xq.size(1), N = codes.size(0);
  check_weight(codes, subs, dd, K);
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
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_weight(codes, subs, dd, K);
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
