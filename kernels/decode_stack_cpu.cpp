// The decoder's layers for a step of few rows (decode, verification) in one call from Python.
//
// SmolLM2-135M's batch-1 decode step spent ~7 ms of ~16 in Python around 30 layers of ~12 C++
// calls each (module dispatch, views, argument checks). DecodeStack holds every layer's weights
// and KV caches once and runs the same kernels in the same order as the modules
// (chatserve/models/llama.py, the reference it is tested against bit for bit): RMSNorm with the
// residual, the QKV layer, RoPE in place, the KV store, one-query-row paged attention, the output
// layer, RMSNorm, gate/up, SiLU * up, down. The GIL is released for the whole stack.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "cpu_kernels.h"

namespace {

using LinearArgs = std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>>;

// One weight layer, as the module that holds it computes it for few rows.
struct LinearW {
  enum Kind : int64_t { kInt4 = 0, kQ4K = 1, kF32 = 2, kInt8 = 3, kInt8x8 = 4, kInt4x8 = 5 };
  int64_t kind;
  torch::Tensor a, b, c;  // int4: codes, params; Q4_K: codes, subs, dd; f32: weight; int8: qweight, scales
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kInt4:
        return int4_linear(x, a, b, bias);
      case kInt4x8:
        return int4x8_linear(x, a, b, bias);
      case kQ4K:
        return q4k_linear(x, a, b, c, bias);
      case kF32: {  // models/layers.Linear: the matmul, then the bias added in place
        auto y = f32_matmul(x, a);
        if (bias) y.add_(*bias);
        return y;
      }
      default: {  // quant/int8.Int8Linear through kernels/quant_matmul.int8_matmul (or int8x8_matmul)
        auto xq = quantize_rows(x);
        auto y = kind == kInt8x8 ? q8x8_matmul(xq[0], xq[1], a, b) : q8_matmul(xq[0], xq[1], a, b);
        if (bias) y.add_(*bias);
        return y;
      }
    }
  }
};

struct Layer {
  torch::Tensor ln1, ln2, k_cache, v_cache;
  LinearW qkv, o, gate_up, down;
};

LinearW linear_w(const LinearArgs& args) {
  auto& [kind, a, b, c, bias] = args;
  TORCH_CHECK(kind >= LinearW::kInt4 && kind <= LinearW::kInt4x8, "unknown linear kind");
  return LinearW{kind, a, b, c, bias};
}

// An EAGLE head's pieces around its one layer (chatserve/models/eagle_head.py): fc over
// [feature; embed(token)], the norm, the LM head over the kept ids, the target's embedding.
struct DraftHead {
  LinearW fc, lm_head;
  torch::Tensor norm_w, embed, embed_scales, kept_ids;  // embed: int8 rows with scales, or float32 rows
  double eps;
  bool embed_packed;
  int64_t block_size;

  torch::Tensor embeds(const torch::Tensor& ids) const {
    return embed_scales.numel() ? int8_rows(embed, embed_scales, ids, embed_packed) : embed.index_select(0, ids);
  }
};

torch::Tensor int64s(const std::vector<int64_t>& v) {
  return torch::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, torch::kInt64).clone();
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, torch::Tensor cos,
              torch::Tensor sin)
      : H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale), cos_(cos), sin_(sin) {}

  // linears: (kind, a, b, c, bias) for qkv, o, gate_up, down, in that order.
  void add_layer(torch::Tensor ln1, torch::Tensor ln2, torch::Tensor k_cache, torch::Tensor v_cache,
                 std::vector<LinearArgs> linears) {
    TORCH_CHECK(linears.size() == 4, "add_layer: qkv, o, gate_up, down");
    std::vector<LinearW> w;
    for (const auto& args : linears) w.push_back(linear_w(args));
    layers_.push_back(Layer{ln1, ln2, k_cache, v_cache, w[0], w[1], w[2], w[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The EAGLE head around this (one-layer) stack, for draft_chain. embed_scales empty: float32 rows.
  void set_draft_head(LinearArgs fc, torch::Tensor norm_w, double eps, LinearArgs lm_head, torch::Tensor embed,
                      torch::Tensor embed_scales, bool embed_packed, torch::Tensor kept_ids, int64_t block_size) {
    TORCH_CHECK(norm_w.scalar_type() == torch::kFloat32, "set_draft_head: a float32 norm");
    TORCH_CHECK(kept_ids.scalar_type() == torch::kInt64 && kept_ids.dim() == 1, "set_draft_head: int64 kept ids");
    TORCH_CHECK(embed_scales.numel() ? embed.scalar_type() == torch::kInt8 : embed.scalar_type() == torch::kFloat32,
                "set_draft_head: int8 embedding rows with scales, or float32 rows");
    head_ = DraftHead{linear_w(fc), linear_w(lm_head), norm_w, embed, embed_scales, kept_ids.contiguous(), eps,
                      embed_packed, block_size};
  }

  // A greedy chain of drafts for R requests at once, as EagleMethod.propose drafts one in Python
  // (chatserve/spec_methods/eagle.py, the reference it is tested against, with the same kernels in
  // the same order). The first forward feeds `tokens` [T] at `positions` with `features` [T,
  // hidden] (the batch of build_batch; request r's newest row is last_rows[r]); then each request
  // still drafting feeds its newest draft at the next position with the head's own predicted
  // feature. A draft is the first argmax of the kept logits; the chain's probability (the product
  // of each position's softmax probability of its argmax) below keep_below[r] drops that draft and
  // ends the chain, which goes on while it has fewer than ks[r] drafts and its probability is at
  // least go_on_below[r]. block_counts[r]: the blocks of block_tables' row r that the request owns.
  // Returns drafts [R, max ks] (int64, -1 after counts[r]), counts [R], and each forward's rows
  // and seconds.
  std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> draft_chain(
      torch::Tensor tokens, torch::Tensor features, torch::Tensor positions, torch::Tensor slots,
      torch::Tensor block_tables, std::vector<int64_t> block_counts, torch::Tensor seqs, torch::Tensor contexts,
      std::vector<int64_t> last_rows, std::vector<int64_t> ks, std::vector<double> keep_below,
      std::vector<double> go_on_below) {
    TORCH_CHECK(head_.has_value(), "draft_chain: set_draft_head first");
    const int64_t R = static_cast<int64_t>(last_rows.size());
    TORCH_CHECK(R > 0 && ks.size() == last_rows.size() && keep_below.size() == last_rows.size() &&
                    go_on_below.size() == last_rows.size() && block_counts.size() == last_rows.size(),
                "draft_chain: one last row, k, keep, go-on price and block count per request");
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.size(0) == R,
                "draft_chain: block_tables [R, blocks] int32");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "draft_chain: int64 positions");
    const DraftHead& h = *head_;
    const auto tables = block_tables.contiguous();
    const int32_t* bt = tables.data_ptr<int32_t>();
    const int64_t B = tables.size(1), bs = h.block_size, N = h.kept_ids.size(0);
    const int64_t* kept_ids = h.kept_ids.data_ptr<int64_t>();
    const int64_t k_max = std::max<int64_t>(1, *std::max_element(ks.begin(), ks.end()));
    auto drafts = torch::full({R, k_max}, -1, torch::kInt64);
    int64_t* d = drafts.data_ptr<int64_t>();
    std::vector<int64_t> counts(R, 0), pos(R), active(R), rows = last_rows, ran;
    std::vector<double> chain(R, 1.0), seconds;
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(0 <= last_rows[r] && last_rows[r] < positions.size(0), "draft_chain: a last row out of range");
      pos[r] = positions.data_ptr<int64_t>()[last_rows[r]];
      active[r] = r;
    }
    torch::Tensor toks = tokens, feats = features;
    bool first = true;
    while (!active.empty()) {
      const auto start = std::chrono::steady_clock::now();
      auto x = h.fc(torch::cat({feats, h.embeds(toks)}, -1));
      auto out = run(x, positions, slots, block_tables, seqs, contexts, {}, nullptr);
      if (first) out = out.index_select(0, int64s(rows));
      auto predicted = rms_norm(out, h.norm_w, h.eps, c10::nullopt);
      auto kept = h.lm_head(predicted).contiguous();  // [active, N] float32
      const float* logits = kept.data_ptr<float>();
      std::vector<int64_t> next_active, next_rows, next_toks, next_pos, next_slots, next_seqs, next_ctx;
      for (size_t a = 0; a < active.size(); ++a) {
        const int64_t r = active[a];
        const float* l = logits + a * N;
        int64_t best = 0;
        for (int64_t j = 1; j < N; ++j)
          if (l[j] > l[best]) best = j;
        double total = 0.0;
        for (int64_t j = 0; j < N; ++j) total += std::exp(static_cast<double>(l[j]) - l[best]);
        chain[r] *= 1.0 / total;
        if (chain[r] < keep_below[r]) continue;
        const int64_t token = kept_ids[best];
        d[r * k_max + counts[r]++] = token;
        if (counts[r] < ks[r] && chain[r] >= go_on_below[r]) {
          const int64_t p = ++pos[r];
          TORCH_CHECK(p / bs < std::min(B, block_counts[r]), "draft_chain: a draft position past the request's blocks");
          next_active.push_back(r);
          next_rows.push_back(static_cast<int64_t>(a));
          next_toks.push_back(token);
          next_pos.push_back(p);
          next_slots.push_back(static_cast<int64_t>(bt[r * B + p / bs]) * bs + p % bs);
          next_seqs.push_back(r);
          next_ctx.push_back(p + 1);
        }
      }
      ran.push_back(static_cast<int64_t>(active.size()));
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (next_active.empty()) break;
      feats = predicted.index_select(0, int64s(next_rows));
      toks = int64s(next_toks);
      positions = int64s(next_pos);
      slots = int64s(next_slots);
      seqs = int64s(next_seqs);
      contexts = int64s(next_ctx);
      active = std::move(next_active);
      first = false;
    }
    return {drafts, counts, ran, seconds};
  }

  // x [T, hidden] float32 (the embeddings, updated in place as the modules do) -> the last layer's
  // output [T, hidden]. seqs, contexts [T] int64: each row's sequence (block_tables row) and the
  // number of keys it sees, as kernels/attention_cpu._rows_in_cpp lays them out.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor seqs, torch::Tensor contexts) {
    return run(x, positions, slots, block_tables, seqs, contexts, {}, nullptr);
  }

  // forward(), plus the output of each layer in `capture` (increasing indices; a new tensor each,
  // x + delta as the next layer's norm adds it in place: the same float32 sums).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward_captured(
      torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seqs,
      torch::Tensor contexts, std::vector<int64_t> capture) {
    std::vector<torch::Tensor> captured;
    auto out = run(x, positions, slots, block_tables, seqs, contexts, capture, &captured);
    return {out, captured};
  }

  // forward_captured(), its captured outputs RMS-normalized by `weight` (eps) and then the last
  // layer's output by `final_w` (final_eps), side by side: -> (the last layer's output [T, hidden],
  // features [T, (capture.size() + 1) * hidden]). DecoderLM.forward(norms=)'s norms and concat after
  // its module loop, the same kernels, in this call (in Python they cost ~0.17 ms of a SmolLM2 step
  // on cold caches).
  std::tuple<torch::Tensor, torch::Tensor> forward_features(
      torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seqs,
      torch::Tensor contexts, std::vector<int64_t> capture, torch::Tensor weight, double eps, torch::Tensor final_w,
      double final_eps) {
    std::vector<torch::Tensor> captured;
    auto out = run(x, positions, slots, block_tables, seqs, contexts, capture, &captured);
    const int64_t T = out.size(0), D = out.size(1), n = static_cast<int64_t>(captured.size());
    auto features = torch::empty({T, (n + 1) * D}, out.options());
    for (int64_t i = 0; i < n; ++i) {
      features.narrow(1, i * D, D).copy_(rms_norm(captured[i], weight, eps, c10::nullopt));
    }
    features.narrow(1, n * D, D).copy_(rms_norm(out, final_w, final_eps, c10::nullopt));
    return {out, features};
  }

 private:
  torch::Tensor run(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                    torch::Tensor seqs, torch::Tensor contexts, const std::vector<int64_t>& capture,
                    std::vector<torch::Tensor>* captured) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [T, hidden] float32");
    const int64_t T = x.size(0);
    c10::optional<torch::Tensor> delta;
    size_t next = 0;  // the next index of capture
    for (int64_t i = 0; i < static_cast<int64_t>(layers_.size()); ++i) {
      const Layer& l = layers_[i];
      auto h = rms_norm(x, l.ln1, eps_, delta);
      auto qkv = l.qkv(h).view({T, H_ + 2 * Hkv_, D_});
      rope_(qkv, H_ + Hkv_, positions, cos_, sin_);
      auto k = qkv.narrow(1, H_, Hkv_), v = qkv.narrow(1, H_ + Hkv_, Hkv_);
      store_kv(k, v, l.k_cache, l.v_cache, slots);
      auto q = qkv.narrow(1, 0, H_).contiguous();
      auto attn = torch::empty_like(q);
      paged_attention_rows(attn, q, l.k_cache, l.v_cache, block_tables, seqs, contexts, scale_);
      auto o = l.o(attn.view({T, H_ * D_}));
      auto h2 = rms_norm(x, l.ln2, eps_, o);
      delta = l.down(silu_mul(l.gate_up(h2)));
      if (captured && next < capture.size() && capture[next] == i) {
        captured->push_back(x + *delta);
        ++next;
      }
    }
    TORCH_CHECK(!captured || next == capture.size(), "forward_captured: capture indices increasing, below num_layers");
    return delta ? x + *delta : x;
  }

  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  torch::Tensor cos_, sin_;
  std::vector<Layer> layers_;
  c10::optional<DraftHead> head_;
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_captured", &DecodeStack::forward_captured, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_features", &DecodeStack::forward_features, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_draft_head", &DecodeStack::set_draft_head)
      .def("draft_chain", &DecodeStack::draft_chain, pybind11::call_guard<pybind11::gil_scoped_release>());
}
