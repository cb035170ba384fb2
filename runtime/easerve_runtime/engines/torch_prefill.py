"""A Llama-like prefill workload for the local prefill worker, in plain torch, graphed per layer.

Why plain torch and not a transformers model: the co-located prefill must yield at *layer*
boundaries so it can follow the partition (a new split is read before every layer, i.e. every
~1.7 ms for 2048 tokens on an H200, instead of once per 14 ms forward). One CUDA graph per
(layer, stream) makes each layer a single launch on whichever partition is current.

The shape defaults to a 7B-class layer (hidden 4096, 32 heads / 8 KV heads, FFN 14336) with
8 layers, which is what the H200 co-location measurements used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from easerve_runtime.engines.base import PrefillInput, PrefillOutput


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    layers: int = 8


def _make_layer(shape: LlamaShape, device: str) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        """RMSNorm -> GQA causal attention (SDPA) -> RMSNorm -> SwiGLU, residuals; no RoPE cost hidden."""

        def __init__(self) -> None:
            super().__init__()
            h, d = shape.hidden, shape.hidden // shape.heads
            self.d = d
            self.qkv = nn.Linear(h, (shape.heads + 2 * shape.kv_heads) * d, bias=False)
            self.o = nn.Linear(h, h, bias=False)
            self.up = nn.Linear(h, 2 * shape.ffn, bias=False)
            self.down = nn.Linear(shape.ffn, h, bias=False)
            self.n1 = nn.RMSNorm(h)
            self.n2 = nn.RMSNorm(h)

        def forward(self, x: Any) -> Any:
            b, t, h = x.shape
            q, k, v = self.qkv(self.n1(x)).split(
                [shape.heads * self.d, shape.kv_heads * self.d, shape.kv_heads * self.d], dim=-1
            )
            q = q.view(b, t, shape.heads, self.d).transpose(1, 2)
            k = k.view(b, t, shape.kv_heads, self.d).transpose(1, 2)
            v = v.view(b, t, shape.kv_heads, self.d).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
            g, u = self.up(self.n2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

    return Layer().to(device=device, dtype=torch.bfloat16).eval()


class LlamaPrefill:
    """``layers`` Llama-like layers over ``tokens`` tokens; one graph per (layer, stream)."""

    def __init__(self, tokens: int = 2048, shape: LlamaShape | None = None, device: str = "cuda") -> None:
        import torch

        self.torch = torch
        self.shape = shape or LlamaShape()
        self.tokens = tokens
        self.layers = [_make_layer(self.shape, device) for _ in range(self.shape.layers)]
        self.bufs = [
            torch.randn(1, tokens, self.shape.hidden, device=device, dtype=torch.bfloat16) * 0.1
            for _ in range(self.shape.layers + 1)
        ]
        self._graphs: dict[tuple[int, int], Any] = {}

    @property
    def flops(self) -> float:
        """Forward FLOPs of one prefill (matmuls + causal attention), for throughput reports."""
        s, t = self.shape, self.tokens
        d = s.hidden // s.heads
        per_layer = 2 * t * s.hidden * ((s.heads + 2 * s.kv_heads) * d + s.hidden + 3 * s.ffn)
        per_layer += 2 * s.heads * d * t * t  # QK^T and PV, causal half: 2 * 2 * h * d * t^2 / 2
        return float(per_layer * s.layers)

    def capture(self, stream: Any) -> None:
        torch = self.torch
        for i, layer in enumerate(self.layers):
            key = (i, id(stream))
            if key in self._graphs:
                continue
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):
                    layer(self.bufs[i])
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(g, stream=stream):
                self.bufs[i + 1].copy_(layer(self.bufs[i]))
            self._graphs[key] = g

    def run_layer(self, i: int, stream: Any) -> None:
        self.capture(stream)
        with self.torch.cuda.stream(stream):
            self._graphs[(i, id(stream))].replay()

    def run(self, stream_for_layer: Callable[[int], Any]) -> None:
        """One prefill; ``stream_for_layer(i)`` is asked before each layer (the partition may move)."""
        for i in range(self.shape.layers):
            s = stream_for_layer(i)
            self.run_layer(i, s)


class TorchPrefillEngine:
    """:class:`~easerve_runtime.engines.base.PrefillEngine` for local prefill (timing workload).

    Each request runs one graphed prefill of the configured token count (random weights: the
    first token is a placeholder 0 and ``kv_bytes`` is computed from the shape, not sent).
    """

    def __init__(self, tokens: int = 2048, stream_for_layer: Callable[[int], Any] | None = None) -> None:
        self.model = LlamaPrefill(tokens)
        self.stream = self.model.torch.cuda.Stream()
        self.stream_for_layer = stream_for_layer or (lambda _i: self.stream)

    def _prefill_sync(self, batch: Sequence[PrefillInput]) -> list[PrefillOutput]:
        s = self.model.shape
        kv_per_token = 2 * s.layers * s.kv_heads * (s.hidden // s.heads) * 2
        out = []
        for r in batch:
            self.model.run(self.stream_for_layer)
            out.append(PrefillOutput(r.request_id, 0, kv_per_token * r.prompt_tokens))
        self.model.torch.cuda.synchronize()
        return out

    async def prefill(self, batch: Sequence[PrefillInput], sm_share: float = 1.0) -> list[PrefillOutput]:
        return await asyncio.to_thread(self._prefill_sync, batch)
