// Suffix decoding's draft in one call (spec/suffix.py's SuffixProposer._draft_ref is the reference,
// numpy over token ids: ~30 small numpy calls a query, each paying cold caches right after a forward).
// The same steps over the same int64 arrays: the occurrences of the context's last token (the most
// recent max_candidates), each one's match length to the left (up to max_depth), the longest ones,
// then the walk down their continuations, the most frequent next token at each depth.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kSeparator = -1;  // spec/suffix.py SEPARATOR: no continuation crosses it

const int64_t* ids_data(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous() && !t.is_cuda(), name,
              ": a contiguous int64 CPU vector");
  return t.data_ptr<int64_t>();
}

// The positions e < end with h[e] == value, the last `most` of them, descending (4 at a time: a corpus
// holds up to 65,536 tokens).
void occurrences(const int64_t* h, int64_t end, int64_t value, int64_t most, std::vector<int64_t>& out) {
  const __m256i v = _mm256_set1_epi64x(value);
  int64_t e = end;
  for (; e >= 4 && static_cast<int64_t>(out.size()) < most; e -= 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + e - 4));
    int mask = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(x, v)));  // lane j: h[e - 4 + j]
    while (mask && static_cast<int64_t>(out.size()) < most) {
      const int lane = 31 - __builtin_clz(static_cast<unsigned>(mask));
      out.push_back(e - 4 + lane);
      mask &= ~(1 << lane);
    }
  }
  for (--e; e >= 0 && static_cast<int64_t>(out.size()) < most; --e)
    if (h[e] == value) out.push_back(e);
}

}  // namespace

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t> suffix_draft(
    torch::Tensor haystack, torch::Tensor ctx, bool is_self, int64_t max_tokens, int64_t max_depth,
    double max_spec_factor, double min_prob, int64_t max_candidates) {
  const int64_t* h = ids_data(haystack, "suffix_draft haystack");
  const int64_t* c = ids_data(ctx, "suffix_draft ctx");
  const int64_t len = haystack.numel(), n = ctx.numel();
  std::vector<int64_t> tokens, counts, totals;
  const int64_t search_end = is_self ? n - 1 : len - 1;
  if (n == 0 || search_end <= 0) return {tokens, counts, totals, 0};
  // the occurrences of the last token before search_end, the most recent max_candidates, ascending
  std::vector<int64_t> ends;
  occurrences(h, std::min(search_end, len), c[n - 1], max_candidates, ends);
  std::reverse(ends.begin(), ends.end());
  const int64_t depth = std::min(max_depth, n);
  int64_t longest = 0;
  std::vector<int64_t> lens(ends.size());
  for (size_t i = 0; i < ends.size(); ++i) {
    int64_t j = 0;
    while (j < depth && ends[i] - j >= 0 && h[ends[i] - j] == c[n - 1 - j]) ++j;
    lens[i] = j;
    longest = std::max(longest, j);
  }
  if (longest == 0 || max_tokens <= 0) return {tokens, counts, totals, 0};
  std::vector<int64_t> positions;  // where each longest occurrence continues
  for (size_t i = 0; i < ends.size(); ++i)
    if (lens[i] == longest) positions.push_back(ends[i] + 1);
  const int64_t limit = std::min(max_tokens, static_cast<int64_t>(std::ceil(max_spec_factor * longest)));
  double prob = 1.0;
  std::vector<int64_t> next;
  for (int64_t step = 0; step < limit; ++step) {
    const int64_t total = static_cast<int64_t>(positions.size());  // one at the haystack's end included
    next.clear();
    for (int64_t p : positions)
      if (p < len && h[p] != kSeparator) next.push_back(h[p]);
    if (next.empty()) break;
    // the most frequent next token, the smallest id among ties
    std::sort(next.begin(), next.end());
    int64_t token = next[0], freq = 0;
    for (size_t i = 0; i < next.size();) {
      size_t j = i;
      while (j < next.size() && next[j] == next[i]) ++j;
      if (static_cast<int64_t>(j - i) > freq) token = next[i], freq = static_cast<int64_t>(j - i);
      i = j;
    }
    prob *= static_cast<double>(freq) / static_cast<double>(total);
    if (prob < min_prob) break;
    tokens.push_back(token);
    counts.push_back(freq);
    totals.push_back(total);
    size_t kept = 0;
    for (int64_t p : positions)
      if (p < len && h[p] == token) positions[kept++] = p + 1;
    positions.resize(kept);
  }
  return {tokens, counts, totals, longest};
}
