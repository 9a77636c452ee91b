"""Quantized-weight matmuls on the CPU: small C++ kernels (AVX2), built on first use, plus references.

int4 (quant/int4.py) and int8 (quant/int8.py) weights against activations quantized to int8 per
row and group of 32; both read their weight once per call and compute each output row the same
way whatever the row count.

int4:

Layout (quant/int4.py): codes [N, K/2] uint8, two 4-bit codes per byte, groups 2p and 2p + 1 of
a row in bytes [32p, 32p + 32) with byte j = code(64p + j) | code(64p + 32 + j) << 4; params
[N, 2, K/32] float16 = d then m of each group of 32, so w = d * code + m (GGUF's Q4_1 block).

The kernel quantizes each activation row to int8 per group of 32 (x ~= xd * xq, as llama.cpp's
Q8_1) and takes integer dot products (`vpmaddubsw`), reading half a byte per weight:
    y[r, n] = sum_g d[n, g] * xd[r, g] * (code[n, g] . xq[r, g]) + m[n, g] * xd[r, g] * sum(xq[r, g])
Each output is computed the same way whatever the number of rows (no row depends on another),
so a verification row equals the decode row for the same position bit for bit.

torch's own `_weight_int4pack_mm_for_cpu` was measured first (benchmarks/int4_kernels.py): on an
AVX2-only Zen 3 it needs bf16 activations (fp32: ~20x slower) and runs ~3x slower than this kernel
at one row; it has no AVX2 fast path. Built with torch.utils.cpp_extension (needs a C++ compiler and
ninja); `is_available()` is False where it cannot be built or the CPU lacks AVX2/FMA/F16C, and
quant/int4.py then dequantizes per call (correct, slow).
"""

from __future__ import annotations

import torch

from kernels import cpu_ext

GROUP_SIZE = 32


def _extension():
    return cpu_ext.extension()


def is_available() -> bool:
    return _extension() is not None


def parallel_threads() -> int:
    """How many threads the kernels' at::parallel_for runs on (torch.get_num_threads() when the
    build has OpenMP; 1 when it silently dropped the pragma, as the first build did)."""
    ext = _extension()
    assert ext is not None, "parallel_threads: the CPU kernel is not available"
    return ext.parallel_threads(64 * torch.get_num_threads())


def int4_matmul(x: torch.Tensor,  # [M, K] float32
                codes: torch.Tensor,  # [N, K/2] uint8
                params: torch.Tensor,  # [N, 2, K/32] float16
                ) -> torch.Tensor:  # [M, N] float32
    """x @ W.T through the C++ kernel (activations quantized per row, see the module docstring)."""
    ext = _extension()
    assert ext is not None, "int4_matmul: the CPU kernel is not available (check is_available())"
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] % GROUP_SIZE == 0, (x.shape, x.dtype)
    assert codes.dtype == torch.uint8 and codes.shape[1] * 2 == x.shape[1], (codes.shape, x.shape)
    assert x.shape[1] % (2 * GROUP_SIZE) == 0, f"in_features {x.shape[1]} must be a multiple of 64"
    assert params.dtype == torch.float16 and params.shape == (codes.shape[0], 2, x.shape[1] // GROUP_SIZE)
    xq, xd, xs = ext.quantize_rows(x.contiguous())
    return ext.q4_matmul(xq, xd, xs, codes, params)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4_matmul (+ bias, float32 [N]) in one C++ call that allocates only its output: the
    int4 layer's decode path (SmolLM2's 120 layers a step, where the separate calls showed)."""
    return _extension().int4_linear(x.contiguous(), codes, params, bias)


def int4x8_linear(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4_linear for a weight interleaved by 8 output features (quant/int4.interleave: codes
    [N/8, K/32, 128], params [N/8, K/32, 16]), for any number of rows."""
    return _extension().int4x8_linear(x.contiguous(), codes, params, bias)


def vnni_enabled() -> bool:
    """Whether the matmuls take their AVX-512 VNNI tiles (kernels/cpu_simd.h)."""
    ext = _extension()
    return ext is not None and ext.vnni_enabled()


def int8_matmul(x: torch.Tensor,  # [M, K] float32, K % 32 == 0
                qweight: torch.Tensor,  # [N, K] int8, |q| <= 127
                scales: torch.Tensor,  # [N] float32
                ) -> torch.Tensor:  # [M, N] float32
    """x @ (qweight * scales[:, None]).T through the C++ kernel: activations quantized as for
    int4 (per row and group of 32), signed integer dots, one float multiply-add per group."""
    ext = _extension()
    assert ext is not None, "int8_matmul: the CPU kernel is not available (check is_available())"
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] % GROUP_SIZE == 0, (x.shape, x.dtype)
    assert qweight.dtype == torch.int8 and qweight.shape[1] == x.shape[1], (qweight.shape, x.shape)
    assert scales.dtype == torch.float32 and scales.shape == (qweight.shape[0],)
    xq, xd, _ = ext.quantize_rows(x.contiguous())
    return ext.q8_matmul(xq, xd, qweight, scales)


def int8_rows(qweight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, packed: bool) -> torch.Tensor:
    """qweight's rows ids ([T] int64) times their scales, [T, K] float32, in one C++ call; qweight
    row-major or (packed) as pack_int8 leaves it. Ids outside [0, N) raise IndexError."""
    return _extension().int8_rows(qweight, scales, ids, packed)


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 row-major -> the same bytes interleaved by 8 output features (N % 8 == 0,
    K % 4 == 0), as int8x8_matmul reads them: features 8g..8g+8, step t, feature i, k = 4t + j."""
    n, k = qweight.shape
    return qweight.view(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(n, k)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's inverse: the row-major [N, K] int8 weight (a copy)."""
    n, k = packed.shape
    return packed.view(n // 8, k // 4, 8, 4).permute(0, 2, 1, 3).reshape(n, k)


def int8x8_matmul(x: torch.Tensor,  # [M, K] float32, K % 32 == 0
                  packed: torch.Tensor,  # [N, K] int8 from pack_int8, N % 8 == 0
                  scales: torch.Tensor,  # [N] float32
                  ) -> torch.Tensor:  # [M, N] float32
    """int8_matmul for a weight in pack_int8's layout: the same activations and integer dots, the
    8 features of a step at once (~1.4x fewer vector ops per row)."""
    ext = _extension()
    assert ext is not None, "int8x8_matmul: the CPU kernel is not available (check is_available())"
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] % GROUP_SIZE == 0, (x.shape, x.dtype)
    assert packed.dtype == torch.int8 and packed.shape[1] == x.shape[1] and packed.shape[0] % 8 == 0, packed.shape
    assert scales.dtype == torch.float32 and scales.shape == (packed.shape[0],)
    xq, xd, _ = ext.quantize_rows(x.contiguous())
    return ext.q8x8_matmul(xq, xd, packed, scales)


def f32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in float32 (K % 8 == 0), each row computed the same way whatever
    M is (MKL's GEMM/GEMV do not promise that). For few rows: it reads W once per call."""
    ext = _extension()
    assert ext is not None, "f32_matmul: the CPU kernel is not available (check is_available())"
    return ext.f32_matmul(x.contiguous(), weight.contiguous())


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_matmul's maths in plain torch (float64 sums); differs only by summation order."""
    xq, xd, _ = quantize_rows_ref(x)
    m, k = xq.shape
    n = qweight.shape[0]
    dots = torch.einsum("mgj,ngj->mng", xq.double().view(m, k // GROUP_SIZE, GROUP_SIZE),
                        qweight.double().view(n, k // GROUP_SIZE, GROUP_SIZE))  # [M, N, G]
    return ((dots * xd.double()[:, None, :]).sum(-1) * scales.double()[None, :]).float()


def int4_dequantize(codes: torch.Tensor, params: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [N, K] float32 a layer stands for, through the C++ kernel (into `out` if given;
    quant.int4.dequantize_int4 is the reference)."""
    ext = _extension()
    assert ext is not None, "int4_dequantize: the CPU kernel is not available (check is_available())"
    if out is None:
        out = torch.empty(codes.shape[0], codes.shape[1] * 2)
    return ext.q4_dequantize(codes, params, out)


def int4_dense_matmul(x: torch.Tensor,  # [M, K] float32
                      codes: torch.Tensor, params: torch.Tensor,
                      chunk_rows: int = 256) -> torch.Tensor:  # [M, N] float32
    """x @ W.T for long chunks: W is dequantized chunk_rows output rows at a time into one reused
    buffer (a whole fresh fp32 weight per call spent most of its time in page faults), each
    chunk multiplied by a dense fp32 GEMM. No activation quantization on this path."""
    n, k = codes.shape[0], codes.shape[1] * 2
    out_t = torch.empty(n, x.shape[0])  # y.T: each chunk's product lands in contiguous rows
    scratch = torch.empty(min(chunk_rows, n), k)
    x_t = x.t()
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        w = int4_dequantize(codes[start:end], params[start:end], scratch[: end - start])
        torch.mm(w, x_t, out=out_t[start:end])  # (writing y[:, start:end] copied every chunk: 18% of a prefill)
    return out_t.t().contiguous()


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K] int8, xd [M, K/32], xs [M, K/32]) as the kernel computes them:
    xd = max|x| / 127 per group, xq = round-half-even(x * 127 / max|x|), xs = xd * sum(xq)."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=2)  # [M, K/32]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv[..., None]).to(torch.int8)
    xd = amax / 127.0
    return xq.view(m, k), xd, xd * xq.sum(dim=2, dtype=torch.int32).float()


def int4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The kernel's maths in plain torch (float64 sums): the same activation quantization, the
    same per-group formula. Differs from the kernel only by float32 summation order."""
    from quant.int4 import unpack_codes

    xq, xd, xs = quantize_rows_ref(x)
    m, k = xq.shape
    n, num_groups = params.shape[0], params.shape[2]
    w = unpack_codes(codes).double().view(n, num_groups, GROUP_SIZE)  # [N, G, 32]
    dots = torch.einsum("mgj,ngj->mng", xq.double().view(m, num_groups, GROUP_SIZE), w)  # [M, N, G]
    d, mins = params[:, 0].double(), params[:, 1].double()  # [N, G]
    y = (dots * d[None] * xd.double()[:, None, :]).sum(-1) + (mins[None] * xs.double()[:, None, :]).sum(-1)
    return y.float()


SUPER = 256  # a Q4_K superblock: 8 sub-blocks of 32


def q4k_matmul(x: torch.Tensor,  # [M, K] float32, K % 256 == 0
               codes: torch.Tensor,  # [N/8, K/256, 1024] uint8
               subs: torch.Tensor,  # [N/8, K/256, 128] uint8: scales, mins
               dd: torch.Tensor,  # [N/8, K/256, 16] float32: d, dmin
               ) -> torch.Tensor:  # [M, N] float32
    """x @ W.T for a Q4_K weight interleaved by 8 output features (quant/q4k.interleave) through
    the C++ kernel: activations quantized per row and superblock of 256 (llama.cpp's Q8_K),
    integer sums across each superblock."""
    ext = _extension()
    assert ext is not None, "q4k_matmul: the CPU kernel is not available (check is_available())"
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] % SUPER == 0, (x.shape, x.dtype)
    assert codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[1] * 256 == x.shape[1], (codes.shape, x.shape)
    xq, xd, bsums = ext.quantize_rows_k(x.contiguous())
    return ext.q4k_matmul(xq, xd, bsums, codes, subs, dd)


def q4k_linear(x: torch.Tensor, codes: torch.Tensor, subs: torch.Tensor, dd: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """q4k_matmul (+ bias) in one C++ call that allocates only its output: the layer's fast path
    (~110 calls per decode step, where the separate calls' allocations and Python showed)."""
    return _extension().q4k_linear(x.contiguous(), codes, subs, dd, bias)


def quantize_rows_k_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K] int8, xd [M, K/256], bsums [M, K/32] int16) as the kernel
    computes them: xd = max|x| / 127 per superblock, xq = round-half-even(x * (127 / max|x|))."""
    m, k = x.shape
    blocks = x.float().view(m, k // SUPER, SUPER)
    amax = blocks.abs().amax(dim=2)  # [M, K/256]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).to(torch.int8).view(m, k)
    bsums = xq.view(m, k // GROUP_SIZE, GROUP_SIZE).sum(dim=2, dtype=torch.int32).to(torch.int16)
    return xq, amax / 127.0, bsums


def q4k_matmul_ref(x: torch.Tensor, codes: torch.Tensor, subs: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """The kernel's maths in plain torch (float64 sums) on the plain layout (quant/q4k.py): the
    same activation quantization and formula; differs from the kernel only by float32 summation
    order."""
    from quant.int4 import unpack_codes

    xq, xd, _ = quantize_rows_k_ref(x)
    m, k = xq.shape
    n, s = codes.shape[0], k // SUPER
    w = unpack_codes(codes).double().view(n, s, 8, GROUP_SIZE)  # [N, S, 8, 32]
    sc, mn = subs[..., :8].double(), subs[..., 8:].double()  # [N, S, 8]
    w = w * sc[..., None] * dd[..., 0, None, None].double() - (mn * dd[..., 1, None].double())[..., None]
    return ((xq.double() * xd.double().repeat_interleave(SUPER, dim=1)) @ w.view(n, k).t()).float()
