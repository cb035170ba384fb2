"""CLIP's ``quick_gelu`` activation in one Triton kernel, with the library's rounding.

Why: in LLaVA-NeXT's CLIP tower the library's ``QuickGELUActivation`` (``x * sigmoid(1.702 x)``)
runs as three element-wise kernels over the MLP's widest tensor (crops x 577 x 4096), each
reading and writing it once more. On the H200 they took ~17 % of the tower's GPU time at a
1080p micro-batch of 16 (``gpu_engine`` run 3's profile: ``aten::mul`` + ``aten::sigmoid``,
31 of 180 ms), more than the attention. One kernel reads the tensor once and writes it once.

It keeps the library's arithmetic: each of the three steps is computed in float32 and rounded to
the tensor's dtype, as torch's bf16/fp16 element-wise kernels do, so the output is the library's
up to the last bit of ``exp`` (a tie in the final rounding, rarely). The tower's class, weights
and every other op stay the library's; only the activation module of each MLP is swapped
(``fuse_quick_gelu``), on CUDA when Triton imports.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 2048
SCALE = 1.702  # transformers.activations.QuickGELUActivation


@triton.jit
def _quick_gelu_kernel(X, Y, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x_in = tl.load(X + offs, mask=valid, other=0.0)
    x = x_in.to(tl.float32)
    t = (x * scale).to(x_in.dtype).to(tl.float32)  # torch: 1.702 * x, rounded to the dtype
    s = (1.0 / (1.0 + tl.exp(-t))).to(x_in.dtype).to(tl.float32)  # torch.sigmoid, rounded
    tl.store(Y + offs, (x * s).to(x_in.dtype), mask=valid)  # x * s, rounded


def quick_gelu(x: Any) -> Any:
    """``x * sigmoid(1.702 * x)`` of a tensor on a CUDA device (or under ``TRITON_INTERPRET=1``)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _quick_gelu_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, SCALE, BLOCK=BLOCK, num_warps=8)
    return y


class FusedQuickGELU(torch.nn.Module):
    """A drop-in for ``transformers.activations.QuickGELUActivation`` that runs ``quick_gelu``."""

    def forward(self, x: Any) -> Any:
        return quick_gelu(x)


def fuse_quick_gelu(model: Any, fused: bool = True) -> int:
    """Swap every ``QuickGELUActivation`` module under ``model`` for the one-kernel form (or, with
    ``fused=False``, back: benchmarks compare the two in one run); returns how many were swapped
    (0 where the model has none, e.g. a SigLIP or Qwen tower, or all are swapped already)."""
    from transformers.activations import QuickGELUActivation

    old, new = (QuickGELUActivation, FusedQuickGELU) if fused else (FusedQuickGELU, QuickGELUActivation)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is old:
                setattr(module, name, new())
                swapped += 1
    return swapped
