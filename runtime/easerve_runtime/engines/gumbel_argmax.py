"""Gumbel-max sampling in one Triton kernel: ``argmax(scaled + g)`` with the counter-based noise of
``hf.gumbel_noise`` made in registers, never in memory.

Why: the torch form builds the noise for every row and vocabulary entry out of ~15 int64/float64
element-wise kernels, then adds and reduces; on the H200 a served decode step spent 2.0–2.7 ms
of GPU time sampling a handful of rows (``decode_loop.sample_gpu_ms`` in ``gpu_serve`` runs 8),
most of it launch gaps, against 11 ms for the model's forward. One program per row here hashes
(key, token id) with SplitMix64, turns it into the same float64 Gumbel draw and keeps a running
argmax, so the result is the torch form's token (same hash, same float64 arithmetic; ties go to
the lowest token id, as ``torch.argmax``), in one launch.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

BLOCK = 1024

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


@triton.jit
def _gumbel_argmax_kernel(Scaled, Keys, Out, stride_row, vocab, golden, mix1, mix2, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    key = tl.load(Keys + r).to(tl.uint64, bitcast=True)
    best_v = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = tl.zeros([BLOCK], tl.int64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        valid = ids < vocab
        x = key + (ids + 1).to(tl.uint64) * golden
        x = x ^ (x >> 30)
        x = x * mix1
        x = x ^ (x >> 27)
        x = x * mix2
        x = x ^ (x >> 31)
        u = ((x >> 11).to(tl.float64) + 0.5) / 9007199254740992.0  # 2**53: u in (0, 1)
        g = -tl.log(-tl.log(u))
        s = tl.load(Scaled + r * stride_row + ids, mask=valid, other=float("-inf")).to(tl.float64)
        v = tl.where(valid, s + g, float("-inf"))
        better = v > best_v  # strict: a lane keeps its first (lowest) id among equals
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, ids.to(tl.int64), best_i)
    top = tl.max(best_v, 0)
    tl.store(Out + r, tl.min(tl.where(best_v == top, best_i, vocab), 0))


def gumbel_argmax(scaled: Any, keys: Any) -> Any:
    """Per row of ``scaled [rows, vocab]`` (float32, temperature applied, top-p's dropped tokens at
    -inf), the token ``argmax(scaled + gumbel)`` whose noise is ``hf.gumbel_noise``'s for the row's
    ``keys [rows]`` (int64, ``hf.gumbel_keys``). Returns ``[rows]`` int64 on the same device."""
    import torch

    rows, vocab = scaled.shape
    if scaled.stride(-1) != 1:
        scaled = scaled.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](scaled, keys, out, scaled.stride(0), vocab, GOLDEN, MIX1, MIX2,
                                       BLOCK=BLOCK, num_warps=8)
    return out
