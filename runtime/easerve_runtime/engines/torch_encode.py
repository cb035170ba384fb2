"""Real torch encoders on a GPU (random weights from transformers configs), partition-aware.

Why random weights: latency depends on shapes, not values, and the device machines reach no
model hub; ``weights_path`` loads real weights when one is at hand. Why CUDA graphs: eager HF
code spends ~5 ms of CPU per call on a 24-layer ViT, which would hide the SM-share effect we
exist to exploit. Why one graph per (batch, stream): a graph captured on a plain stream ignores
the partition; captured on a green context's stream it carries that partition with it.

Encoders (bf16):
- ``clip-vit-l-336``: CLIP ViT-L/14 at 336 px (303 M params, 577 tokens per image);
- ``whisper-large-v3``: the Whisper-large-v3 encoder (637 M, 128 mel bins x 3000 frames);
- ``qwen2-vl-vision``: a Qwen2-VL-style vision tower (675 M, 1024 patches per image), eager
  (its packed variable-length attention is not graph-friendly).

torch and transformers are imported inside functions only, so importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from easerve_runtime.engines.base import Embedding, EncodeInput

log = logging.getLogger(__name__)

ENCODERS = ("clip-vit-l-336", "whisper-large-v3", "qwen2-vl-vision")
DEFAULT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class BuiltEncoder:
    """A model plus how to make a batch of its inputs and read its output rows."""

    name: str
    module: Any
    make_inputs: Callable[[int], Any]
    forward: Callable[[Any], Any]
    tokens_per_item: int
    hidden: int
    graphable: bool = True


def build_encoder(name: str, device: str = "cuda", weights_path: str | None = None) -> BuiltEncoder:
    """Instantiate ``name`` in bf16 on ``device`` with random (or ``weights_path``) weights."""
    import torch

    dt = torch.bfloat16
    if name == "clip-vit-l-336":
        from transformers import CLIPVisionConfig, CLIPVisionModel

        cfg = CLIPVisionConfig(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        )
        cfg._attn_implementation = "sdpa"
        m = CLIPVisionModel.from_pretrained(weights_path) if weights_path else CLIPVisionModel(cfg)
        m = m.to(device=device, dtype=dt).eval()

        def mk(b: int) -> Any:
            return torch.randn(b, 3, 336, 336, device=device, dtype=dt)

        return BuiltEncoder(name, m, mk, lambda x: m(pixel_values=x).last_hidden_state, 577, 1024)
    if name == "whisper-large-v3":
        from transformers import WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        cfg = WhisperConfig(
            d_model=1280,
            encoder_layers=32,
            encoder_attention_heads=20,
            encoder_ffn_dim=5120,
            decoder_layers=2,
            decoder_attention_heads=20,
            decoder_ffn_dim=5120,
            num_mel_bins=128,
            max_source_positions=1500,
        )
        cfg._attn_implementation = "sdpa"
        m = WhisperEncoder(cfg).to(device=device, dtype=dt).eval()

        def mk(b: int) -> Any:
            return torch.randn(b, 128, 3000, device=device, dtype=dt)

        return BuiltEncoder(name, m, mk, lambda x: m(input_features=x).last_hidden_state, 1500, 1280)
    if name == "qwen2-vl-vision":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        cfg = Qwen2VLVisionConfig(
            depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14
        )
        cfg._attn_implementation = "sdpa"
        m = Qwen2VisionTransformerPretrainedModel(cfg).to(device=device, dtype=dt).eval()
        grid = (1, 32, 32)  # 1024 patches of 14x14 (448 px), merged 2x2 -> 256 tokens

        def mk(b: int) -> Any:
            n = grid[0] * grid[1] * grid[2]
            x = torch.randn(b * n, 3 * 2 * 14 * 14, device=device, dtype=dt)
            thw = torch.tensor([grid] * b, device=device)
            return (x, thw)

        return BuiltEncoder(name, m, mk, lambda x: m(x[0], grid_thw=x[1]), 256, 3584, graphable=False)
    raise ValueError(f"spec.model.encoder: unknown torch encoder {name!r}; known: {', '.join(ENCODERS)}")


class GraphedEncoder:
    """CUDA graphs of one encoder, one per (batch bucket, stream), captured lazily or up front."""

    def __init__(
        self, enc: BuiltEncoder, buckets: Sequence[int] = DEFAULT_BUCKETS, use_graphs: bool = True
    ) -> None:
        import torch

        self.torch = torch
        self.enc = enc
        self.buckets = tuple(sorted(buckets))
        self.use_graphs = use_graphs and enc.graphable
        self._graphs: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self._eager_inputs: dict[int, Any] = {}

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest bucket {self.buckets[-1]}")

    def capture(self, batch: int, stream: Any) -> None:
        torch = self.torch
        key = (batch, id(stream))
        if key in self._graphs or not self.use_graphs:
            return
        x = self.enc.make_inputs(batch)
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm up cuBLAS/cuDNN heuristics on this stream
                self.enc.forward(x)
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(g, stream=stream):
            y = self.enc.forward(x)
        self._graphs[key] = (g, x, y)

    def run(self, n: int, stream: Any) -> Any:
        """Launch one micro-batch of ``n`` items on ``stream`` (async); returns the output tensor."""
        torch = self.torch
        b = self.bucket(n)
        if self.use_graphs:
            self.capture(b, stream)
            g, _, y = self._graphs[(b, id(stream))]
            with torch.cuda.stream(stream):
                g.replay()
            return y
        if b not in self._eager_inputs:
            self._eager_inputs[b] = self.enc.make_inputs(b)
        with torch.inference_mode(), torch.cuda.stream(stream):
            return self.enc.forward(self._eager_inputs[b])


class TorchEncodeEngine:
    """:class:`~easerve_runtime.engines.base.EncodeEngine` on a real GPU, partition-aware.

    ``sm_share`` picks the ladder level (``round(sm_share * total_sms)`` snapped to the pool's
    levels); media bytes are not decoded (random-weight models: only shapes matter), so each
    part costs one encoder item and yields ``tokens_per_item`` rows.
    """

    def __init__(
        self,
        encoder: str,
        pool: Any | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        weights_path: str | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.model = GraphedEncoder(build_encoder(encoder, weights_path=weights_path), buckets)
        self.pool = pool
        self.total_sms = int(torch.cuda.get_device_properties(0).multi_processor_count)
        self.default_stream = torch.cuda.Stream()

    def _stream(self, sm_share: float) -> Any:
        if self.pool is None or sm_share >= 1.0:
            return self.default_stream
        want = sm_share * self.total_sms
        levels = sorted(self.pool.levels)
        sms = min(levels, key=lambda s: (abs(s - want), -s)) if levels else self.total_sms
        return self.pool.primary(sms)

    def _encode_sync(self, batch: Sequence[EncodeInput], sm_share: float) -> list[Embedding]:
        n = sum(max(1, len(r.parts)) for r in batch)
        stream = self._stream(sm_share)
        out = []
        done = 0
        while done < n:
            k = min(n - done, self.model.buckets[-1])
            y = self.model.run(k, stream)
            stream.synchronize()
            rows = y[:k].reshape(k, -1, y.shape[-1]).float().to(self.torch.bfloat16).cpu()
            out.append(rows)
            done += k
        allrows = self.torch.cat(out)
        res, i = [], 0
        for r in batch:
            m = max(1, len(r.parts))
            t = allrows[i : i + m].reshape(-1, allrows.shape[-1]).contiguous()
            i += m
            res.append(
                Embedding(
                    r.request_id, t.view(self.torch.int16).numpy().tobytes(), tuple(t.shape), "bfloat16"
                )
            )
        return res

    async def encode(self, batch: Sequence[EncodeInput], sm_share: float = 1.0) -> list[Embedding]:
        return await asyncio.to_thread(self._encode_sync, batch, sm_share)
