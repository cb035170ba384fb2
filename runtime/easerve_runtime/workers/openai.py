"""Parse and validate an OpenAI chat-completions request into what the runtime serves. Pure.

Every rejection is a :class:`RequestError` with an HTTP status and a message that names the
offending field by its JSON path (``messages[0].content[1].image_url.url: ...``), so a client can
fix its request without reading our code. Nothing accepted is silently dropped: a part we cannot
serve is an error, not an omission.

Media are sized from their headers only (PNG/JPEG/GIF/WebP/BMP dimensions, WAV duration): the
full decode is the encoder's job, and header sizes are what the sim engine and the twin charge
work from (``workload.items_tokens``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.api import Modality
from easerve_runtime.engines.base import MediaPart

MAX_PART_BYTES = 20 * 1024 * 1024
"""Largest decoded media part (OpenAI's own limit for images is 20 MB)."""
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_PARTS = 64
MAX_OUTPUT_TOKENS = 8192
DEFAULT_MAX_TOKENS = 256
DEFAULT_VIDEO_FRAMES = 16
VIDEO_SIDE = 448
CHARS_PER_TOKEN = 4
"""Text tokens are estimated as ceil(chars / 4) (no tokenizer in the sim path)."""

ROLES = ("system", "user", "assistant", "tool", "developer")
ACCEPTS: dict[str, tuple[str, ...]] = {
    Modality.IMAGE: ("image",),
    Modality.VIDEO: ("image", "video"),
    Modality.AUDIO: ("audio",),
    Modality.OMNI: ("image", "video", "audio"),
}
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w-]+=[\w.-]+)*)(;base64)?,(.*)$", re.S)


class RequestError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class ChatRequest:
    model: str
    parts: list[MediaPart]
    text_tokens: int
    max_tokens: int
    stream: bool
    priority: int
    seed: int
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The chat with each media part reduced to ``{"type": kind}`` (a real engine applies the template)."""
    temperature: float = 1.0
    top_p: float = 1.0


def _bad(path: str, msg: str, status: int = 400) -> RequestError:
    return RequestError(status, f"{path}: {msg}")


def _int(body: dict[str, Any], key: str, lo: int, hi: int, default: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be between {lo} and {hi}, got {v}")
    return v


def _b64(path: str, text: str) -> bytes:
    # size check before decoding: base64 is 4/3 of the payload
    if len(text) > MAX_PART_BYTES * 4 // 3 + 4:
        raise _bad(path, f"part is larger than {MAX_PART_BYTES} bytes", 413)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(path, "undecodable base64 data") from None
    if not data:
        raise _bad(path, "empty media data")
    return data


def _data_url(path: str, url: Any) -> tuple[str, bytes]:
    if not isinstance(url, str) or not url:
        raise _bad(path, "must be a non-empty string")
    if not url.startswith("data:"):
        raise _bad(path, "only data: URLs are supported (fetching remote URLs is disabled)")
    m = _DATA_URL.match(url)
    if m is None or not m.group(3):
        raise _bad(path, "malformed data URL: expected data:<mime>;base64,<data>")
    return (m.group(1) or "").lower(), _b64(path, m.group(4))


def image_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the header of a PNG, JPEG, GIF, WebP or BMP; None if unrecognised."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return h, w
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return h, w
    if data[:2] == b"BM" and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return abs(h), abs(w)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8X":
            w = 1 + int.from_bytes(data[24:27], "little")
            h = 1 + int.from_bytes(data[27:30], "little")
            return h, w
        if chunk == b"VP8 ":
            w, h = struct.unpack("<HH", data[26:30])
            return h & 0x3FFF, w & 0x3FFF
        if chunk == b"VP8L" and len(data) >= 25:
            b = data[21:25]
            w = 1 + (((b[1] & 0x3F) << 8) | b[0])
            h = 1 + (((b[3] & 0xF) << 10) | (b[2] << 2) | ((b[1] & 0xC0) >> 6))
            return h, w
        return None
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                i += 1
                continue
            marker = data[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            seg = struct.unpack(">H", data[i + 2 : i + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return h, w
            i += 2 + seg
        return None
    return None


def audio_seconds(data: bytes, fmt: str) -> float | None:
    """Clip duration from a WAV header, or estimated for compressed formats; None if unrecognised."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        i, byte_rate, size = 12, 0, 0
        while i + 8 <= len(data):
            cid, clen = data[i : i + 4], struct.unpack("<I", data[i + 4 : i + 8])[0]
            if cid == b"fmt " and clen >= 16:
                byte_rate = struct.unpack("<I", data[i + 16 : i + 20])[0]
            elif cid == b"data":
                size = min(clen, len(data) - i - 8)
                break
            i += 8 + clen + (clen & 1)
        if byte_rate <= 0:
            return None
        return size / byte_rate
    if (
        data[:3] == b"ID3"
        or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")
        or data[:4] in (b"fLaC", b"OggS")
    ):
        return len(data) * 8 / 128_000  # ~128 kb/s
    return None


def _video_ok(data: bytes) -> bool:
    return data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3" or data[:4] == b"RIFF"


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(key, f"must be a number, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be between {lo} and {hi}, got {v}")
    return float(v)


def _stripped(content: Any) -> Any:
    """A message's content with media parts reduced to their kind (what the chat template needs)."""
    if not isinstance(content, list):
        return content
    out = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": p.get("text", "")})
        else:
            out.append({"type": {"image_url": "image", "input_audio": "audio", "video_url": "video"}.get(str(kind), str(kind))})
    return out


def _part(path: str, part: Any, accepts: tuple[str, ...]) -> tuple[MediaPart | None, int]:
    """One content part -> (media part or None, text characters)."""
    if not isinstance(part, dict):
        raise _bad(path, "content parts must be objects")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{path}.text", "must be a string")
        return None, len(text)
    media_kind = {"image_url": "image", "input_audio": "audio", "video_url": "video", "video": "video"}.get(
        str(kind)
    )
    if media_kind is None:
        raise _bad(
            f"{path}.type", f"unsupported part type {kind!r} (text, image_url, input_audio, video_url)"
        )
    if media_kind not in accepts:
        raise _bad(
            f"{path}.type", f"{kind} is not accepted by this deployment (it takes {', '.join(accepts)})"
        )
    if media_kind == "image":
        obj = part.get("image_url")
        url = obj.get("url") if isinstance(obj, dict) else obj
        mime, data = _data_url(f"{path}.image_url.url", url)
        size = image_size(data)
        if size is None or min(size) <= 0:
            raise _bad(f"{path}.image_url.url", "not a decodable image (png, jpeg, gif, webp or bmp)")
        return MediaPart("image", data, mime, {"height": size[0], "width": size[1]}), 0
    if media_kind == "audio":
        obj = part.get("input_audio")
        if not isinstance(obj, dict) or not isinstance(obj.get("data"), str):
            raise _bad(f"{path}.input_audio", "must be an object with base64 'data' and 'format'")
        fmt = str(obj.get("format", "wav")).lower()
        data = _b64(f"{path}.input_audio.data", obj["data"])
        secs = audio_seconds(data, fmt)
        if secs is None or secs <= 0:
            raise _bad(
                f"{path}.input_audio.data", f"not decodable audio of format {fmt!r} (wav, mp3, flac, ogg)"
            )
        return MediaPart("audio", data, f"audio/{fmt}", {"audio_s": round(secs, 3)}), 0
    obj = part.get("video_url") if kind == "video_url" else part.get("video")
    url = obj.get("url") if isinstance(obj, dict) else obj
    mime, data = _data_url(f"{path}.{kind}.url", url)
    if not _video_ok(data):
        raise _bad(f"{path}.{kind}.url", "not a decodable video container (mp4, webm, avi)")
    frames = obj.get("frames", DEFAULT_VIDEO_FRAMES) if isinstance(obj, dict) else DEFAULT_VIDEO_FRAMES
    if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= 1024:
        raise _bad(f"{path}.{kind}.frames", "must be an integer between 1 and 1024")
    return MediaPart("video", data, mime, {"frames": frames, "height": VIDEO_SIDE, "width": VIDEO_SIDE}), 0


def parse_chat_request(body: Any, served_names: tuple[str, ...], modality: str) -> ChatRequest:
    """Validate a decoded JSON body; raise RequestError naming the field on any problem."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body: must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required (a string)")
    if model not in served_names:
        raise _bad("model", f"unknown model {model!r}; this deployment serves {served_names[0]!r}", 404)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required (a non-empty list)")
    accepts = ACCEPTS.get(modality, ("image",))
    parts: list[MediaPart] = []
    chars = 0
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(p, "must be an object")
        if msg.get("role") not in ROLES:
            raise _bad(f"{p}.role", f"must be one of {', '.join(ROLES)}, got {msg.get('role')!r}")
        content = msg.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                mp, n = _part(f"{p}.content[{j}]", part, accepts)
                chars += n
                if mp is not None:
                    parts.append(mp)
                    if len(parts) > MAX_PARTS:
                        raise _bad(f"{p}.content[{j}]", f"more than {MAX_PARTS} media parts in one request")
        elif content is None and msg.get("role") == "assistant":
            pass
        else:
            raise _bad(f"{p}.content", "must be a string or a list of content parts")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 1, MAX_OUTPUT_TOKENS, DEFAULT_MAX_TOKENS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    priority = _int(body, "priority", -(2**31), 2**31 - 1, 0)
    seed = body.get("seed")
    if seed is None:
        digest = hashlib.blake2b(repr((model, messages, max_tokens)).encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") & 0x7FFFFFFF
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise _bad("seed", "must be an integer")
    text_tokens = max(1, math.ceil(chars / CHARS_PER_TOKEN))
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p", "must be greater than 0")
    stripped = [{"role": m["role"], "content": _stripped(m.get("content"))} for m in messages]
    return ChatRequest(
        messages=stripped,
        temperature=temperature,
        top_p=top_p,
        model=model,
        parts=parts,
        text_tokens=text_tokens,
        max_tokens=max_tokens,
        stream=stream,
        priority=priority,
        seed=int(seed),
        include_usage=bool(opts.get("include_usage", False)),
    )
