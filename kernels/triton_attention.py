"""Triton paged attention (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

Same contract and layout as kernels/attention.py, whose `paged_attention` dispatches here for
CUDA tensors; the reference is `kernels.attention.paged_attention_ref`. Per-sequence metadata
(seq_lens, cu_q_lens) is passed as int32 device tensors. Quantized caches (int8 / float8) are
read directly: the per-token k_scale multiplies the scores, v_scale the softmax weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import paged_attention_ref  # noqa: F401  (the reference, re-exported)
from kernels.triton_kv_store import check_fp8_support
from quant.kv import SCALE_DTYPE

TILE_N = 64  # keys per inner step (>= 16: tl.dot's GPU minimum)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16 (unused unless IS_QUANTIZED)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16
    block_tables_ptr,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch] int32
    cu_q_lens_ptr,  # [batch + 1] int32
    scale,  # softmax scale
    num_kv_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, IS_QUANTIZED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # tl.dot operand dtype: the query's, or fp32 (see launcher)
):
    # Program (b, t, kh): query tokens [t * BLOCK_Q, (t + 1) * BLOCK_Q) of sequence b, all GROUP
    # heads sharing kv head kh. Row r of the tile is (token r // GROUP, head kh*GROUP + r % GROUP);
    # folding the group into the rows keeps tl.dot at >= 16 rows even for one decode token.
    BLOCK_Q = BLOCK_M // GROUP
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    kh = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    q_start = tl.load(cu_q_lens_ptr + b)
    q_len = tl.load(cu_q_lens_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] token within the sequence
    heads = kh * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + q_idx)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = tl.load(query_ptr + q_offs + dims[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    q = q.to(DOT_DTYPE)
    q_pos = seq_len - q_len + q_idx  # [BLOCK_M] absolute position of each row's token
    # Keys this tile can see: [0, kv_end). Every row sees key 0, so no row is all -inf.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [TILE_N]
        pos_ok = pos < kv_end
        block_ids = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        block_ids = block_ids.to(tl.int64)
        offs = pos % BLOCK_SIZE
        k_offs = block_ids * stride_kb + offs * stride_ks + kh * stride_kh  # [TILE_N]
        v_offs = block_ids * stride_vb + offs * stride_vs + kh * stride_vh
        k = tl.load(k_cache_ptr + k_offs[None, :] + dims[:, None], mask=pos_ok[None, :], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE))  # [BLOCK_M, TILE_N] fp32
        if IS_QUANTIZED:
            scale_offs = (block_ids * BLOCK_SIZE + offs) * num_kv_heads + kh
            k_scales = tl.load(k_scale_ptr + scale_offs, mask=pos_ok, other=0.0).to(tl.float32)
            s = s * k_scales[None, :]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IS_QUANTIZED:
            v_scales = tl.load(v_scale_ptr + scale_offs, mask=pos_ok, other=0.0).to(tl.float32)
            p = p * v_scales[None, :]  # fold v_scale into the weights, after the row sum
        v = tl.load(v_cache_ptr + v_offs[:, None] + dims[None, :], mask=pos_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
        m_i = m_new
    out = acc / l_i[:, None]
    o_offs = (q_start + q_idx)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens,  # [batch] list[int] or int32 tensor on the query's device
    cu_q_lens,  # [batch + 1] list[int] or int32 tensor
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] SCALE_DTYPE
    v_scale: torch.Tensor | None = None,
    max_q_len: int | None = None,  # required when cu_q_lens is a tensor (no device sync)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Grid (batch, query tiles, kv heads). Lists are copied to the device on every call;
    the runner can pass int32 device tensors once per step instead, with max_q_len."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0 and head_dim in (64, 128), (num_heads, num_kv_heads, head_dim)
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), query.dtype
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    is_quantized = k_cache.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
    assert is_quantized or k_cache.dtype == query.dtype, (k_cache.dtype, query.dtype)
    if is_quantized:
        assert k_scale is not None and v_scale is not None, "quantized cache needs k_scale, v_scale"
        for s in (k_scale, v_scale):
            assert s.shape == (num_blocks, block_size, num_kv_heads) and s.is_contiguous()
            assert s.dtype == SCALE_DTYPE
    check_fp8_support(k_cache)
    if max_q_len is None:
        assert isinstance(cu_q_lens, list), "pass max_q_len with device cu_q_lens"
        max_q_len = max(cu_q_lens[i + 1] - cu_q_lens[i] for i in range(len(cu_q_lens) - 1))
    group = num_heads // num_kv_heads
    block_m = max(16 if max_q_len * group <= 16 else 64, triton.next_power_of_2(group))
    batch = block_tables.shape[0]
    grid = (batch, triton.cdiv(max_q_len, block_m // group), num_kv_heads)
    out = torch.empty_like(query)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache,
        k_scale if is_quantized else k_cache, v_scale if is_quantized else v_cache,
        block_tables, as_device_int32(seq_lens, query.device), as_device_int32(cu_q_lens, query.device),
        scale, num_kv_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, TILE_N=TILE_N,
        IS_QUANTIZED=is_quantized, DOT_DTYPE=_dot_dtype(query),
    )
    return out


def _dot_dtype(query: torch.Tensor):
    """The query's dtype, except bf16 off-GPU: the interpreter's bf16 tl.dot returns garbage,
    so there both operands go in as fp32 (exact for bf16 values)."""
    if query.dtype == torch.bfloat16 and not query.is_cuda:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[query.dtype]


def as_device_int32(values, device: torch.device) -> torch.Tensor:
    """Per-sequence metadata as an int32 tensor on `device` (a list is copied once)."""
    if isinstance(values, torch.Tensor):
        assert values.dtype == torch.int32 and values.device == device, (values.dtype, values.device)
        return values
    return torch.tensor(values, dtype=torch.int32, device=device)
