"""Split-KV decode attention over per-row K/V lengths (flash-decoding), in Triton.

Why: a decode step over slots of mixed lengths needs each row to attend only its own prefix.
Through SDPA that takes an explicit mask, and torch's masked kernels (cuDNN, memory-efficient,
varlen flash with ``seqused_k``) do not split one row's K/V over several SMs: at batch 1 a layer's
attention ran 48 µs against 7 µs for the unmasked (split) kernel, and at batch 128 the step was
1.32x the static-cache reference (``benchmarks/decode_kernels.py``, ``docs/benchmarks.md``). Here
each (row, KV head, split) program walks its part of the row's K/V up to the row's own length and
skips the rest, all query heads of a KV head (grouped-query attention) as rows of one tile, so K
and V are read once; a second kernel merges the splits by their log-sum-exp. The number of splits
is chosen per (batch, K/V length) so the grid fills the device even at batch 1, and is fixed for a
shape, so the launch can be captured in a CUDA graph.

Only the decode step uses it (one query token per row); it needs Triton, which ships with the CUDA
builds of torch. ``TRITON_INTERPRET=1`` runs the same kernels on the CPU (the tests do that).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import triton
import triton.language as tl

BLOCK_N = 64
"""K/V positions per tile of the inner loop."""

WAVES = 4
"""Splits are chosen so that the grid holds about this many programs per SM."""


@triton.jit
def _decode_attn_split_kernel(Q, K, V, Lens, Acc, Mx, Sm,
                  sq_b, sq_h, sq_g, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                  sa_b, sa_h, sa_s, sa_g, sm_b, sm_h, sm_s,
                  scale, chunk,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                              PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(Lens + b).to(tl.int32)
    start = s * chunk
    end = tl.minimum(start + chunk, length)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for off in range(start, end, BLOCK):
        n = off + tl.arange(0, BLOCK)
        valid = n < end
        k = tl.load(K + b * sk_b + h * sk_h + n[:, None] * sk_t + d[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)  # the first tile: exp(-inf) = 0, the empty running sum vanishes
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + h * sv_h + n[:, None] * sv_t + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    # an empty split (it starts past the row's length) leaves max -inf, sum 0, acc 0: the merge drops it
    tl.store(Acc + b * sa_b + h * sa_h + s * sa_s + g[:, None] * sa_g + d[None, :], acc)
    tl.store(Mx + b * sm_b + h * sm_h + s * sm_s + g, m_i)
    tl.store(Sm + b * sm_b + h * sm_h + s * sm_s + g, l_i)


@triton.jit
def _decode_attn_merge_kernel(Acc, Mx, Sm, Out,
                  sa_b, sa_h, sa_s, sa_g, sm_b, sm_h, sm_s, so_b, so_h, so_g,
                  splits,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    m_t = tl.full([G_PAD], float("-inf"), tl.float32)
    l_t = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(0, splits):
        m_s = tl.load(Mx + b * sm_b + h * sm_h + s * sm_s + g)
        l_s = tl.load(Sm + b * sm_b + h * sm_h + s * sm_s + g)
        a_s = tl.load(Acc + b * sa_b + h * sa_h + s * sa_s + g[:, None] * sa_g + d[None, :])
        m_new = tl.maximum(m_t, m_s)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both empty so far: keep the factors at 0
        f_t = tl.exp(m_t - safe)
        f_s = tl.exp(m_s - safe)
        l_t = l_t * f_t + l_s * f_s
        acc = acc * f_t[:, None] + a_s * f_s[:, None]
        m_t = m_new
    out = acc / l_t[:, None]
    tl.store(Out + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(Out.dtype.element_ty),
             mask=g[:, None] < G)


@functools.cache
def _sm_count(device: Any) -> int:
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def plan_splits(n: int, kv_heads: int, kv_len: int, sms: int) -> tuple[int, int]:
    """(splits, chunk): each row's K/V split into ``splits`` chunks of ``chunk`` positions (a
    multiple of ``BLOCK_N``), enough that ``n * kv_heads * splits`` programs fill ``sms`` SMs
    about ``WAVES`` times, never a chunk shorter than one tile. Depends on the shape only, so a
    CUDA graph captured for a (batch, K/V length) bucket replays with the same grid."""
    tiles = max(1, math.ceil(kv_len / BLOCK_N))
    want = max(1, math.ceil(WAVES * sms / max(1, n * kv_heads)))
    splits = min(tiles, want)
    chunk = math.ceil(tiles / splits) * BLOCK_N
    return math.ceil(kv_len / chunk), chunk


def split_kv_decode_attention(q: Any, key: Any, value: Any, lengths: Any, scale: float) -> Any:
    """Attention of one query token per row over that row's first ``lengths[row]`` keys.

    ``q``: ``[n, kv_heads, groups, d]`` (the query heads that share a KV head, in ``repeat_kv``'s
    order); ``key``/``value``: ``[n, kv_heads, L, d]``, any strides with a unit last stride (slot
    views need no copy); ``lengths``: ``[n]`` integers in ``1..L``. Returns ``[n, kv_heads, groups,
    d]`` in ``q``'s dtype; float32 accumulation."""
    import torch

    n, kv_heads, groups, d = q.shape
    kv_len = key.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"split-KV decode attention: head dim {d} is not a power of two >= 16")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("split-KV decode attention: the last dimension must be contiguous")
    g_pad = max(16, triton.next_power_of_2(groups))
    splits, chunk = plan_splits(n, kv_heads, kv_len, _sm_count(q.device))
    acc = torch.empty((n, kv_heads, splits, g_pad, d), dtype=torch.float32, device=q.device)
    mx = torch.empty((n, kv_heads, splits, g_pad), dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    out = torch.empty((n, kv_heads, groups, d), dtype=q.dtype, device=q.device)
    _decode_attn_split_kernel[(n, kv_heads, splits)](
        q, key, value, lengths, acc, mx, sm,
        q.stride(0), q.stride(1), q.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), mx.stride(0), mx.stride(1), mx.stride(2),
        scale, chunk, G=groups, G_PAD=g_pad, D=d, BLOCK=BLOCK_N,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays float32 (tests, CPU-exact models)
        num_warps=4, num_stages=2)
    _decode_attn_merge_kernel[(n, kv_heads)](
        acc, mx, sm, out,
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), mx.stride(0), mx.stride(1), mx.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        splits, G=groups, G_PAD=g_pad, D=d, num_warps=4)
    return out
