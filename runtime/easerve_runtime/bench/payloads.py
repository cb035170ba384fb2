"""Media payloads for the load client: real headers, declared sizes, almost no CPU.

A 720x1280 image must *say* it is 720x1280 (the frontend sizes work from headers, like the real
preprocessor), but the load client must not spend its two cores encoding photos. A solid-colour
PNG deflates to a few KB whatever its size, WAV silence at 8 kHz/8-bit is 8 KB per second, and a
video is an MP4 ``ftyp`` box with the frame count passed alongside. Each payload is built once
per distinct size and cached.
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
    if kind == "audio":
        return base64.b64encode(wav(*key)).decode()
    return base64.b64encode(mp4()).decode()


def media_part(modality: str, media: dict[str, Any]) -> dict[str, Any] | None:
    """The OpenAI content part for one media descriptor (None for text-only requests)."""
    if modality == "image":
        data = _b64("image", (int(media["height"]), int(media["width"])))
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    if modality == "audio":
        return {
            "type": "input_audio",
            "input_audio": {"data": _b64("audio", (float(media["audio_s"]),)), "format": "wav"},
        }
    if modality == "video":
        data = _b64("video", ())
        return {
            "type": "video_url",
            "video_url": {"url": f"data:video/mp4;base64,{data}", "frames": int(media["frames"])},
        }
    return None


def chat_body(req: Request, model: str, stream: bool = True, chars_per_token: int = 4) -> dict[str, Any]:
    """The chat-completions body for a workload request (prompt padded to its token count)."""
    text = ("lorem " * (req.prompt_tokens * chars_per_token // 6 + 1))[
        : max(1, req.prompt_tokens * chars_per_token)
    ]
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    part = media_part(req.modality, req.media)
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
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
