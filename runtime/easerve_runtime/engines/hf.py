"""The torch engine over a Hugging Face model directory: real encode, prefill, KV handoff and decode.

Each stage loads only what it runs (``models.loading.load_stage``) and calls the model's own
code: the encoder is the model's feature extractor (``get_image_features`` / its audio tower and
projector), prefill merges the rows into the prompt embeddings with the model's placeholder mask
and runs its language model, decode runs the same language model one token per sequence.

What EAServe adds around transformers (it has no engine that takes over a KV cache made
elsewhere, and its own continuous batching measured ~8x slower than a graph-captured static
decode on the H200):

- **KV handoff**: prefill returns the cache it built as one contiguous buffer
  ``[layers, 2, kv_heads, tokens, head_dim]`` (``pack_kv``); the workers move it in chunks over the
  request plane; decode copies it into a slot (``SlotKV.load``).
- **Slots**: decode keeps every running sequence's KV in preallocated per-layer tensors
  ``[slots, kv_heads, max_len, head_dim]`` sized from the memory left after weights
  (``spec.decode.kvMemoryFraction``). Running sequences occupy slots ``0..n-1`` (a leaving
  sequence's slot is filled by the last one), so a step over ``n`` sequences works on a view of
  the first ``n`` slots, and a CUDA graph captured for a bucket ``b >= n`` replays on it.
- **One step over mixed lengths**: each row writes its new K/V at its own position and attends
  through a 4-D mask of its own valid prefix (``SlotCache``), which transformers' attention
  takes as given.
- **Sampling**: per request greedy / temperature / top-p, every row of a step at once on the
  device (Gumbel-max with noise hashed from (seed, position, token)), so a sequence's tokens do
  not depend on who else is in the batch and a step pays no per-row host work (``sample_rows``).

Supported families: LLaVA-NeXT (image), Qwen2.5-VL (image) and Qwen2-Audio (audio).

- **M-RoPE (Qwen2.5-VL)**: a prompt's positions are 3-D (time, height, width) over the image
  rows. Encode sends each request's ``image_grid_thw`` with its token ids; prefill asks the
  model's own ``get_rope_index`` for the positions and the request's offset (``rope_delta``:
  the next text position minus the prompt length), which travels to decode in ``kv_meta``;
  decode writes K/V at the slot position ``t`` and rotates by ``t + rope_delta``, as the
  library's ``generate`` does with its ``rope_deltas``.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import threading
import wave
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from easerve_runtime.engines import kv_ipc
from easerve_runtime.engines.base import (
    DecodeSequence,
    Embedding,
    EncodeInput,
    MediaPart,
    PrefillInput,
    PrefillOutput,
    Sampling,
)
from easerve_runtime.workload.media import encoder_items

log = logging.getLogger("easerve.engine.hf")

SERVED_FAMILIES = ("llava_next", "qwen2_5_vl", "qwen2_audio")
MROPE_FAMILIES = ("qwen2_5_vl",)
"""Families whose positions are 3-D (M-RoPE): prefill gets them from the model, decode adds the delta."""
DEFAULT_MAX_LEN = 4096
DEFAULT_MAX_SLOTS = 256
PRECAPTURE_ENV = "EASERVE_DECODE_PRECAPTURE_S"
DEFAULT_PRECAPTURE_S = 60.0
"""Seconds the decode engine may spend at start-up capturing its CUDA graphs (0: capture each on
first use). Why: a capture takes 0.1-0.5 s on the decode stream, and served runs on the H200 caught
7-10 of them inside their measured windows (each stalls every running sequence for its length)."""
AUDIO_RATE = 16_000


# -- sampling ----------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _srl(x: Any, k: int) -> Any:
    """Logical right shift of int64 tensors (torch's ``>>`` extends the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _to_i64(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


def _splitmix(x: Any) -> Any:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps, as the algorithm wants)."""
    x = x ^ _srl(x, 30)
    x = x * _to_i64(0xBF58476D1CE4E5B9)
    x = x ^ _srl(x, 27)
    x = x * _to_i64(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def _splitmix_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (the per-row key), as a signed 64-bit value."""
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return _to_i64(x ^ (x >> 31))


def gumbel_keys(seeds: Sequence[int], positions: Sequence[int], device: Any) -> Any:
    """Per row, the int64 key of its noise stream: a hash of the request's seed and the position."""
    import torch

    return torch.tensor(
        [_splitmix_int(_splitmix_int(int(s) & _M64) ^ (int(p) & _M64)) for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.int64,
        device=device,
    )


def gumbel_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int, device: Any) -> Any:
    """Gumbel(0, 1) noise ``[rows, vocab]`` that is a pure function of (seed, position, token id).

    Counter-based (a hash, no generator state), so each row's draw depends only on its own request
    and position, never on which other requests share the batch, and the whole batch is made in
    a few element-wise kernels on the device (on CUDA, ``gumbel_argmax.py`` makes the same noise
    inside its argmax instead)."""
    import torch

    # SplitMix64 as a generator: the stream of (seed, position) is finaliser(key + i * golden)
    key = gumbel_keys(seeds, positions, device)
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
    x = _splitmix(key[:, None] + ids[None, :] * _to_i64(0x9E3779B97F4A7C15))
    u = (_srl(x, 11).double() + 0.5) / float(1 << 53)  # in (0, 1)
    return -torch.log(-torch.log(u))


def _fused_sampling(device: Any) -> bool:
    """Draw with the one-kernel Gumbel argmax (``gumbel_argmax.py``): on CUDA, when Triton imports,
    unless ``EASERVE_FUSED_SAMPLING=0``."""
    return getattr(device, "type", str(device)).startswith("cuda") and os.environ.get(
        "EASERVE_FUSED_SAMPLING", "1") != "0" and _triton_available()


def sample_rows(logits: Any, samplings: Sequence[Sampling | None], positions: Sequence[int]) -> list[int]:
    """One token per row of ``logits [rows, vocab]``: greedy where ``temperature <= 0``, else
    temperature + top-p, all rows at once on the logits' device.

    Sampling is Gumbel-max over the top-p set: ``argmax(logits / T + g)`` with ``g`` from
    ``gumbel_noise`` is an exact draw from ``softmax(logits / T)`` restricted to that set. Why not
    ``torch.multinomial`` per row: a CPU generator per row cost ~1.8 ms a row on the host, so a
    decode step of 26 sequences spent ~50 ms sampling (the TPOT measured on the H200)."""
    return [int(t) for t in sample_rows_tensor(logits, samplings, positions).tolist()]


def sample_rows_tensor(logits: Any, samplings: Sequence[Sampling | None], positions: Sequence[int]) -> Any:
    """``sample_rows`` left on the device (``[rows]`` int64): no host sync, so a caller can time it."""
    import torch

    rows = logits.float()
    n, vocab = rows.shape
    ss = [s or Sampling(temperature=0.0) for s in samplings]
    greedy = rows.argmax(-1)
    hot = [i for i, s in enumerate(ss) if s.temperature > 0]
    if not hot:
        return greedy
    dev = rows.device
    h = torch.tensor(hot, device=dev)
    temps = torch.tensor([ss[i].temperature for i in hot], dtype=torch.float32, device=dev)
    scaled = rows[h] / temps[:, None]
    if any(ss[i].top_p < 1.0 for i in hot):  # decided on the host: no device sync before the draw
        top_p = torch.tensor([ss[i].top_p for i in hot], dtype=torch.float32, device=dev)
        probs = torch.softmax(scaled, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p[:, None]
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    seeds, at = [ss[i].seed for i in hot], [positions[i] for i in hot]
    if _fused_sampling(dev):
        from .gumbel_argmax import gumbel_argmax

        drawn = gumbel_argmax(scaled, gumbel_keys(seeds, at, dev))
    else:
        drawn = (scaled.double() + gumbel_noise(seeds, at, vocab, dev)).argmax(-1)
    out = greedy.clone()
    out[h] = drawn
    return out


def sample(logits: Any, sampling: Sampling | None, position: int) -> int:
    """One token from a 1-D logits row (``sample_rows`` of one row)."""
    return sample_rows(logits[None, :], [sampling], [position])[0]


# -- KV cache codec --------------------------------------------------------------------------
def _to_bytes(t: Any) -> memoryview:
    """The tensor's bytes on the host: one device-to-host copy, no further copy (a flat view)."""
    import torch

    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy().reshape(-1)).cast("B")


def _host_view(t: Any) -> np.ndarray[Any, Any]:
    """A numpy view (no copy) of a contiguous CPU tensor's bytes; bfloat16 as raw 2-byte values."""
    import torch

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return np.asarray(t.numpy())


def _from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> Any:
    """A tensor over ``data``: on a writable buffer (a taken blob) without a copy, else over a copy."""
    import torch

    arr = np.frombuffer(data, dtype=np.int16 if dtype == "bfloat16" else np.dtype(dtype))
    if not arr.flags.writeable:
        arr = arr.copy()
    t = torch.from_numpy(arr)
    return (t.view(torch.bfloat16) if dtype == "bfloat16" else t).reshape(tuple(shape))


def stack_kv(cache: Any) -> Any:
    """A transformers DynamicCache of one sequence -> one device tensor laid out [L, 2, H, T, D]."""
    import torch

    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def kv_meta(kv: Any) -> dict[str, Any]:
    return {"shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch.")}


def pack_kv(cache: Any) -> tuple[memoryview, dict[str, Any]]:
    """A transformers DynamicCache of one sequence -> (bytes, meta) laid out [L, 2, H, T, D]."""
    kv = stack_kv(cache)
    return _to_bytes(kv), kv_meta(kv)


PINNED_ENV = "EASERVE_KV_PINNED"


def kv_pinned() -> bool:
    """KV caches cross between host and device through pinned memory (``EASERVE_KV_PINNED``, default on).

    Why: the pageable device-to-host copy of a 2,048-token cache (256 MiB) took 412 ms on the H200
    host (0.6 GB/s, gpu_engine run 2). If the pageable host-to-device load of a ~390 MB cache that
    admission did on the decode loop ran at that rate, each admission stalled every running
    sequence ~0.6 s, and the ~1.8 req/s at which the H200 end-to-end runs saturated is one such
    load after another (inferred from that rate; ``gpu_engine.py`` section ``decode_load`` measures
    it). Pinned buffers come from torch's caching host allocator (reused, not re-pinned each time)."""
    return os.environ.get(PINNED_ENV, "1") != "0"


def deferred_pack(kv: Any, ready: Any, held: list[Any] | None = None) -> Any:
    """``PrefillOutput.pack_kv`` for a device tensor: copies it to the host on a side stream once the
    prefill's stream has produced it (``ready``, a CUDA event), so the copy neither waits for nor
    holds up the next prefill's kernels; into pinned memory unless ``kv_pinned()`` says otherwise.
    ``held``: the holder it shares with ``kv_ipc.deferred_share`` (whichever path runs frees it)."""

    if held is None:
        held = [kv]  # released by the first call: the device copy must not live as long as the request

    def pack() -> memoryview:
        import torch

        if not held:
            raise RuntimeError("this KV cache was already packed")
        dev = held.pop()
        if ready is None:
            return _to_bytes(dev)
        stream = torch.cuda.Stream(device=dev.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if kv_pinned():
                host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
                host.copy_(dev, non_blocking=True)
            else:
                host = dev.to("cpu")  # pageable: synchronous for this thread only
        dev.record_stream(stream)
        stream.synchronize()
        del dev
        return _to_bytes(host)

    return pack


def unpack_kv(data: bytes | bytearray | memoryview, meta: Mapping[str, Any]) -> Any:
    shape = [int(x) for x in meta["shape"]]
    need = int(np.prod(shape)) * (2 if meta["dtype"] in ("bfloat16", "float16") else np.dtype(meta["dtype"]).itemsize)
    if len(data) != need:
        raise ValueError(f"KV cache: {len(data)} bytes received, {need} expected for {shape} {meta['dtype']}")
    return _from_bytes(data, str(meta["dtype"]), shape)


# -- media decoding ------------------------------------------------------------------------------
def decode_image(part: MediaPart) -> Any:
    """CPU fallback: PIL decodes any format it knows (the GPU path takes JPEG through nvJPEG)."""
    from PIL import Image

    return Image.open(io.BytesIO(part.data)).convert("RGB")


def decode_audio(part: MediaPart) -> np.ndarray[Any, Any]:
    """A WAV clip as mono float32 at 16 kHz (linear resampling)."""
    if part.data[:4] != b"RIFF":
        raise ValueError(f"audio part ({part.mime or 'unknown'}): only WAV is decoded by the torch engine")
    with wave.open(io.BytesIO(part.data)) as w:
        rate, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        raw = w.readframes(n)
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}
    if width not in kinds:
        raise ValueError(f"audio part: {8 * width}-bit WAV is not supported")
    dt, off, scale = kinds[width]
    x = (np.frombuffer(raw, dtype=dt).astype(np.float32) - off) / scale
    x = x.reshape(-1, ch).mean(axis=1)
    if rate != AUDIO_RATE and len(x) > 1:
        t = np.linspace(0, len(x) - 1, int(round(len(x) * AUDIO_RATE / rate)))
        x = np.interp(t, np.arange(len(x)), x).astype(np.float32)
    return x


def gpu_decode_jpegs(parts: Sequence[MediaPart], device: str) -> list[Any] | None:
    """nvJPEG over all JPEG parts of a micro-batch in one call; None when the GPU path cannot take them."""
    if not str(device).startswith("cuda") or not parts:
        return None
    if any(p.data[:2] != b"\xff\xd8" for p in parts):
        return None
    try:
        import torch
        from torchvision.io import decode_jpeg
    except ImportError:
        return None
    datas = [torch.frombuffer(bytearray(p.data), dtype=torch.uint8) for p in parts]
    try:
        return list(decode_jpeg(datas, device=device))
    except RuntimeError as exc:  # e.g. progressive/CMYK JPEG nvJPEG rejects: CPU fallback
        log.info("nvJPEG fell back to CPU: %s", exc)
        return None


def _llava_next_preprocess_batched(self: Any, images: list[Any], do_resize: bool, size: Any,
                                   image_grid_pinpoints: list[list[int]], resample: Any, do_center_crop: bool,
                                   crop_size: Any, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                                   image_mean: Any, image_std: Any, do_pad: bool | None, disable_grouping: bool | None,
                                   return_tensors: Any, **kwargs: Any) -> Any:
    """``LlavaNextImageProcessor._preprocess`` over same-size images at once (bound to one processor instance).

    Why: the library's torchvision processor runs its anyres steps (resize to the best grid, pad,
    cut into crops, resize the overview, crop, normalize) one image at a time, a dozen small
    kernels and their Python per image, which cost more than the CLIP tower on an H200 and made a
    micro-batch of 16 no faster per image than 8. A micro-batch's images mostly share a size
    (same camera, same upload path); those go through the SAME processor methods once, stacked
    ``[N, C, H, W]`` (each op is per image, so the values are the library's). Images of other
    sizes form their own groups. Output layout is the library's: ``pixel_values`` padded to the
    most crops, ``image_sizes`` per image in input order.
    """
    import torch
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_transforms import group_images_by_shape, reorder_images

    size_tuple = (size.height, size.width) if size and size.height and size.width else (size.shortest_edge,) * 2
    patch = crop_size.height if crop_size and crop_size.height else (size.height or size.shortest_edge)
    mean = tuple(image_mean) if isinstance(image_mean, list) else image_mean
    std = tuple(image_std) if isinstance(image_std, list) else image_std
    by_size: dict[tuple[int, ...], list[int]] = {}
    for i, im in enumerate(images):
        by_size.setdefault(tuple(im.shape), []).append(i)
    per_image: list[Any] = [None] * len(images)
    for idx in by_size.values():
        stack = torch.stack([images[i] for i in idx])  # [N, C, H, W]
        crops = self._get_image_patches(stack, image_grid_pinpoints, size=size_tuple, patch_size=patch,
                                        resample=resample)  # [overview, crop...], each [N, C, h, w]
        grouped, index = group_images_by_shape(crops, disable_grouping=disable_grouping)
        done = {}
        for shape, x in grouped.items():  # x: [P, N, C, h, w]
            p_, n_ = x.shape[:2]
            x = x.flatten(0, 1)
            if do_resize:
                x = self.resize(image=x, size=size, resample=resample)
            if do_center_crop:
                x = self.center_crop(x, crop_size)
            x = self.rescale_and_normalize(x, do_rescale, rescale_factor, do_normalize, mean, std)
            done[shape] = x.unflatten(0, (p_, n_))
        out = torch.stack(reorder_images(done, index), dim=1)  # [N, P, C, h, w]
        for j, i in enumerate(idx):
            per_image[i] = out[j]
    sizes = [[int(im.shape[-2]), int(im.shape[-1])] for im in images]
    if do_pad:
        per_image = self._pad_for_batching(per_image)
    return BatchFeature(data={"pixel_values": per_image, "image_sizes": sizes}, tensor_type=return_tensors)


def batch_image_processor(processor: Any) -> bool:
    """Give this processor instance the same-size batched anyres step, where it is LLaVA-NeXT's torchvision one."""
    import types

    ip = getattr(processor, "image_processor", None)
    if ip is None or type(ip).__name__ != "LlavaNextImageProcessor" or not hasattr(ip, "_get_image_patches"):
        return False
    ip._preprocess = types.MethodType(_llava_next_preprocess_batched, ip)
    return True


def media_to_messages(messages: Sequence[Mapping[str, Any]], parts: Sequence[MediaPart]) -> list[dict[str, Any]]:
    """The chat for the template: placeholders in order; a request without messages gets one user turn."""
    if messages:
        return [dict(m) for m in messages]
    return [{"role": "user", "content": [{"type": p.kind} for p in parts]}]


# -- engines ------------------------------------------------------------------------------------
class _Stage:
    def __init__(self, path: str | Path, stage: str, device: str, dtype: Any, random_weights: bool,
                 trust_remote_code: bool, loaded: Any = None) -> None:
        from easerve_runtime.models.loading import load_stage

        self.path = str(path)
        self.loaded = loaded if loaded is not None else load_stage(
            path, stage, device=device, dtype=dtype, random_weights=random_weights, trust_remote_code=trust_remote_code)
        if self.loaded.family not in SERVED_FAMILIES:
            raise ValueError(
                f"spec.model.path: {path}: {self.loaded.family} loads but is not served yet by the torch engine "
                f"(served: {', '.join(SERVED_FAMILIES)})"
            )
        self.model = self.loaded.model
        self.device = device
        self.family = self.loaded.family
        from easerve_runtime.models.loading import load_tokenizer, stop_token_ids

        self.stop_token_ids = stop_token_ids(path) or stop_token_ids(path, load_tokenizer(path, trust_remote_code))


ENCODE_CHUNK_ENV = "EASERVE_ENCODE_CHUNK"
ENCODE_RAMP_ENV = "EASERVE_ENCODE_RAMP"
FUSED_ACT_ENV = "EASERVE_FUSED_ACT"
DEFAULT_ENCODE_CHUNK = 8
"""Measured on the H200 (gpu_engine run 3, LLaVA-NeXT tower, 1080p JPEG): equal chunks of 8 were the
fastest at B = 16 (142 img/s against 130 for one pass, 113 for 1-2-4-9 and 127 for chunks of 4),
and at B <= 8 one chunk is one pass (123 img/s; the ramped chunks of 4 made 97)."""


class HFEncodeEngine(_Stage):
    """:class:`EncodeEngine`: chat template + processor + the model's own feature extractor.

    One micro-batch is one processor call and one tower forward over every media item of every
    request in it. Returns per request its embedding rows and, in ``extra``, the prompt's token
    ids (placeholders expanded by the processor) and its text-token count.
    """

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: Any = None, random_weights: bool = False,
                 trust_remote_code: bool = False, pool: Any = None) -> None:
        super().__init__(path, "encode", device, dtype, random_weights, trust_remote_code)
        self.pool = pool
        """The ``GreenContextPool`` this process's local prefill shares (CUDA, SM split): the tower
        runs on the primary stream of the micro-batch's share (``_stream_ctx``)."""
        from easerve_runtime.models.loading import load_processor

        self.processor = load_processor(path, trust_remote_code)
        self.batched_preprocess = batch_image_processor(self.processor)
        self.gpu_decode = True
        """Decode and process media on the GPU (``spec.encode.preprocessing``, set by
        ``engines.torch.encode_engine``); False: on the CPU, as Dynamo's encode worker does."""
        self.last_path = ""
        """How the last micro-batch was preprocessed: ``gpu`` (nvJPEG + processor on CUDA) or ``cpu``."""
        self.profile = False
        """Benchmarks: synchronize between phases and record their times in ``last_timing`` (ms)."""
        self.last_timing: dict[str, float] = {}
        default_chunk = DEFAULT_ENCODE_CHUNK if str(device).startswith("cuda") else 0
        self.chunk_images = int(os.environ.get(ENCODE_CHUNK_ENV, default_chunk))
        """Pipeline a micro-batch in chunks of this many media items (0: one pass; ``_encode_pipelined``)."""
        self.chunk_ramp = os.environ.get(ENCODE_RAMP_ENV, "0") == "1"
        """First chunks smaller (1, 2, 4, ...), see ``_chunks`` (off by default: measured slower, each small
        chunk pays the tower's fixed cost while the next chunk's preprocessing is too short to hide)."""
        self._prep_pool: Any = None
        self._prep_stream: Any = None
        self._host_stream: Any = None
        self.fused_activations = 0
        """How many tower activations run as one Triton kernel (``engines/quick_gelu.py``): on CUDA
        with Triton, unless ``EASERVE_FUSED_ACT=0``."""
        if str(device).startswith("cuda") and os.environ.get(FUSED_ACT_ENV, "1") != "0" and _triton_available():
            from easerve_runtime.engines.quick_gelu import fuse_quick_gelu

            self.fused_activations = fuse_quick_gelu(self.model)

    def batch_items(self, batch: Sequence[EncodeInput]) -> int:
        """Encoder items of a micro-batch as the engine profile and the twin count them (anyres
        crops, frame pairs, 30 s audio windows: ``workload.media.items_tokens`` of each part's header
        descriptor), so the profile-indexed SM share and ``easerve_encode_profile_seconds`` look the
        profile up on its own axis; a part without a usable descriptor counts 1. Counting images
        here looked a LLaVA-NeXT batch up at about a quarter of its crops (docs/benchmarks.md, run 22)."""
        return encoder_items((p for r in batch for p in r.parts), self.family == "llava_next", default=1)

    def _prompts(self, batch: Sequence[EncodeInput]) -> list[str]:
        return [
            self.processor.apply_chat_template(media_to_messages(r.messages, r.parts), add_generation_prompt=True,
                                               tokenize=False)
            for r in batch
        ]

    def _check_kinds(self, batch: Sequence[EncodeInput]) -> str:
        kind = "audio" if self.family == "qwen2_audio" else "image"
        served = (kind, "video") if self.family == "qwen2_5_vl" else (kind,)
        for r in batch:
            bad = [p.kind for p in r.parts if p.kind not in served]
            if bad:
                raise ValueError(f"request {r.request_id}: {bad[0]} parts are not served by this {self.family} model")
        return kind

    def _prepare(self, batch: Sequence[EncodeInput], kind: str, mark: Any = None) -> Any:
        """Chat template, media decode (nvJPEG on CUDA) and the processor: the model's inputs.

        Videos (Qwen2.5-VL, sent as frames) go to the processor as ``[T, 3, H, W]`` tensors, their
        frames decoded with the images (``engines/video.py``)."""
        texts = self._prompts(batch)
        parts = [p for r in batch for p in r.parts if p.kind != "video"]
        videos = [(r.request_id, p) for r in batch for p in r.parts if p.kind == "video"]
        kw: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True}
        if parts and kind == "image":
            imgs = gpu_decode_jpegs(parts, self.device) if self.gpu_decode else None
            kw["images"] = imgs if imgs is not None else [decode_image(p) for p in parts]
            if imgs is not None:
                kw["device"] = self.device  # the processor's torchvision backend works on the CUDA tensors
        elif parts:
            kw["audio"] = [decode_audio(p) for p in parts]
            kw["sampling_rate"] = AUDIO_RATE
        if videos:
            from easerve_runtime.engines.video import decode_videos, video_metadata

            kw["videos"], on_gpu = decode_videos(videos, self.device, self.gpu_decode)
            if getattr(self.processor, "video_processor", None) is None:
                raise ValueError(f"request {videos[0][0]}: videos need the model's video processor, which "
                                 f"transformers builds only with torchvision installed on the encode worker")
            kw["video_metadata"] = [video_metadata(p) for _, p in videos]
            kw["do_sample_frames"] = False
            if on_gpu:
                kw["device"] = self.device
        if mark is not None and (parts or videos) and kind == "image":
            mark("decode_media")
        try:
            enc = None
            if "images" in kw and not videos:  # the prompts tokenized before the placeholders expand
                from easerve_runtime.engines.prompt_ids import expanded_inputs

                extra_kw = {"device": kw["device"]} if "device" in kw else {}
                enc = expanded_inputs(self.processor, texts, kw["images"], **extra_kw)
            if enc is None:
                enc = self.processor(**kw)
        except (TypeError, ValueError) as exc:
            if "device" not in kw:
                raise
            log.info("processor on the GPU failed (%s): CPU fallback", exc)
            kw.pop("device")
            if "images" in kw:
                kw["images"] = [decode_image(p) for p in parts]
            if "videos" in kw:
                kw["videos"] = [v.cpu() for v in kw["videos"]]
            enc = self.processor(**kw)
        self.last_path = "gpu" if "device" in kw else "cpu"
        return enc

    def _chunks(self, batch: Sequence[EncodeInput]) -> list[list[int]]:
        """Requests grouped in order into chunks of ``chunk_images`` media items (0: one chunk).

        With ``chunk_ramp`` the first chunks are smaller (1, 2, 4, ... up to ``chunk_images``): only
        the first chunk's preprocessing is not hidden behind a tower, so it should be short, and
        each next one only has to be ready when the tower before it ends. A last chunk of fewer
        than half the size joins the one before it (a tower of one or two images runs below the
        GPU's ceiling)."""
        c = self.chunk_images
        if c <= 0 or self.family != "llava_next":
            return [list(range(len(batch)))]
        out: list[list[int]] = [[]]
        size = 1 if self.chunk_ramp else c
        items = 0
        for i, r in enumerate(batch):
            if items >= size:
                out.append([])
                items = 0
                size = min(c, 2 * size)
            out[-1].append(i)
            items += len(r.parts)
        if len(out) > 1 and items < c / 2 and size == c:
            out[-2].extend(out.pop())
        return out

    def _encode_sync(self, batch: Sequence[EncodeInput]) -> list[Embedding]:
        kind = self._check_kinds(batch)
        chunks = self._chunks(batch)
        if len(chunks) > 1 and not self.profile:
            try:
                return self._encode_pipelined(batch, kind, chunks)
            except Exception as exc:  # noqa: BLE001 - the one-pass path still serves; pipeline no more
                if isinstance(exc, ValueError) and "request" in str(exc):
                    raise  # the request's own fault: the serial pass would refuse it too
                log.warning("encode: the chunked pipeline failed (%r); encoding in one pass from now on", exc)
                self.chunk_images = 0
        return self._encode_serial(batch, kind)

    def _encode_serial(self, batch: Sequence[EncodeInput], kind: str) -> list[Embedding]:
        import time

        import torch

        marks = [("start", time.perf_counter())]

        def mark(name: str) -> None:
            if self.profile:
                if str(self.device).startswith("cuda"):
                    torch.cuda.synchronize()
                marks.append((name, time.perf_counter()))

        enc = self._prepare(batch, kind, mark)
        mark("processor")
        has_parts = any(r.parts for r in batch)
        with torch.inference_mode():
            feats = self._features(enc, [p.kind for r in batch for p in r.parts]) if has_parts else []
            mark("tower")
            # one device->host copy for the whole micro-batch (pinned, on a GPU), then per-request views:
            # a pageable .cpu() per request plus a bytes copy cost ~24 MB x 2 host copies per 1080p image
            host, offsets = self._rows_to_host(feats)
        out = self._embeddings(batch, enc, host, offsets)
        mark("to_host")
        if self.profile:
            self.last_timing = {n: round(1e3 * (t - marks[i][1]), 2) for i, (n, t) in enumerate(marks[1:])}
        return out

    def _encode_pipelined(self, batch: Sequence[EncodeInput], kind: str, chunks: list[list[int]]) -> list[Embedding]:
        """The micro-batch in chunks: chunk k+1's template, nvJPEG and processor run on a helper
        thread (its own CUDA stream) while chunk k's tower runs, and chunk k's rows go to the host
        on a copy stream while chunk k+1's tower runs. Same model calls on the same inputs as one
        serial pass, chunk by chunk.

        Why: at 1080p and B = 16 on an H200 the processor (~32 ms, mostly host work) and the copy
        to the host (~6 ms) ran between towers (~81 ms), idling the GPU for a third of the batch."""
        import concurrent.futures

        import torch

        cuda = str(self.device).startswith("cuda")
        if self._prep_pool is None:
            self._prep_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="easerve-encode-prep")
            if cuda:
                self._prep_stream = torch.cuda.Stream(device=self.device)
                self._host_stream = torch.cuda.Stream(device=self.device)

        def prep(idx: list[int]) -> tuple[Any, Any]:
            import contextlib

            ctx = torch.cuda.stream(self._prep_stream) if cuda else contextlib.nullcontext()
            with ctx, torch.inference_mode():
                enc = self._prepare([batch[i] for i in idx], kind)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(self._prep_stream)
            return enc, ready

        futs = [self._prep_pool.submit(prep, idx) for idx in chunks]
        done: list[tuple[list[int], Any, Any, list[int]]] = []
        try:
            for idx, fut in zip(chunks, futs, strict=True):
                enc, ready = fut.result()
                with torch.inference_mode():
                    if cuda:
                        main = torch.cuda.current_stream(self.device)
                        main.wait_event(ready)
                        for v in enc.values():  # made on the helper's stream, read on this one
                            if isinstance(v, torch.Tensor) and v.is_cuda:
                                v.record_stream(main)
                    has_parts = any(batch[i].parts for i in idx)
                    feats = self._features(enc, [p.kind for i in idx for p in batch[i].parts]) if has_parts else []
                    host, offsets = self._rows_to_host(feats, wait=False)
                done.append((idx, enc, host, offsets))
        finally:
            for f in futs:  # an error: let the helper finish what it started before the next batch
                f.cancel()
            concurrent.futures.wait(futs)
        if cuda and self._host_stream is not None:
            self._host_stream.synchronize()
        out: list[Embedding | None] = [None] * len(batch)
        for idx, enc, host, offsets in done:
            for i, emb in zip(idx, self._embeddings([batch[i] for i in idx], enc, host, offsets), strict=True):
                out[i] = emb
        return [e for e in out if e is not None]

    def _embeddings(self, batch: Sequence[EncodeInput], enc: Any, host: Any, offsets: list[int]) -> list[Embedding]:
        """Per request: its rows (a request with images and videos: the images' rows, then the
        videos', as prefill's ``embed`` scatters them) and, in ``extra``, its prompt ids, text-token
        count and, for M-RoPE, the grids its positions need."""
        import torch

        ids_all = enc["input_ids"].cpu()
        mask_all = enc["attention_mask"].cpu().bool()
        video_id = getattr(self.loaded.config, "video_token_id", None) if self.family in MROPE_FAMILIES else None
        out: list[Embedding] = []
        item = img_at = vid_at = 0
        for i, r in enumerate(batch):
            ids = ids_all[i][mask_all[i]].tolist()
            n = len(r.parts)
            kinds = [p.kind for p in r.parts]
            first, last = offsets[item], offsets[item + n]
            mm = ids.count(self.loaded.mm_token_id) + (ids.count(video_id) if video_id is not None else 0)
            extra: dict[str, Any] = {"input_ids": ids, "text_tokens": len(ids) - mm}
            if r.parts:
                if last - first != mm:
                    raise RuntimeError(f"request {r.request_id}: {last - first} embedding rows for {mm} placeholders")
                assert host is not None
                rows = host[first:last]
                if "video" in kinds:  # the images' rows first, then the videos' (a copy only if interleaved)
                    spans = [host[offsets[item + k] : offsets[item + k + 1]] for k in range(n)]
                    image_spans = [sp for sp, k in zip(spans, kinds, strict=True) if k != "video"]
                    if kinds != sorted(kinds, key=lambda k: k == "video"):
                        rows = torch.cat(image_spans + [sp for sp, k in zip(spans, kinds, strict=True) if k == "video"])
                    extra["image_rows"] = sum(int(sp.shape[0]) for sp in image_spans)
                data: bytes | memoryview = memoryview(_host_view(rows)).cast("B")
                shape, dtype = tuple(rows.shape), str(rows.dtype).removeprefix("torch.")
            else:
                data, shape, dtype = b"", (0, 0), "float32"
            if self.family in MROPE_FAMILIES and r.parts:  # what prefill's M-RoPE positions need
                n_img, n_vid = n - kinds.count("video"), kinds.count("video")
                if n_img:
                    extra["image_grid_thw"] = enc["image_grid_thw"][img_at : img_at + n_img].tolist()
                if n_vid:
                    extra["video_grid_thw"] = enc["video_grid_thw"][vid_at : vid_at + n_vid].tolist()
                    extra["second_per_grid_ts"] = [float(x) for x in enc["second_per_grid_ts"][vid_at : vid_at + n_vid]]
                img_at, vid_at = img_at + n_img, vid_at + n_vid
            item += n
            out.append(Embedding(r.request_id, data, shape, dtype, extra=extra))
        return out

    def _rows_to_host(self, feats: Sequence[Any], wait: bool = True) -> tuple[Any, list[int]]:
        """All items' rows in one host tensor (one copy, pinned on a GPU) and each item's first row.

        ``wait=False`` (on a GPU): the copy runs on the host-copy stream once this stream has made
        the rows; the caller synchronizes that stream before reading the host tensor."""
        import torch

        offsets = [0]
        for f in feats:
            offsets.append(offsets[-1] + int(f.shape[0]))
        if not feats:
            return None, offsets
        rows = torch.cat(list(feats)) if len(feats) > 1 else feats[0]
        if rows.device.type != "cuda":
            return rows.contiguous(), offsets
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        if wait or self._host_stream is None:
            host.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(rows.device).synchronize()
            return host, offsets
        made = torch.cuda.Event()
        made.record()
        with torch.cuda.stream(self._host_stream):
            self._host_stream.wait_event(made)
            host.copy_(rows, non_blocking=True)
        rows.record_stream(self._host_stream)
        return host, offsets

    def _features(self, enc: Any, kinds: Sequence[str] = ()) -> list[Any]:
        """Per media item (``kinds``: each item's kind, in the batch's order), its embedding rows,
        from the model's own code."""
        import torch

        m = self.model.model
        dev = self.device
        if self.family == "llava_next":
            pv = enc["pixel_values"].to(dev, self.loaded.dtype)
            feats = m.get_image_features(  # image_sizes on the host: only read for shapes (no device sync)
                pv, enc["image_sizes"].cpu(),
                vision_feature_layer=self.loaded.config.vision_feature_layer,
                vision_feature_select_strategy=self.loaded.config.vision_feature_select_strategy,
            ).pooler_output
            return list(feats)
        if self.family == "qwen2_5_vl":  # the tower over every image's (video's) patches, split per item
            images, videos = [], []
            if "pixel_values" in enc:
                grid = enc["image_grid_thw"].to(dev)
                images = list(m.get_image_features(enc["pixel_values"].to(dev, self.loaded.dtype), grid).pooler_output)
            if "pixel_values_videos" in enc:
                grid = enc["video_grid_thw"].to(dev)
                videos = list(m.get_video_features(enc["pixel_values_videos"].to(dev, self.loaded.dtype),
                                                   grid).pooler_output)
            if not videos:
                return images
            next_image, next_video = iter(images), iter(videos)
            return [next(next_video) if k == "video" else next(next_image) for k in kinds]
        # qwen2_audio: what Qwen2AudioModel.forward does before merging (the class has no
        # get_audio_features): tower over the padded mels, projector, then each clip's valid rows
        from transformers.masking_utils import create_bidirectional_mask

        feats_in = enc["input_features"].to(dev, self.loaded.dtype)
        fmask = enc["feature_attention_mask"].to(dev)
        lengths, out_lengths = m.audio_tower._get_feat_extract_output_lengths(fmask.sum(-1))
        b, _, max_mel = feats_in.shape
        max_len = (max_mel - 2) // 2 + 1
        valid = torch.arange(max_len, device=dev)[None, :] < lengths[:, None]
        amask = create_bidirectional_mask(
            config=m.audio_tower.config,
            inputs_embeds=torch.zeros((b, max_len, 1), dtype=feats_in.dtype, device=dev),
            attention_mask=valid.long(),
        )
        hidden = m.audio_tower(feats_in, attention_mask=amask).last_hidden_state
        proj = m.multi_modal_projector(hidden)
        return [proj[i, : int(out_lengths[i])] for i in range(b)]

    def _stream_ctx(self, sm_share: float) -> Any:
        """The primary (encode) stream of the green-context level nearest ``sm_share`` of the GPU;
        the current stream without a pool, on the CPU, or at the whole GPU. The local prefill in
        the same process picks the same level's partner stream for the complementary share
        (``HFPrefillEngine._stream_ctx``), so the two run concurrently on disjoint SMs. The
        preprocessing and host-copy streams of the chunk pipeline stay plain streams."""
        import contextlib

        if self.pool is None or sm_share >= 1.0 or not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        levels = self.pool.levels
        if not levels:
            return contextlib.nullcontext()
        import torch

        want = round(sm_share * int(self.pool.total_sms))
        primary = min(levels, key=lambda s: abs(levels[s].sms - want))
        return torch.cuda.stream(self.pool.primary(primary))

    def _encode_on_share(self, batch: Sequence[EncodeInput], sm_share: float) -> list[Embedding]:
        with self._stream_ctx(sm_share):  # a thread's current stream: set in the thread that runs it
            return self._encode_sync(batch)

    async def encode(self, batch: Sequence[EncodeInput], sm_share: float = 1.0) -> list[Embedding]:
        return await asyncio.to_thread(self._encode_on_share, batch, sm_share)


CUDNN_SDPA_ENV = "EASERVE_CUDNN_SDPA"


def prefer_flash_prefill(device: str) -> bool:
    """Keep torch's SDPA off its cuDNN backend on a GPU (unless ``EASERVE_CUDNN_SDPA=1``); True when
    it was turned off here.

    Why: on the H200 (torch 2.11) torch picks cuDNN attention for a causal prefill, and cuDNN builds
    a graph for every new sequence length: 43 ms on the first call at a length, 0.28 ms on a repeat,
    against 0.24 / 0.22 ms for flash attention (``benchmarks/prefill_shapes.py``, run 11). Served
    prompts seldom repeat a length, so a 7B prefill paid it on nearly every request: 125 ms on the
    first call of a length against 65 ms repeated (the run-11 engine profile). The setting is
    process-wide; the decode step's attention is its own kernel, or pins an SDPA backend itself."""
    if not str(device).startswith("cuda") or os.environ.get(CUDNN_SDPA_ENV, "0") == "1":
        return False
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


class HFPrefillEngine(_Stage):
    """:class:`PrefillEngine`: merge rows with the model's placeholder logic, run the LM, sample, pack KV.

    On an encode GPU with an SM split, ``pool`` (a ``GreenContextPool``) gives the partner stream
    for the current share, so the prefill's kernels run on the SMs the partition record grants.
    Its attention runs on flash attention, not cuDNN (``prefer_flash_prefill``).
    """

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: Any = None, random_weights: bool = False,
                 trust_remote_code: bool = False, pool: Any = None, share: Any = None) -> None:
        """``share``: an engine of this process whose language model (weights) this one runs too
        (the aggregated worker's decode engine), instead of loading another copy."""
        super().__init__(path, "lm", device, dtype, random_weights, trust_remote_code,
                         loaded=getattr(share, "loaded", None))
        self.pool = pool
        self.keep_local = share is not None
        """Hand the cache over as the device tensor (``PrefillOutput.kv_local``), not as bytes."""
        self.flash_prefill = prefer_flash_prefill(device)

    def embed(self, ids: Any, rows: Any, extra: Mapping[str, Any] | None = None) -> Any:
        """The prompt's input embeddings with the media rows merged in by the model's own masks
        (Qwen2.5-VL with videos: ``extra["image_rows"]`` image rows first, then the videos')."""
        import torch

        m = self.model.model
        emb = m.get_input_embeddings()(ids)
        if rows is None or rows.numel() == 0:
            return emb
        rows = rows.to(emb.device, emb.dtype)
        if self.family == "llava_next":
            mask = m.get_placeholder_mask(ids, inputs_embeds=emb, image_features=rows)
        elif self.family == "qwen2_5_vl":
            n_img = int((extra or {}).get("image_rows", rows.shape[0]))
            images, videos = rows[:n_img], rows[n_img:]
            image_mask, video_mask = m.get_placeholder_mask(
                ids, inputs_embeds=emb, image_features=images if n_img else None,
                video_features=videos if videos.shape[0] else None)
            if n_img:
                emb = emb.masked_scatter(image_mask.to(torch.bool), images)
            if videos.shape[0]:
                emb = emb.masked_scatter(video_mask.to(torch.bool), videos)
            return emb
        else:
            mask = (ids == self.loaded.mm_token_id).unsqueeze(-1)
            if int(mask.sum()) != rows.shape[0]:
                raise ValueError(f"{int(mask.sum())} audio placeholders for {rows.shape[0]} embedding rows")
        return emb.masked_scatter(mask.to(torch.bool), rows)

    def positions(self, ids: Any, extra: Mapping[str, Any]) -> tuple[Any, int]:
        """The prompt's position ids for the language model and the decode offset (``rope_delta``).

        ``(None, 0)`` (the model's own 1-D positions) except for an M-RoPE family with media:
        then the model's ``get_rope_index`` over the ids and the grids that encode sent (images'
        ``image_grid_thw``; videos' ``video_grid_thw`` and ``second_per_grid_ts``), ``[3, 1, L]``,
        and the offset the next text positions carry."""
        import torch

        grid, vgrid = extra.get("image_grid_thw"), extra.get("video_grid_thw")
        if self.family not in MROPE_FAMILIES or not (grid or vgrid):
            return None, 0
        m = self.model.model
        video_id = getattr(self.loaded.config, "video_token_id", None)
        types = (ids == self.loaded.mm_token_id).to(torch.int32)  # 1: an image row, 2: a video row, 0: text
        if video_id is not None:
            types += 2 * (ids == video_id).to(torch.int32)
        secs = extra.get("second_per_grid_ts")
        pos, delta = m.get_rope_index(
            ids, types,
            image_grid_thw=torch.tensor(grid, device=ids.device) if grid else None,
            video_grid_thw=torch.tensor(vgrid, device=ids.device) if vgrid else None,
            second_per_grid_ts=torch.tensor(secs) if secs else None,
        )
        return pos, int(delta.reshape(-1)[0])

    def _stream_ctx(self, sm_share: float) -> Any:
        import contextlib

        if self.pool is None or sm_share >= 1.0 or not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        total = int(torch.cuda.get_device_properties(0).multi_processor_count)
        want = round(sm_share * total)  # this prefill's own SMs (the partner side of the split)
        levels = self.pool.levels
        if not levels:
            return contextlib.nullcontext()
        primary = min(levels, key=lambda s: abs(levels[s].partner_sms - want))
        return torch.cuda.stream(self.pool.partner(primary))

    def prefill_one(self, r: PrefillInput, sm_share: float = 1.0) -> PrefillOutput:
        import torch
        from transformers import DynamicCache

        ids_list = r.extra.get("input_ids")
        if not ids_list:
            raise ValueError(f"request {r.request_id}: no input_ids (the encode stage of a torch deployment sends them)")
        ids = torch.tensor([ids_list], device=self.device)
        rows = None
        if r.embedding is not None and getattr(r.embedding, "size", 0):
            arr = np.asarray(r.embedding)
            rows = (torch.from_numpy(arr.copy()).view(torch.bfloat16) if arr.dtype == np.uint16
                    else torch.from_numpy(arr.copy()))
        with torch.inference_mode(), self._stream_ctx(sm_share):
            emb = self.embed(ids, rows, r.extra)
            positions, delta = self.positions(ids, r.extra)
            cache = DynamicCache(config=self.loaded.text_config)
            out = self.model.model.language_model(inputs_embeds=emb, position_ids=positions, past_key_values=cache,
                                                  use_cache=True)
            logits = self.model.lm_head(out.last_hidden_state[:, -1])[0]
            token = sample(logits, r.sampling, 0)
            kv = stack_kv(cache)
            meta = kv_meta(kv) | {"tokens": len(ids_list)}
            if delta:
                meta["rope_delta"] = delta
            nbytes = kv.numel() * kv.element_size()
            if self.keep_local:  # a decode engine of this process takes the device tensor itself
                return PrefillOutput(r.request_id, token, nbytes, kv_meta=meta, kv_local=kv)
            if self.device.startswith("cuda"):  # the host copy waits for the handoff (deferred_pack)
                ready = torch.cuda.Event()
                ready.record()
                held = [kv]  # one holder: the IPC share or the host copy, whichever the handoff takes
                share = kv_ipc.deferred_share(held, ready) if kv_ipc.enabled() else None
                return PrefillOutput(r.request_id, token, nbytes, kv_meta=meta,
                                     pack_kv=deferred_pack(kv, ready, held), share_kv=share)
            data = _to_bytes(kv)
        return PrefillOutput(r.request_id, token, len(data), kv=data, kv_meta=meta)

    def _prefill_sync(self, batch: Sequence[PrefillInput], sm_share: float) -> list[PrefillOutput]:
        return [self.prefill_one(r, sm_share) for r in batch]

    async def prefill(self, batch: Sequence[PrefillInput], sm_share: float = 1.0) -> list[PrefillOutput]:
        return await asyncio.to_thread(self._prefill_sync, batch, sm_share)


SLOT_ATTENTION = "easerve_slot_sdpa"


def slot_decode_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' SDPA attention, with grouped-query decode folded so K/V are read once, never copied.

    Why: with an explicit mask (which a step over mixed lengths needs), transformers' SDPA path
    cannot use ``enable_gqa`` and calls ``repeat_kv``: every step materializes each slot's K and V
    ``num_key_value_groups`` times over the whole slot length (4x for Mistral-7B: ~5 GB written
    and read per layer at batch 128, context 2304), which made a decode step ~12x slower than
    the static-cache reference at large batch. For one query token per sequence, the query heads
    that share a KV head are just more query rows of that head: ``[n, kv_heads, groups, d]``
    attends to ``[n, kv_heads, L, d]`` under the same per-row mask, which is the same
    computation. Anything else (prefill, no mask, no GQA) goes to transformers' own SDPA.

    When the step passes each row's length (``KV_LENGTHS_KWARG``) and the split-KV kernel is
    chosen (the default on CUDA), the mask is not used at all: ``decode_attention.py`` reads each
    row's own prefix only, split over the SMs (the masked SDPA kernels cannot split one row).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    lengths = kwargs.get(KV_LENGTHS_KWARG)
    if query.shape[2] == 1 and lengths is not None and not dropout and _use_split_kv(query):
        from .decode_attention import split_kv_decode_attention

        n, heads, _, d = query.shape
        q = query.reshape(n, key.shape[1], groups, d)
        scale = scaling if scaling is not None else d ** -0.5
        out = split_kv_decode_attention(q, key, value, lengths, scale)
        return out.reshape(n, heads, 1, d).transpose(1, 2).contiguous(), None
    if query.shape[2] != 1 or groups == 1 or attention_mask is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **_library_kwargs(kwargs))
    n, heads, _, d = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(n, kv_heads, groups, d)  # query head h uses KV head h // groups (repeat_kv's order)
    out = _folded_attention(q, key, value, attention_mask, scaling)
    return out.reshape(n, heads, 1, d).transpose(1, 2).contiguous(), None


KV_LENGTHS_KWARG = "easerve_kv_lengths"
"""The keyword by which a decode step passes each row's attended length (its position + 1) down
through the model's forward to the attention function, next to the 4-D mask."""


def _library_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != KV_LENGTHS_KWARG}


DECODE_ATTENTION_KERNELS = ("auto", "split-kv", "sdpa", "math", "sdpa-efficient", "sdpa-cudnn")
_decode_kernel = os.environ.get("EASERVE_DECODE_ATTN", "auto")


def set_decode_attention_kernel(name: str) -> None:
    """Which kernel the decode attention runs (benchmarks compare them; CUDA graphs captured
    before a change keep the kernel they were captured with): ``auto`` (``split-kv`` on a CUDA
    device when Triton imports, else ``sdpa``), ``split-kv`` (``decode_attention.py``: Triton
    flash-decoding over each row's own length, no mask; on a CPU only under
    ``TRITON_INTERPRET=1``), ``sdpa`` (torch picks, under the mask), ``math`` (two batched
    matmuls and a float32 softmax), ``sdpa-efficient`` / ``sdpa-cudnn`` (one SDPA backend
    forced). All compute the same attention."""
    global _decode_kernel
    if name not in DECODE_ATTENTION_KERNELS:
        raise ValueError(f"decode attention kernel {name!r}: one of {', '.join(DECODE_ATTENTION_KERNELS)}")
    _decode_kernel = name


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # CPU builds of torch come without it
        return False
    return True


def _use_split_kv(query: Any) -> bool:
    if _decode_kernel == "split-kv":
        return _triton_available()
    return _decode_kernel == "auto" and query.is_cuda and _triton_available()


def _folded_attention(q: Any, key: Any, value: Any, mask: Any, scaling: float | None) -> Any:
    """Attention of ``q [n, kv_heads, groups, d]`` over ``key/value [n, kv_heads, L, d]`` under a
    boolean ``mask [n, 1, 1, L]`` (True: attend), by the kernel ``set_decode_attention_kernel`` chose."""
    import torch

    f = torch.nn.functional
    if _decode_kernel == "math":
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    if _decode_kernel in ("sdpa-efficient", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.EFFICIENT_ATTENTION if _decode_kernel == "sdpa-efficient" else SDPBackend.CUDNN_ATTENTION
        with sdpa_kernel([backend]):
            return f.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return f.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)


def _register_slot_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SLOT_ATTENTION, slot_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SLOT_ATTENTION, sdpa_mask)


KV_BUCKET_STEP = 512


def kv_bucket(need: int, max_len: int) -> int:
    """The attended K/V length for a step whose longest row needs ``need`` positions: a power of
    two from 256 up to 1024, then the next multiple of 512, capped at the slot length, so short
    contexts do not read the whole slot and CUDA graphs are captured per bucket, not per length.

    Why 512 steps past 1024: a LLaVA-NeXT prompt with one 1080p image is ~2,900 tokens; the next
    power of two (4,096) made every step read ~40 % more K/V than the rows hold."""
    b = 256
    while b < need and b < 1024:
        b *= 2
    if b < need:
        b = -(-need // KV_BUCKET_STEP) * KV_BUCKET_STEP
    return min(b, max_len)


class SlotCache:
    """The ``past_key_values`` object of one decode step over slots ``rows`` (transformers calls ``update``).

    Each row writes its new key/value at its own position ``pos[row]`` and gets back the slot's
    first ``kv_len`` keys/values (a bucket covering the longest row, not the whole slot); the 4-D
    mask passed with it hides what lies past each prefix.
    """

    is_compileable = False

    def __init__(self, keys: list[Any], values: list[Any], n: int, pos: Any, kv_len: int | None = None) -> None:
        import torch

        self.keys = [k[:n, :, :kv_len] for k in keys]
        self.values = [v[:n, :, :kv_len] for v in values]
        self.pos = pos
        self.rows = torch.arange(n, device=pos.device)

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self.rows, :, self.pos] = key_states[:, :, 0].to(k.dtype)
        v[self.rows, :, self.pos] = value_states[:, :, 0].to(v.dtype)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.pos.max().item()) if self.pos.numel() else 0


STAGE_ENV = "EASERVE_KV_STAGE"
DEFAULT_STAGE_BUFFERS = 4


def _new_decode_stats() -> dict[str, Any]:
    """Counters of the decode engine (cumulative; ``benchmarks/gpu_serve.py`` takes differences)."""
    return {"steps": 0, "rows": 0, "step_s": 0.0, "forward_ms": 0.0, "sample_ms": 0.0,
            "admits": 0, "admit_s": 0.0, "admit_wait_s": 0.0, "admit_unstaged": 0, "unstaged_load_s": 0.0,
            "staged": 0, "stage_s": 0.0, "stage_bytes": 0, "releases": 0, "release_s": 0.0,
            "captures": 0, "capture_s": 0.0, "ipc_opened": 0, "ipc_open_s": 0.0, "kv_len": {}, "batch_bucket": {}}


def host_kv_to_device(data: Any, meta: Mapping[str, Any], *, dtype: Any, device: Any, stream: Any,
                      lock: Any, pinned: bool = True, dst: Any | None = None, free_after: Any = None) -> Any:
    """Host bytes of a cache (``pack_kv``'s) -> a device tensor, in ``dst``'s memory when given.

    Why a module function: the decode engine's staging and admission use it, and so does
    ``benchmarks/kv_handoff.py``, which times the host path against CUDA IPC with this very code.
    On CUDA the bytes go through a pinned host tensor and ``stream`` (after ``free_after``, the
    event of the last copy that read ``dst``); every CUDA call is made under ``lock`` (the engine's
    capture lock: nothing beside a graph capture). Blocking: call it in a thread.
    """
    import torch

    kv = unpack_kv(data, meta)
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    out = dst[: kv.numel()].view(kv.shape) if dst is not None else None
    if stream is None:  # no CUDA
        if out is None:
            return kv.to(device)
        out.copy_(kv)
        return out
    if pinned:
        with lock:  # pinning memory is not allowed while a graph is being captured
            pin = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        pin.copy_(kv)  # a host copy (torch's threads): no CUDA call, no lock
        kv = pin
    with lock:
        with torch.cuda.stream(stream):
            if free_after is not None:
                stream.wait_event(free_after)  # its last slot copy has read it
            if out is None:
                out = torch.empty(kv.shape, dtype=kv.dtype, device=device)
            out.copy_(kv, non_blocking=True)
        stream.synchronize()
    return out


class HFDecodeEngine(_Stage):
    """:class:`SlotDecodeEngine`: continuous batching over KV slots, resuming from handed-over caches.

    Handed-over caches reach the device BEFORE their sequence is admitted (``stage``): a fixed set
    of device staging buffers (``EASERVE_KV_STAGE``, default 4, each one slot's size, taken from
    the same KV budget as the slots, so GPU memory stays bounded) receives each arriving cache on
    a side stream, in a worker thread; admission then only copies it into its slot on the device
    (one kernel per K and V). Why: loading a ~390 MB cache at admission (a pageable host-to-device
    copy on the step's stream, from the event loop) stalled every running sequence for the copy.
    A cache that finds no free buffer waits in host memory and is staged when one frees up (or
    loaded at admission, off the loop, if its turn comes first).
    """

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: Any = None, random_weights: bool = False,
                 trust_remote_code: bool = False, memory_fraction: float = 0.9, max_len: int | None = None,
                 max_slots: int | None = None, cuda_graphs: bool | None = None,
                 stage_buffers: int | None = None) -> None:
        super().__init__(path, "lm", device, dtype, random_weights, trust_remote_code)
        import torch

        _register_slot_attention()
        self.model.model.language_model.config._attn_implementation = SLOT_ATTENTION
        tc = self.loaded.text_config
        self.layers = int(tc.num_hidden_layers)
        self.kv_heads = int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
        self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self.max_len = int(max_len or os.environ.get("EASERVE_TORCH_MAX_LEN", 0) or
                           min(DEFAULT_MAX_LEN, int(getattr(tc, "max_position_embeddings", DEFAULT_MAX_LEN))))
        itemsize = torch.tensor([], dtype=self.loaded.dtype).element_size()
        self.slot_bytes = 2 * self.layers * self.kv_heads * self.max_len * self.head_dim * itemsize
        want_stage = int(stage_buffers if stage_buffers is not None else os.environ.get(STAGE_ENV, DEFAULT_STAGE_BUFFERS))
        self.slots, self.stage_buffers = self._slots(memory_fraction, max_slots, max(0, want_stage))
        shape = (self.layers, self.slots, self.kv_heads, self.max_len, self.head_dim)
        # one tensor per K and V (a layer's slots are a view): a slot is filled or moved in one copy
        self.K = torch.zeros(shape, dtype=self.loaded.dtype, device=device)
        self.V = torch.zeros(shape, dtype=self.loaded.dtype, device=device)
        self.k = list(self.K.unbind(0))
        self.v = list(self.V.unbind(0))
        self.slot_of: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self.sampling: dict[str, Sampling | None] = {}
        self.rope_delta: dict[str, int] = {}
        """Per sequence, its rotary offset (M-RoPE families): it rotates by slot position + delta."""
        self.mrope = self.family in MROPE_FAMILIES
        self.cuda_graphs = device.startswith("cuda") if cuda_graphs is None else cuda_graphs
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any]]] = {}
        self.kv_bytes_in = 0
        self._cuda = str(device).startswith("cuda")
        elems = self._stage_elems = self.slot_bytes // itemsize
        # (buffer, event after which it may be overwritten: its last slot copy), free for a cache
        self._stage_free: list[tuple[Any, Any]] = [
            (torch.empty(elems, dtype=self.loaded.dtype, device=device), None) for _ in range(self.stage_buffers)
        ]
        self._staged: dict[str, tuple[Any, Any]] = {}  # request id -> (its copy task, its buffer)
        self._copy_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._capture_lock = threading.Lock()
        """Held by a CUDA graph capture and by a staging copy: a capture (global mode) fails if another
        thread synchronizes or allocates meanwhile, and a failed capture would leave decode eager."""
        self._staging_failed = False
        self.pinned = kv_pinned()
        """Copy a cache into pinned host memory before the host-to-device copy (else: pageable)."""
        self.stats = _new_decode_stats()
        if self.cuda_graphs:
            self.precapture(float(os.environ.get(PRECAPTURE_ENV, DEFAULT_PRECAPTURE_S)))

    def graph_buckets(self) -> list[tuple[int, int]]:
        """Every (batch bucket, K/V length bucket) a step can use, small batches and short contexts
        first: the images of ``_bucket`` and ``kv_bucket`` (the rules a step picks its graph by)."""
        batches = sorted({self._bucket(n) for n in range(1, self.slots + 1)})
        lengths = sorted({kv_bucket(n, self.max_len) for n in range(1, self.max_len + 1)})
        return [(b, k) for b in batches for k in lengths]

    def precapture(self, budget_s: float) -> int:
        """Capture the step's CUDA graphs before serving, within ``budget_s`` seconds (what is left
        is captured on first use, as before); returns how many were captured. Safe only while no
        sequence holds a slot: a capture writes K/V into slots 0..b-1 (``capture_inputs``)."""
        import time

        if budget_s <= 0 or self.slot_of:
            return 0
        t0, done, buckets = time.perf_counter(), 0, self.graph_buckets()
        for b, kv_len in buckets:
            if time.perf_counter() - t0 > budget_s:
                break
            if (b, kv_len) in self._graphs:
                continue
            try:
                self._capture(b, kv_len)
            except Exception as exc:  # noqa: BLE001 - as on first use: a step that cannot be captured runs eagerly
                log.warning("decode: CUDA graph capture failed (%r); decoding eagerly", exc)
                self.cuda_graphs = False
                break
            done += 1
        self.stats["precaptured"] = done
        self.stats["precapture_s"] = round(time.perf_counter() - t0, 3)
        log.info("decode: %d CUDA graphs captured at start-up in %.1f s (%d buckets)", done,
                 self.stats["precapture_s"], len(buckets))
        return done

    def _slots(self, fraction: float, max_slots: int | None, stage: int) -> tuple[int, int]:
        import torch

        # spec.decode.kvMemoryFraction has vLLM's gpu_memory_utilization meaning (the same figure the
        # twin's decode admission uses), per instance: see kv_budget_bytes. On a CPU, that share of
        # what is available. The staging buffers come out of the same budget, one slot's size each,
        # never the last slot.
        if self.device.startswith("cuda"):
            dev = torch.device(self.device)
            free, total = torch.cuda.mem_get_info(dev)
            budget = kv_budget_bytes(fraction, total, free, torch.cuda.memory_reserved(dev))
        else:
            free = budget = fraction * _mem_available()
        units = int(max(0.0, budget) // self.slot_bytes)
        stage = min(stage, max(0, units - 1))
        n = min(units - stage, max_slots or DEFAULT_MAX_SLOTS)
        if n < 1:
            raise MemoryError(
                f"spec.decode.kvMemoryFraction: {fraction} leaves {max(0.0, budget) / 2**30:.1f} GiB "
                f"({free / 2**30:.1f} GiB free) for KV, no slot of "
                f"{self.slot_bytes / 2**20:.0f} MiB (max_len {self.max_len})"
            )
        log.info("decode: %d KV slots of %d tokens (%.1f MiB each), %d staging buffers", n, self.max_len,
                 self.slot_bytes / 2**20, stage)
        return n, stage

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.slot_of)

    # -- SlotDecodeEngine -----------------------------------------------------------------------
    def can_admit(self, seq: DecodeSequence) -> bool:
        return self.free_slots > 0

    def fits(self, seq: DecodeSequence) -> bool:
        return seq.context_tokens + seq.max_tokens <= self.max_len

    async def receive_kv(self, kv_bytes: int) -> None:
        self.kv_bytes_in += kv_bytes  # the bytes themselves arrive with the sequence (seq.kv)

    def stage(self, seq: DecodeSequence) -> Any:
        """Start copying ``seq.kv`` to the device in the background, if a staging buffer is free.

        Returns the copy's task (``admit`` takes the staged cache; awaiting the task only waits
        for the copy), or None when nothing was started (no free buffer, no host bytes, or a
        sequence that does not fit: ``admit`` reports that). Call from the event loop."""
        if ((seq.kv is None and seq.kv_ipc is None) or seq.request_id in self._staged or not self._stage_free
                or not self.fits(seq) or not seq.kv_meta):
            return None
        shape = [int(x) for x in seq.kv_meta.get("shape", ())]
        if len(shape) != 5 or int(np.prod(shape)) > self._stage_elems:
            return None
        if self._staging_failed:
            return None
        buf, free_after = self._stage_free.pop()
        data, meta = seq.kv, dict(seq.kv_meta)
        if seq.kv_ipc is not None:  # another process's device tensor: mapped and copied into the buffer
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._open_kv, seq.kv_ipc, buf, free_after))
        else:
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._stage_sync, data, meta, buf, free_after))
        self._staged[seq.request_id] = (task, buf)
        return task

    def check_kv_share(self, desc: Mapping[str, Any]) -> None:
        """Raise ``kv_ipc.KVIPCRefused`` unless this engine can map ``desc`` (its GPU, CUDA)."""
        kv_ipc.check(desc, self.device)

    def _open_kv(self, desc: Mapping[str, Any], dst: Any = None, after: Any = None) -> Any:
        """The cache a prefill process on this GPU left on the device (``kv_ipc``): mapped, copied
        device to device (into ``dst`` when given), unmapped. Blocking (call it in a thread)."""
        import time

        t0 = time.perf_counter()
        with self._capture_lock:  # no CUDA API call beside a graph being captured
            kv = kv_ipc.open_shared(desc, self.device, dst, after)
        self.stats["ipc_opened"] += 1
        self.stats["ipc_open_s"] += time.perf_counter() - t0
        return kv

    def discard(self, request_id: str) -> None:
        """A sequence that will never be admitted: give its staging buffer back once its copy ends."""
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            task, buf = staged
            task.add_done_callback(lambda _t: self._stage_free.append((buf, None)))

    def _to_device(self, data: Any, meta: Mapping[str, Any], dst: Any | None, free_after: Any) -> Any:
        """Host bytes of a cache -> a device tensor (``dst``'s memory when given), on the side stream;
        returns once the copy is complete (blocking: call it in a thread)."""
        return host_kv_to_device(data, meta, dtype=self.loaded.dtype, device=self.device,
                                 stream=self._copy_stream, lock=self._capture_lock, pinned=self.pinned,
                                 dst=dst, free_after=free_after)

    def _stage_sync(self, data: Any, meta: Mapping[str, Any], buf: Any, free_after: Any) -> Any:
        import time

        t0 = time.perf_counter()
        out = self._to_device(data, meta, buf, free_after)
        self.stats["staged"] += 1
        self.stats["stage_s"] += time.perf_counter() - t0
        self.stats["stage_bytes"] += out.numel() * out.element_size()
        return out

    async def admit(self, seq: DecodeSequence) -> None:
        import time

        import torch

        t0 = time.perf_counter()
        staged = self._staged.pop(seq.request_id, None)
        buf = None
        try:
            if staged is None and seq.kv is None and seq.kv_local is None and seq.kv_ipc is None:
                raise ValueError(f"request {seq.request_id}: no KV cache handed over")
            if not self.fits(seq):
                raise ValueError(
                    f"request {seq.request_id}: context {seq.context_tokens} + max_tokens {seq.max_tokens} "
                    f"exceeds the decode slot length {self.max_len}"
                )
            kv = None
            if staged is not None:
                task, buf = staged
                try:
                    kv = await task
                except kv_ipc.KVIPCRefused:  # not opened again (it may have been mapped once): host bytes follow
                    raise
                except Exception as exc:  # noqa: BLE001 - load it the other way; stage no more
                    log.warning("decode: staging a KV cache failed (%r); loading caches at admission", exc)
                    self._staging_failed = True
                self.stats["admit_wait_s"] += time.perf_counter() - t0
            if kv is None and seq.kv_local is not None:  # prefilled in this process: already on the device
                kv = seq.kv_local
                if kv.device != self.K.device or kv.dtype != self.K.dtype:
                    kv = kv.to(self.K.device, self.K.dtype)
            if kv is None and seq.kv_ipc is not None:  # a same-GPU share no buffer was free for: copy it now
                kv = await asyncio.to_thread(self._open_kv, seq.kv_ipc)
                self.stats["admit_unstaged"] += 1
            if kv is None:  # no buffer was free when it arrived: load it now, off the loop and the step's stream
                t1 = time.perf_counter()
                kv = await asyncio.to_thread(self._to_device, seq.kv, seq.kv_meta, None, None)
                self.stats["admit_unstaged"] += 1
                self.stats["unstaged_load_s"] += time.perf_counter() - t1
            layers, two, heads, t, d = kv.shape
            if (layers, two, heads, d) != (self.layers, 2, self.kv_heads, self.head_dim) or t != seq.context_tokens:
                raise ValueError(f"request {seq.request_id}: KV shape {tuple(kv.shape)} does not fit this model")
            slot = len(self.slot_of)
            with torch.inference_mode():
                self.K[:, slot, :, :t] = kv[:, 0]
                self.V[:, slot, :, :t] = kv[:, 1]
        finally:
            if buf is not None:  # reusable once the slot copies (queued on this stream) have read it
                ev = None
                if self._cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                self._stage_free.append((buf, ev))
        self.slot_of[seq.request_id] = slot
        self.length[seq.request_id] = t
        self.sampling[seq.request_id] = seq.sampling
        if self.mrope:
            self.rope_delta[seq.request_id] = int((seq.kv_meta or {}).get("rope_delta", 0))
        seq.kv = seq.kv_local = seq.kv_ipc = None  # the slot holds it now
        self.stats["admits"] += 1
        self.stats["admit_s"] += time.perf_counter() - t0

    def release(self, request_id: str) -> None:
        import time

        t0 = time.perf_counter()
        slot = self.slot_of.pop(request_id, None)
        self.length.pop(request_id, None)
        self.sampling.pop(request_id, None)
        self.rope_delta.pop(request_id, None)
        if slot is None:
            return
        last = len(self.slot_of)
        if slot != last:  # keep running sequences in slots 0..n-1: move the last one into the hole
            mover = next(r for r, s in self.slot_of.items() if s == last)
            n = self.length[mover]
            self.K[:, slot, :, :n] = self.K[:, last, :, :n]
            self.V[:, slot, :, :n] = self.V[:, last, :, :n]
            self.slot_of[mover] = slot
        self.stats["releases"] += 1
        self.stats["release_s"] += time.perf_counter() - t0

    def _forward(self, ids: Any, pos: Any, n: int, kv_len: int | None = None, rope_pos: Any = None) -> Any:
        """Logits of one step over slots 0..n-1 (ids/pos indexed by slot), attending to ``kv_len`` positions.

        ``pos`` is where each row's K/V goes in its slot; ``rope_pos`` (default ``pos``) is the
        position its rotary embedding uses (M-RoPE: ``pos`` + the request's delta)."""
        import torch

        kv_len = kv_len or self.max_len
        rope_pos = pos if rope_pos is None else rope_pos
        lm = self.model.model.language_model
        steps = torch.arange(kv_len, device=ids.device)
        mask = (steps[None, :] <= pos[:, None])[:, None, None, :]
        cache = SlotCache(self.k, self.v, n, pos, kv_len)
        emb = lm.get_input_embeddings()(ids[:, None])
        h = lm(inputs_embeds=emb, position_ids=rope_pos[:, None], attention_mask=mask, past_key_values=cache,
               use_cache=True, **{KV_LENGTHS_KWARG: pos + 1}).last_hidden_state
        return self.model.lm_head(h[:, -1])

    def _bucket(self, n: int) -> int:
        b = 1
        while b < n:
            b *= 2
        return min(b, self.slots)

    def _graph_logits(self, ids: Any, pos: Any, n: int, kv_len: int, rope_pos: Any = None) -> Any:
        """CUDA-graph replay of the step for the (batch bucket >= n, K/V length bucket) pair (captured on first use)."""

        b = self._bucket(n)
        if (b, kv_len) not in self._graphs:
            try:
                self._capture(b, kv_len)
            except Exception as exc:  # a model whose step cannot be captured still decodes, eagerly
                log.warning("decode: CUDA graph capture failed (%r); decoding eagerly", exc)
                self.cuda_graphs = False
                return self._forward(ids, pos, n, kv_len, rope_pos)
        g, st = self._graphs[(b, kv_len)]
        st["ids"].zero_()
        st["pos"].zero_()  # padding rows (free slots) write at position 0 of a free slot: harmless
        st["ids"][:n] = ids
        st["pos"][:n] = pos
        if "rope" in st:
            st["rope"].zero_()
            st["rope"][:n] = pos if rope_pos is None else rope_pos
        g.replay()
        return st["out"][:n]

    def capture_inputs(self, b: int, kv_len: int) -> dict[str, Any]:
        """The static ids and positions a graph of bucket ``(b, kv_len)`` is warmed up and captured with.

        The warm-up and capture steps really run, so they write K/V for every row at its static
        position in slots 0..b-1, and running sequences occupy the first of those slots. The
        position is therefore ``kv_len - 1``: at or past every running row's length (the bucket
        covers the longest row + 1), where a row writes its own K/V before it ever attends it.
        Position 0 (as before) overwrote each running sequence's first cached token whenever a
        new bucket was captured mid-serving (found by the GPU graph-vs-eager test)."""
        import torch

        return {"ids": torch.zeros(b, dtype=torch.long, device=self.device),
                "pos": torch.full((b,), kv_len - 1, dtype=torch.long, device=self.device)}

    def _capture(self, b: int, kv_len: int) -> None:
        """Capture the step over slots 0..b-1 with static ids/positions (warm-up on a side stream first)."""
        import time

        import torch

        t0 = time.perf_counter()
        st = self.capture_inputs(b, kv_len)
        if self.mrope:  # a rotary position of its own per row (slot position + the request's delta)
            st["rope"] = torch.zeros(b, dtype=torch.long, device=self.device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._forward(st["ids"], st["pos"], b, kv_len, st.get("rope"))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with self._capture_lock, torch.cuda.graph(g):
            st["out"] = self._forward(st["ids"], st["pos"], b, kv_len, st.get("rope"))
        self._graphs[(b, kv_len)] = (g, st)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0

    def _step_sync(self, batch: Sequence[DecodeSequence]) -> list[int]:
        import time

        import torch

        t0 = time.perf_counter()
        n = len(batch)
        if n != len(self.slot_of):
            raise RuntimeError(f"decode step over {n} sequences but {len(self.slot_of)} hold slots")
        by_slot: list[DecodeSequence | None] = [None] * n
        for s in batch:
            by_slot[self.slot_of[s.request_id]] = s
        seqs = [s for s in by_slot if s is not None]
        lengths = [self.length[s.request_id] for s in seqs]
        ids = torch.tensor([s.generated[-1] for s in seqs], device=self.device)
        pos = torch.tensor(lengths, device=self.device)
        rope_pos = (torch.tensor([n + self.rope_delta.get(s.request_id, 0) for n, s in zip(lengths, seqs, strict=True)],
                                 device=self.device) if self.mrope else None)
        kv_len = kv_bucket(max(lengths) + 1, self.max_len)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self._cuda else None
        with torch.inference_mode():
            if ev:
                ev[0].record()
            logits = (self._graph_logits(ids, pos, n, kv_len, rope_pos) if self.cuda_graphs
                      else self._forward(ids, pos, n, kv_len, rope_pos))
            if ev:
                ev[1].record()
            # every row at once on the device, one sync (greedy and sampled rows alike)
            drawn_t = sample_rows_tensor(logits, [self.sampling[s.request_id] for s in seqs],
                                         [len(s.generated) for s in seqs])
            if ev:
                ev[2].record()
            drawn = drawn_t.tolist()
        st = self.stats
        st["steps"] += 1
        st["rows"] += n
        st["step_s"] += time.perf_counter() - t0
        st["kv_len"][str(kv_len)] = st["kv_len"].get(str(kv_len), 0) + 1
        bb = str(self._bucket(n))
        st["batch_bucket"][bb] = st["batch_bucket"].get(bb, 0) + 1
        if ev:
            st["forward_ms"] += ev[0].elapsed_time(ev[1])
            st["sample_ms"] += ev[1].elapsed_time(ev[2])
        tok: dict[str, int] = {}
        for row, s in enumerate(seqs):
            rid = s.request_id
            self.length[rid] += 1
            tok[rid] = int(drawn[row])
        return [tok[s.request_id] for s in batch]

    async def decode_step(self, batch: Sequence[DecodeSequence]) -> list[int]:
        if not batch:
            return []
        return await asyncio.to_thread(self._step_sync, batch)


KV_FREE_HEADROOM_BYTES = 2**30
"""What the decode's KV leaves free on the card, at most: room for the first activations of the
processes that share it."""


def kv_budget_bytes(fraction: float, total: int, free: int, own: int,
                    headroom: int = KV_FREE_HEADROOM_BYTES) -> float:
    """Bytes of KV a decode process may allocate on a card of ``total`` bytes.

    ``spec.decode.kvMemoryFraction`` is a per-instance share, as vLLM's gpu_memory_utilization is:
    this process's own allocations (``own``: its weights, what its allocator holds) plus its KV
    fill at most ``fraction`` of the card, whatever other processes hold there. Counting the
    others' memory instead made the KV depend on start order when pods share a card: on one
    H100 a decode that started after its encode and prefill neighbours got 8 slots of 4096
    tokens and served 3.9 of 5.5 req/s offered; one that started first got 36. The share is
    also never more than is free now, less ``headroom``: a card that others have filled gives
    what it has (and the engine fails with a clear error when that is not one slot)."""
    return min(fraction * total - own, free - headroom)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30
