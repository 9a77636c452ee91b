// The decoder's layers for a step of few rows (decode, verification) in one call from Python.
//
// SmolLM2-135M's batch-1 decode step spent ~7 ms of ~16 in Python around 30 layers of ~12 C++
// calls each (module dispatch, views, argument checks). DecodeStack holds every layer's weights
// and KV caches once and runs the same kernels in the same order as the modules
// (chatserve/models/llama.py, the reference it is tested against bit for bit): RMSNorm with the
// residual, the QKV layer, RoPE in place, the KV store, one-query-row paged attention, the output
// layer, RMSNorm, gate/up, SiLU * up, down. The GIL is released for the whole stack.
#include "cpu_kernels.h"

namespace {

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

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, torch::Tensor cos,
              torch::Tensor sin)
      : H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale), cos_(cos), sin_(sin) {}

  // linears: (kind, a, b, c, bias) for qkv, o, gate_up, down, in that order.
  void add_layer(torch::Tensor ln1, torch::Tensor ln2, torch::Tensor k_cache, torch::Tensor v_cache,
                 std::vector<std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
                                        c10::optional<torch::Tensor>>> linears) {
    TORCH_CHECK(linears.size() == 4, "add_layer: qkv, o, gate_up, down");
    std::vector<LinearW> w;
    for (auto& [kind, a, b, c, bias] : linears) {
      TORCH_CHECK(kind >= LinearW::kInt4 && kind <= LinearW::kInt4x8, "add_layer: unknown linear kind");
      w.push_back(LinearW{kind, a, b, c, bias});
    }
    layers_.push_back(Layer{ln1, ln2, k_cache, v_cache, w[0], w[1], w[2], w[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

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
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_captured", &DecodeStack::forward_captured, pybind11::call_guard<pybind11::gil_scoped_release>());
}
