// int4 weight x int8-quantized activation matmul for x86 CPUs with AVX2 (kernels/int4_matmul.py).
//
// Weight layout ("q4 groups of 32", as GGUF's Q4_1 block), one row per output feature:
//   codes  [N, K/2] uint8: group g of row n is bytes [16g, 16g + 16); byte j holds the code of
//          k = 32g + j in its low nibble and of k = 32g + 16 + j in its high nibble (0..15)
//   params [N, K/32, 2] fp16: (d, m) per group, w = d * code + m
// Activations are quantized per row and group of 32 (as llama.cpp's Q8_1):
//   xq [M, K] int8, xd [M, K/32] float (x ~= xd * xq), xs [M, K/32] float (= xd * sum(xq))
// so that  y[r, n] = sum_g d_g * xd_g * dot(code_g, xq_g) + m_g * xs_g.
// Every output element is computed the same way whatever M is: rows never mix, which keeps
// greedy speculation (verification rows) equal to one-row decoding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

namespace {

constexpr int kGroup = 32;

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 16 bytes of codes -> 32 unsigned bytes in k order (low nibbles = k 0..15, high = k 16..31).
inline __m256i unpack_codes(const uint8_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(raw, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// Output rows [n0, n1) for activation rows [r0, r0 + R), R <= 4 (a register tile).
template <int R>
void tile(const uint8_t* codes, const at::Half* params, const int8_t* xq, const float* xd, const float* xs,
          float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint16_t* pm = reinterpret_cast<const uint16_t*>(params) + n * G * 2;
    __m256 acc[R];
    float mterm[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); mterm[r] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
      const __m256i w = unpack_codes(c + g * 16);
      const float d = _cvtsh_ss(pm[2 * g]);
      const float m = _cvtsh_ss(pm[2 * g + 1]);
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + row * K + g * kGroup));
        const __m256i dot16 = _mm256_maddubs_epi16(w, a);  // u8 x s8 pairs -> i16 (|.| <= 3810)
        const __m256i dot32 = _mm256_madd_epi16(dot16, ones);
        const __m256 scale = _mm256_set1_ps(d * xd[row * G + g]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32), scale, acc[r]);
        mterm[r] += m * xs[row * G + g];
      }
    }
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = hsum(acc[r]) + mterm[r];
  }
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
  const float* src = x.data_ptr<float>();
  int8_t* q = xq.data_ptr<int8_t>();
  float* d = xd.data_ptr<float>();
  float* s = xs.data_ptr<float>();
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
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
  return {xq, xd, xs};
}

// y [M, N] float32 = x @ W.T for the quantized activations of quantize_rows.
torch::Tensor q4_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor xs, torch::Tensor codes,
                        torch::Tensor params) {
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && codes.scalar_type() == torch::kUInt8);
  TORCH_CHECK(params.scalar_type() == torch::kHalf && xd.scalar_type() == torch::kFloat32);
  TORCH_CHECK(xq.is_contiguous() && xd.is_contiguous() && xs.is_contiguous() && codes.is_contiguous() &&
              params.is_contiguous());
  const int64_t M = xq.size(0), K = xq.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) * 2 == K && params.size(0) == N && params.size(1) * kGroup == K);
  auto y = torch::empty({M, N}, xd.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const at::Half* p = params.data_ptr<at::Half>();
  const int8_t* q = xq.data_ptr<int8_t>();
  const float* d = xd.data_ptr<float>();
  const float* s = xs.data_ptr<float>();
  float* out = y.data_ptr<float>();
  // Split the output features over threads. Each thread walks its rows of W in chunks small
  // enough to stay in L2 (~128 KiB of codes) and runs every activation row over a chunk before
  // the next (tiles of 4 activation rows share each unpacked group): W is read from memory once.
  const int64_t chunk = std::max<int64_t>(16, (128 * 1024) / (K / 2));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += chunk) {
      const int64_t ne = std::min(nb + chunk, n1);
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) tile<4>(c, p, q, d, s, out, K, N, r, nb, ne);
      switch (M - r) {
        case 3: tile<3>(c, p, q, d, s, out, K, N, r, nb, ne); break;
        case 2: tile<2>(c, p, q, d, s, out, K, N, r, nb, ne); break;
        case 1: tile<1>(c, p, q, d, s, out, K, N, r, nb, ne); break;
        default: break;
      }
    }
  });
  return y;
}

// codes [N, K/2], params [N, K/32, 2] -> W [N, K] float32 (for long prefill chunks, where a dense
// GEMM beats the integer kernel).
torch::Tensor q4_dequantize(torch::Tensor codes, torch::Tensor params) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && params.scalar_type() == torch::kHalf);
  TORCH_CHECK(codes.is_contiguous() && params.is_contiguous());
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / kGroup;
  auto w = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* pm = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  float* out = w.data_ptr<float>();
  at::parallel_for(0, N * G, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const __m256i codes32 = unpack_codes(c + i * 16);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(pm[2 * i]));
      const __m256 m = _mm256_set1_ps(_cvtsh_ss(pm[2 * i + 1]));
      const __m128i lo = _mm256_castsi256_si128(codes32), hi = _mm256_extracti128_si256(codes32, 1);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
        _mm256_storeu_ps(out + i * kGroup + 8 * j, _mm256_fmadd_ps(v, d, m));
      }
    }
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row, per-32 int8 quantization of activations");
  m.def("q4_dequantize", &q4_dequantize, "int4 (groups of 32) weight -> float32");
  m.def("q4_matmul", &q4_matmul, "int4 (groups of 32) weight x int8 activation matmul");
}
