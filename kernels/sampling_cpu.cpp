// One row of logits at a temperature, read in one or two passes instead of torch's ~10 full-row ops
// (kernels/sampling_ops.py holds the launchers and the plain-torch references they are tested against).
// A row's value is s = logits / temperature in float32, as logits_to_probs computes it; weights are
// exp(s - top), top the row's largest s, summed in float64.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>
#include "cpu_simd.h"

using chatserve::exp256;
using chatserve::hmax;

namespace {

constexpr int64_t kShortGuess = 64;  // top-p's first partial sort, before nucleus_guess and all

const float* row_data(const torch::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() && logits.dim() == 1 &&
                  !logits.is_cuda(), name, ": a contiguous float32 CPU row");
  return logits.data_ptr<float>();
}

// exp(s - top) of the 8 values at i, 0 past n (the last, partial vector).
inline __m256 weights_at(const float* r, int64_t i, int64_t n, __m256 t, __m256 top) {
  __m256 x;
  if (i + 8 <= n) {
    x = _mm256_loadu_ps(r + i);
  } else {
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? r[i + j] : -std::numeric_limits<float>::infinity();
    x = _mm256_load_ps(tail);
  }
  const __m256 w = exp256(_mm256_sub_ps(_mm256_div_ps(x, t), top));
  return _mm256_and_ps(w, _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ));
}

// The candidates of a row: its largest s and the tokens with s >= float32(top - offset), ascending.
struct Candidates {
  double top = 0.0;
  std::vector<int64_t> ids;
  std::vector<float> values;
};

// The row's largest s (division by t > 0 keeps the order), NaN if a value is NaN or the row is empty.
float row_top(const float* r, int64_t n, float t) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(r + i);
    vmax = _mm256_max_ps(vmax, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float largest = hmax(vmax);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    has_nan |= std::isnan(r[i]);
    largest = std::max(largest, r[i]);
  }
  return has_nan || n == 0 ? std::numeric_limits<float>::quiet_NaN() : largest / t;
}

bool collect(const float* r, int64_t n, float t, double offset, Candidates& c) {
  c.ids.clear();
  c.values.clear();
  const float top = row_top(r, n, t);
  if (std::isnan(top)) return false;
  c.top = top;
  const float floor = static_cast<float>(static_cast<double>(top) - offset);
  const __m256 vt = _mm256_set1_ps(t), vfloor = _mm256_set1_ps(floor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 s = _mm256_div_ps(_mm256_loadu_ps(r + i), vt);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(s, vfloor, _CMP_GE_OQ));
    if (mask) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, s);
      for (; mask; mask &= mask - 1) {
        const int j = __builtin_ctz(mask);
        c.ids.push_back(i + j);
        c.values.push_back(lanes[j]);
      }
    }
  }
  for (; i < n; ++i) {
    const float s = r[i] / t;
    if (s >= floor) {
      c.ids.push_back(i);
      c.values.push_back(s);
    }
  }
  return true;
}

// The sum of exp(r / t - top) over r [n], in float64 lanes (float ones over a long row lost ~1e-6 of it).
double weight_sum(const float* r, int64_t n, float t, double top) {
  const __m256 vt = _mm256_set1_ps(t), vtop = _mm256_set1_ps(static_cast<float>(top));
  __m256d acc = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 w = weights_at(r, i, n, vt, vtop);
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))));
  }
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

// The n largest of values, descending.
std::vector<float> largest(const std::vector<float>& values, int64_t n) {
  std::vector<float> out(values);
  std::partial_sort(out.begin(), out.begin() + n, out.end(), std::greater<float>());
  out.resize(n);
  return out;
}

// How many of ordered (descending) top-p keeps: while the larger ones hold < top_p of `total` (in
// units of the largest token's weight), at least one.
int64_t count_nucleus(const std::vector<float>& ordered, double top, double top_p, double total) {
  double before = 0.0;
  int64_t kept = 0;
  for (float v : ordered) {
    if (!(before < top_p * total)) break;
    ++kept;
    before += std::exp(static_cast<double>(v) - top);
  }
  return std::max<int64_t>(kept, 1);
}

}  // namespace

// (top, total): the row's largest s (NaN if a value is NaN) and the sum of its weights exp(s - top).
std::tuple<double, double> row_softmax(torch::Tensor logits, double temperature) {
  const float* r = row_data(logits, "row_softmax");
  const float t = static_cast<float>(temperature), top = row_top(r, logits.numel(), t);
  if (std::isnan(top)) return {top, std::numeric_limits<double>::quiet_NaN()};
  return {top, weight_sum(r, logits.numel(), t, top)};
}


// A token by inverse CDF at uniform from the row's weights, or from the residual max(p - minus, 0) of
// its softmax p (p = weights / total; minus a [n] float32 distribution, or the one-hot at minus_token
// >= 0) when that has any mass: the first token whose float64 running sum of the weights exceeds
// uniform x their total.
int64_t row_draw(torch::Tensor logits, double temperature, double top, double total, double uniform,
                 c10::optional<torch::Tensor> minus, int64_t minus_token) {
  const float* r = row_data(logits, "row_draw");
  const int64_t n = logits.numel();
  const float* q = minus.has_value() ? row_data(*minus, "row_draw minus") : nullptr;
  TORCH_CHECK(q == nullptr || minus->numel() == n, "row_draw: minus must have the row's size");
  const __m256 t = _mm256_set1_ps(static_cast<float>(temperature)), vtop = _mm256_set1_ps(static_cast<float>(top));
  const float scale = static_cast<float>(total);  // q in the weights' units
  alignas(32) float w[8];
  // weight i of the distribution drawn from: the row's, or the residual's
  auto weight = [&](int64_t i, int j, bool residual) -> double {
    if (!residual) return w[j];
    if (q != nullptr) return std::max(w[j] - q[i + j] * scale, 0.f);
    return i + j == minus_token ? 0.0 : w[j];
  };
  bool residual = q != nullptr || (minus_token >= 0 && minus_token < n);
  double mass = total;
  if (residual) {
    mass = 0.0;
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_store_ps(w, weights_at(r, i, n, t, vtop));
      for (int j = 0; j < 8 && i + j < n; ++j) mass += weight(i, j, true);
    }
    if (!(mass > 0.0)) {  // no residual mass (the draft covers the target): the row itself
      residual = false;
      mass = total;
    }
  }
  const double target = uniform * mass;
  double sum = 0.0;
  int64_t last = 0;  // the last token with weight: a target at the very end (rounding) takes it
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_store_ps(w, weights_at(r, i, n, t, vtop));
    for (int j = 0; j < 8 && i + j < n; ++j) {
      const double x = weight(i, j, residual);
      if (x > 0.0) {
        sum += x;
        last = i + j;
        if (sum > target) return last;
      }
    }
  }
  return last;
}

// What logits_to_probs's top-k, top-p and min-p keep of one row, found among its candidates (the
// reference, kernels/sampling_ops.py row_kept_ref, says how): (ids int64 [m] ascending, probs float64
// [m]), or two empty tensors for a NaN row or a nucleus that reaches past the candidates.
std::tuple<torch::Tensor, torch::Tensor> row_kept(torch::Tensor logits, double temperature, int64_t top_k,
                                                  double top_p, double min_p_offset, double margin,
                                                  int64_t nucleus_guess) {
  const float* r = row_data(logits, "row_kept");
  const int64_t n = logits.numel();
  const float t = static_cast<float>(temperature);
  const double inf = std::numeric_limits<double>::infinity();
  auto none = [] {
    return std::make_tuple(torch::empty({0}, torch::kInt64), torch::empty({0}, torch::kFloat64));
  };
  double offset = (top_k > 0 || top_p < 1.0) ? std::min(min_p_offset, margin) : min_p_offset;
  const bool is_min_p_floor = min_p_offset <= offset;  // nothing below the floor is kept
  Candidates c;
  if (!collect(r, n, t, offset, c)) return none();
  if (top_k > 0 && (top_p < 1.0 || !is_min_p_floor)) {
    while (static_cast<int64_t>(c.ids.size()) < top_k && offset < inf) {  // the top-k reaches lower
      offset = offset < 1e4 ? offset * 4 : inf;
      collect(r, n, t, offset, c);
    }
  }
  const int64_t m = static_cast<int64_t>(c.ids.size());
  double threshold = c.top - min_p_offset;
  if (top_k > 0 && m > top_k) {
    std::vector<float> v(c.values);
    std::nth_element(v.begin(), v.begin() + (top_k - 1), v.end(), std::greater<float>());
    threshold = std::max(threshold, static_cast<double>(v[top_k - 1]));  // the k-th largest
  }
  if (top_p < 1.0) {
    // top-p normalizes over the top-k, or (top-k off) over the whole row: the candidates' mass and the
    // rest's, at most `tail` (masses in units of the largest token's weight)
    const int64_t in_k = top_k > 0 ? std::min(top_k, m) : m;
    double total = 0.0, tail = 0.0, whole = -1.0;
    std::vector<float> ordered;
    if (top_k > 0) {
      ordered = largest(c.values, in_k);
      for (float v : ordered) total += std::exp(static_cast<double>(v) - c.top);
    } else {
      // a short guess first: a nucleus is mostly a few tokens, and a partial sort of 1,024 of a
      // thousand candidates cost more than the pass over the row
      ordered = largest(c.values, std::min<int64_t>(in_k, kShortGuess));
      total = weight_sum(c.values.data(), m, 1.f, c.top);
      tail = static_cast<double>(n - m) * std::exp(-offset);
    }
    auto whole_mass = [&] {
      if (whole < 0) whole = weight_sum(r, n, t, c.top);
      return whole;
    };
    auto nucleus = [&](const std::vector<float>& o) {
      const int64_t kept = count_nucleus(o, c.top, top_p, total);
      if (top_k > 0 || kept == count_nucleus(o, c.top, top_p, total + tail)) return kept;
      return count_nucleus(o, c.top, top_p, whole_mass());
    };
    int64_t kept = nucleus(ordered);
    for (int64_t guess : {nucleus_guess, in_k}) {  // while the nucleus is longer than the guess
      if (kept < static_cast<int64_t>(ordered.size()) || kept == in_k) break;
      ordered = largest(c.values, std::min(guess, in_k));
      kept = nucleus(ordered);
    }
    if (top_k <= 0 && !is_min_p_floor && total < top_p * (total + tail) && total < top_p * whole_mass()) {
      return none();  // the nucleus goes on past the candidates
    }
    threshold = std::max(threshold, static_cast<double>(ordered[kept - 1]));
  }
  const float cut = static_cast<float>(threshold);  // a token tied with the last kept one is kept too
  std::vector<int64_t> ids;
  std::vector<double> weights;
  for (int64_t i = 0; i < m; ++i) {
    if (c.values[i] >= cut && c.values[i] > -std::numeric_limits<float>::infinity()) {
      ids.push_back(c.ids[i]);
      weights.push_back(std::exp(static_cast<double>(c.values[i]) - c.top));
    }
  }
  double sum = 0.0;
  for (double w : weights) sum += w;
  auto ids_out = torch::empty({static_cast<int64_t>(ids.size())}, torch::kInt64);
  auto probs_out = torch::empty({static_cast<int64_t>(ids.size())}, torch::kFloat64);
  std::copy(ids.begin(), ids.end(), ids_out.data_ptr<int64_t>());
  double* p = probs_out.data_ptr<double>();
  for (size_t i = 0; i < weights.size(); ++i) p[i] = weights[i] / sum;
  return {ids_out, probs_out};
}
