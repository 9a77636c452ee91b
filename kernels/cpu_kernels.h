// The C++ CPU kernels' entry points, defined in kernels/*_cpu.cpp: declared once here for the
// Python bindings (cpu_ext_bindings.cpp) and for kernels that call others (decode_stack_cpu.cpp).
#pragma once
#include <torch/extension.h>
#include <tuple>
#include <vector>

std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
torch::Tensor q4_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor xs, torch::Tensor codes, torch::Tensor params);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor params, c10::optional<torch::Tensor> bias);
torch::Tensor int4x8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor params,
                            c10::optional<torch::Tensor> bias);
torch::Tensor q8_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor qweight, torch::Tensor scales);
torch::Tensor q8x8_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor packed, torch::Tensor scales);
torch::Tensor int8_rows(torch::Tensor qweight, torch::Tensor scales, torch::Tensor ids, bool packed);
torch::Tensor q4_dequantize(torch::Tensor codes, torch::Tensor params, torch::Tensor w);
int64_t parallel_threads(int64_t items);
std::vector<torch::Tensor> quantize_rows_k(torch::Tensor x);
torch::Tensor q4k_matmul(torch::Tensor xq, torch::Tensor xd, torch::Tensor bsums, torch::Tensor codes,
                         torch::Tensor subs, torch::Tensor dd);
torch::Tensor q4k_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor subs, torch::Tensor dd,
                         c10::optional<torch::Tensor> bias);
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, int64_t heads, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
void paged_attention_rows(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor block_tables, torch::Tensor seq, torch::Tensor ctx, double scale);
bool attention_on_tiles(torch::Tensor k_cache, int64_t head_dim);
std::tuple<double, double> row_softmax(torch::Tensor logits, double temperature);
std::tuple<torch::Tensor, torch::Tensor> row_kept(torch::Tensor logits, double temperature, int64_t top_k,
                                                  double top_p, double min_p_offset, double margin,
                                                  int64_t nucleus_guess);
int64_t row_draw(torch::Tensor logits, double temperature, double top, double total, double uniform,
                 c10::optional<torch::Tensor> minus, int64_t minus_token);
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t> suffix_draft(
    torch::Tensor haystack, torch::Tensor ctx, bool is_self, int64_t max_tokens, int64_t max_depth,
    double max_spec_factor, double min_prob, int64_t max_candidates);

void bind_decode_stack(pybind11::module& m);

namespace chatserve {
bool vnni_enabled();
bool set_vnni(bool on);
bool amx_enabled();
bool set_amx(bool on);
bool amx_int8_enabled();
bool set_amx_int8(bool on);
}  // namespace chatserve
