// Python bindings of the C++ CPU kernels (kernels/cpu_ext.py builds this with the *_cpu.cpp files).
#include "cpu_kernels.h"

// Every kernel but parallel_threads runs with the GIL released: a prefill chunk's matmul holds a core for
// tens of milliseconds, and the server's event loop (deltas to other users, /health) must not wait on it.
// The arguments are converted before the release and the result after it; the kernels touch no Python object.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_stack(m);
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses here");
  m.def("vnni_enabled", &chatserve::vnni_enabled, "whether the matmuls take their AVX-512 VNNI tiles");
  m.def("set_vnni", &chatserve::set_vnni, "turn the VNNI tiles on (where the CPU has them) or off; returns the old state");
  m.def("amx_enabled", &chatserve::amx_enabled, "whether the attention over a bfloat16 cache takes its AMX path");
  m.def("set_amx", &chatserve::set_amx, "turn the AMX attention on (where the CPU has it) or off; returns the old state");
  m.def("amx_int8_enabled", &chatserve::amx_int8_enabled, "whether the Q4_K matmul takes its AMX-INT8 path for many rows");
  m.def("set_amx_int8", &chatserve::set_amx_int8, "turn the AMX-INT8 Q4_K matmul on (where the CPU has it) or off; returns the old state");
  m.def("quantize_rows", &quantize_rows, "per-row, per-32 int8 quantization of activations", NoGil());
  m.def("q4_dequantize", &q4_dequantize, "int4 (groups of 32) weight -> float32", NoGil());
  m.def("q4_matmul", &q4_matmul, "int4 (groups of 32) weight x int8 activation matmul", NoGil());
  m.def("int4_linear", &int4_linear, "int4 linear layer (groups of 32): quantize, multiply, add the bias, in one call",
        py::arg("x"), py::arg("codes"), py::arg("params"), py::arg("bias") = py::none(), NoGil());
  m.def("int4x8_linear", &int4x8_linear, "int4_linear for a weight interleaved by 8 output features, any rows",
        py::arg("x"), py::arg("codes"), py::arg("params"), py::arg("bias") = py::none(), NoGil());
  m.def("f32_matmul", &f32_matmul, "float32 matmul for few rows, each row independent of the row count", NoGil());
  m.def("quantize_rows_k", &quantize_rows_k, "per-row, per-256 int8 quantization of activations (Q8_K)", NoGil());
  m.def("q4k_matmul", &q4k_matmul, "Q4_K weight x Q8_K activation matmul", NoGil());
  m.def("q4k_linear", &q4k_linear, "Q4_K linear layer: quantize, multiply, add the bias, in one call",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("subs"), pybind11::arg("dd"),
        pybind11::arg("bias") = pybind11::none(), NoGil());
  m.def("q8_matmul", &q8_matmul, "int8 (per output row) weight x int8 activation matmul", NoGil());
  m.def("q8x8_matmul", &q8x8_matmul, "q8_matmul for a weight interleaved by 8 output features", NoGil());
  m.def("int8_rows", &int8_rows,
        "an int8 table's rows times their scales (an embedding lookup), row-major or interleaved by 8", NoGil());
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows (optionally adding a residual in place first)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none(),
        NoGil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", NoGil());
  m.def("rope_", &rope_, "rotate-half RoPE in place", NoGil());
  m.def("store_kv", &store_kv, "write K/V rows into float32 / float16 / bfloat16 paged caches", NoGil());
  m.def("attention_on_tiles", &attention_on_tiles, "whether paged_attention_rows over this cache runs on the AMX tiles",
        pybind11::arg("k_cache"), pybind11::arg("head_dim"));
  m.def("paged_attention_rows", &paged_attention_rows, "one-query-row paged attention over a float32 / float16 / bfloat16 cache", NoGil());
  m.def("row_kept", &row_kept,
        "what top-k, top-p and min-p keep of one row of logits at a temperature, and their probabilities", NoGil());
  m.def("row_softmax", &row_softmax, "one row's largest logit / temperature and its softmax's normalizer", NoGil());
  m.def("row_draw", &row_draw,
        "a token by inverse CDF from one row's softmax, or from its residual after another distribution", NoGil());
  m.def("suffix_draft", &suffix_draft,
        "suffix decoding's draft from the longest earlier match of a context's suffix in a token array", NoGil());
}
