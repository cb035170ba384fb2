"""Qwen2.5-VL on a CUDA GPU: the decode step's CUDA graph carries each row's M-RoPE position.

On the CPU the decode step runs eagerly (tests/engines/test_torch_epd.py); on a GPU it replays a
graph captured per (batch, K/V length) bucket, whose rotary positions are a static tensor filled
before each replay. Here two requests with different images (so different deltas) decode in one
batch of graph replays: each replayed step equals the eager step, and the first step of each
equals the whole model's forward on the same device.
Skipped without a CUDA GPU (run on the device machine: ``pytest -m gpu tests/engines``).
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

STEPS = 12


def _image(seed: int, h: int, w: int) -> tuple[Any, bytes]:
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return img, buf.getvalue()


def test_qwen_vl_graph_decode_carries_each_rows_delta(model_dirs: dict[str, Path]) -> None:
    """Two requests with different deltas in one step: every replayed step's logits equal the
    eager step's (whose rotary positions the CPU tests check against the whole model), and the
    first step of each equals the whole model's forward on the GPU."""
    import torch
    import transformers
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.base import DecodeSequence, EncodeInput, MediaPart, PrefillInput, Sampling
    from easerve_runtime.engines.hf import HFDecodeEngine, HFEncodeEngine, HFPrefillEngine
    from easerve_runtime.models.loading import load_processor

    d = model_dirs["qwen2.5-vl"]
    dev, dt = "cuda", torch.float32
    enc = HFEncodeEngine(d, device=dev, dtype=dt)
    pre = HFPrefillEngine(d, device=dev, dtype=dt)
    dec = HFDecodeEngine(d, device=dev, dtype=dt, max_slots=4, max_len=512, cuda_graphs=True, stage_buffers=0)
    msgs = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},)
    imgs = [_image(1, 120, 200), _image(2, 200, 90)]
    embs = enc._encode_sync([EncodeInput(f"q{i}", (MediaPart("image", data, "image/png"),), i, msgs)
                             for i, (_, data) in enumerate(imgs)])
    seqs = []
    for e in embs:
        rows = np.frombuffer(bytes(e.data), dtype=np.float32).reshape(e.shape)
        out = pre.prefill_one(PrefillInput(e.request_id, 1, e.tokens, embedding=rows, extra=dict(e.extra),
                                           sampling=Sampling(0.0)))
        kv = out.kv if out.kv is not None else out.pack_kv()  # type: ignore[misc]
        seqs.append(DecodeSequence(e.request_id, len(e.extra["input_ids"]), STEPS, generated=[out.first_token],
                                   kv=kv, kv_meta=out.kv_meta))
    deltas = [int(s.kv_meta["rope_delta"]) for s in seqs]
    assert deltas[0] != deltas[1]  # the rows' rotary offsets differ within one replayed step

    async def admit() -> None:
        for s in seqs:
            await dec.admit(s)

    asyncio.run(admit())
    first: list[Any] = []
    with torch.inference_mode():
        for step in range(STEPS - 1):
            lengths = [dec.length[s.request_id] for s in seqs]
            ids = torch.tensor([s.generated[-1] for s in seqs], device=dev)
            pos = torch.tensor(lengths, device=dev)
            rope = pos + torch.tensor(deltas, device=dev)
            kv_len = hf.kv_bucket(max(lengths) + 1, dec.max_len)
            eager = dec._forward(ids, pos, 2, kv_len, rope).clone()
            graph = dec._graph_logits(ids, pos, 2, kv_len, rope).clone()
            assert torch.allclose(graph, eager, atol=1e-4, rtol=1e-4), (step, (graph - eager).abs().max())
            if step == 0:
                first = [eager[i] for i in range(2)]
            for i, s in enumerate(seqs):
                s.generated.append(int(graph[i].argmax()))
                dec.length[s.request_id] += 1
    assert dec.stats["captures"] >= 1 and dec.cuda_graphs

    proc = load_processor(d)
    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(d).architectures[0])
    model = cls.from_pretrained(d, dtype=dt).to(dev).eval()
    for i, (s, (img, _)) in enumerate(zip(seqs, imgs, strict=True)):
        inp = proc(images=[img], text=[proc.apply_chat_template(list(msgs), add_generation_prompt=True,
                                                                tokenize=False)], return_tensors="pt").to(dev)
        tok = torch.tensor([[s.generated[0]]], device=dev)
        inp["input_ids"] = torch.cat([inp["input_ids"], tok], 1)
        inp["attention_mask"] = torch.ones_like(inp["input_ids"])
        inp["mm_token_type_ids"] = torch.cat([inp["mm_token_type_ids"], torch.zeros_like(inp["mm_token_type_ids"][:, :1])], 1)
        with torch.inference_mode():
            whole = model(**inp).logits[0, -1]
        assert torch.allclose(first[i], whole, atol=1e-3, rtol=1e-3), (s.request_id, (first[i] - whole).abs().max())


def test_qwen_vl_video_frames_decode_and_encode_on_the_gpu(model_dirs: dict[str, Path]) -> None:
    """A video sent as JPEG frames: on the GPU every frame goes through nvJPEG in one call and the
    library's video processor runs on the CUDA tensors (``last_path == "gpu"``); the grids, the
    seconds per grid, the prompt ids and the rows' shape equal the CPU path's (PIL + the processor
    on the host), and the processor's pixels agree within what two JPEG decoders and two resize
    kernels differ by (a few 8-bit levels on average)."""
    import torch
    from easerve_runtime.engines.base import FRAME_LIST_MIME, EncodeInput, MediaPart
    from easerve_runtime.engines.hf import HFEncodeEngine
    from PIL import Image

    d = model_dirs["qwen2.5-vl"]
    frames = []
    yy, xx = np.mgrid[0:64, 0:96]
    for k in range(6):  # smooth frames (a moving gradient): decoders and resize kernels agree on them
        rgb = np.stack([(xx * 2 + 8 * k) % 256, (yy * 3 + 5 * k) % 256, (xx + yy + 11 * k) % 256], -1)
        buf = io.BytesIO()
        Image.fromarray(rgb.astype("uint8")).save(buf, format="JPEG", quality=95)
        frames.append(buf.getvalue())
    media = {"frames": 6, "height": 64, "width": 96, "fps": 3.0, "frame_bytes": [len(f) for f in frames]}
    part = MediaPart("video", b"".join(frames), FRAME_LIST_MIME, media)
    msgs = ({"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},)
    out = {}
    for dev in ("cuda", "cpu"):
        enc = HFEncodeEngine(d, device=dev, dtype=torch.float32)
        batch = [EncodeInput("v", (part,), 1, msgs)]
        pixels = enc._prepare(batch, "image")["pixel_values_videos"].float().cpu()
        (e,) = enc._encode_sync(batch)
        out[dev] = (enc.last_path, e, pixels)
    (gpu_path, g, g_px), (cpu_path, c, c_px) = out["cuda"], out["cpu"]
    assert (gpu_path, cpu_path) == ("gpu", "cpu")
    assert g.extra["video_grid_thw"] == c.extra["video_grid_thw"] == [[3, *c.extra["video_grid_thw"][0][1:]]]
    assert g.extra["second_per_grid_ts"] == c.extra["second_per_grid_ts"] == [pytest.approx(2 / 3.0)]
    assert g.extra["input_ids"] == c.extra["input_ids"] and g.shape == c.shape
    assert g_px.shape == c_px.shape
    level = 1 / 255 / 0.27  # one 8-bit level in the processor's normalised units (CLIP std ~0.27)
    assert float((g_px - c_px).abs().mean()) < 4 * level
