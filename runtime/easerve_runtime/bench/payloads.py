"""Media payloads for the load client: real headers, declared sizes, almost no CPU.

A 720x1280 image must *say* it is 720x1280 (the frontend sizes work from headers, like the real
preprocessor), but the load client must not spend its two cores encoding photos. A solid-colour
PNG deflates to a few KB whatever its size, WAV silence at 8 kHz/8-bit is 8 KB per second, and a
video is an MP4 ``ftyp`` box with the frame count passed alongside. Each payload is built once
per distinct size and cached.

``--image-format jpeg`` sends photo-like JPEGs instead (a smooth colour field plus grain, quality
90, built with Pillow): what real clients send, and what the encode worker's GPU decode (nvJPEG)
takes. It costs the client a few ms per distinct size, once. A video is then sent as its frames
(a ``video`` part of JPEG data URLs, the form the torch engine serves), not as a container.
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from typing import Any

from easerve_runtime.workload.request import Request


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


@functools.lru_cache(maxsize=64)
def png(height: int, width: int) -> bytes:
    """A valid grey RGB PNG of the given size."""
    row = b"\x00" + b"\x80" * (3 * width)
    raw = row * height
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw, 1))
        + _png_chunk(b"IEND", b"")
    )


@functools.lru_cache(maxsize=64)
def jpeg(height: int, width: int) -> bytes:
    """A photo-like RGB JPEG of the given size (seeded by the size: the same bytes every run)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(height * 100_003 + width)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, size=(1, 1, 3)).astype(np.float32)
    field = 127.5 + 90.0 * np.sin(6.0 * x + 4.0 * y + phase) * np.cos(3.0 * y - 2.0 * x)
    grain = rng.normal(0.0, 12.0, size=(height, width, 3)).astype(np.float32)
    pixels = np.clip(field + grain, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=90)
    return out.getvalue()


IMAGE_FORMATS = ("png", "jpeg")


@functools.lru_cache(maxsize=256)
def wav(seconds: float, rate: int = 8000) -> bytes:
    """A valid mono 8-bit PCM WAV of silence lasting ``seconds``."""
    n = int(round(seconds * rate))
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", n) + b"\x80" * n
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


@functools.lru_cache(maxsize=8)
def mp4() -> bytes:
    """An MP4 container header (ftyp box) with a little padding."""
    ftyp = b"ftyp" + b"isom" + struct.pack(">I", 512) + b"isomiso2mp41"
    return struct.pack(">I", 8 + len(ftyp) - 4) + ftyp + b"\x00" * 64


@functools.lru_cache(maxsize=512)
def _b64(kind: str, key: tuple[Any, ...]) -> str:
    if kind == "image":
        return base64.b64encode(png(*key)).decode()
    if kind == "jpeg":
        return base64.b64encode(jpeg(*key)).decode()
    if kind == "audio":
        return base64.b64encode(wav(*key)).decode()
    return base64.b64encode(mp4()).decode()


def media_part(modality: str, media: dict[str, Any], image_format: str = "png") -> dict[str, Any] | None:
    """The OpenAI content part for one media descriptor (None for text-only requests)."""
    if modality == "image":
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"image format {image_format!r}: one of {', '.join(IMAGE_FORMATS)}")
        size = (int(media["height"]), int(media["width"]))
        if image_format == "jpeg":
            return {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{_b64('jpeg', size)}"}}
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64('image', size)}"}}
    if modality == "audio":
        return {
            "type": "input_audio",
            "input_audio": {"data": _b64("audio", (float(media["audio_s"]),)), "format": "wav"},
        }
    if modality == "video":
        if image_format == "jpeg":  # the video as its frames (what the torch engine decodes, on nvJPEG)
            size = (int(media.get("height", 448)), int(media.get("width", 448)))
            frame = f"data:image/jpeg;base64,{_b64('jpeg', size)}"
            return {"type": "video", "video": [frame] * int(media["frames"])}
        data = _b64("video", ())
        return {
            "type": "video_url",
            "video_url": {"url": f"data:video/mp4;base64,{data}", "frames": int(media["frames"])},
        }
    return None


PROMPT_FILLER = " the"
"""What a request's text prompt is made of: one token per 4 characters both to the byte-level BPE
that ``easerve model init`` trains and to Llama's and Mistral's tokenizers (``▁the``), which is
what the sim path's estimate (``workers.openai.CHARS_PER_TOKEN``) assumes. Until 2026-12-07 it was
``"lorem "``, which the local BPE splits into 5 tokens: a 128-token prompt reached the torch
engine as 427, so every GPU run up to run 32 prefilled ~300 more tokens a request than its
workload (and the twin) said (docs/benchmarks.md, "Runs 30-32")."""


def chat_body(
    req: Request,
    model: str,
    stream: bool = True,
    chars_per_token: int = 4,
    image_format: str = "png",
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """The chat-completions body for a workload request (prompt padded to its token count).

    The padding is ``PROMPT_FILLER`` repeated: one token per 4 characters to a real tokenizer, so
    a request of N prompt tokens reaches the model as N tokens (plus the chat template's)."""
    text = (PROMPT_FILLER * (req.prompt_tokens * chars_per_token // len(PROMPT_FILLER) + 1))[
        : max(1, req.prompt_tokens * chars_per_token)
    ]
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    part = media_part(req.modality, req.media, image_format)
    if part is not None:
        content.append(part)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": req.output_tokens,
        "stream": stream,
        "seed": zlib.crc32(req.id.encode()) & 0x7FFFFFFF,
        "priority": req.priority,
    }
    if ignore_eos:  # every request generates its max_tokens (a random-weight model stops at once)
        body["ignore_eos"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
