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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from easerve_runtime.api import LimitsSpec, Modality
from easerve_runtime.engines.base import FRAME_LIST_FPS, FRAME_LIST_MIME, MediaPart

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


HEADER_PREFIX_CHARS = 64 * 1024
"""Base64 characters decoded first to read an image header (pixel limit) before the full decode."""


class RequestError(ValueError):
    def __init__(self, status: int, message: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.limit = limit


# -- the request models: validate the JSON shape and generate /openapi.json -----------------------
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageURL(_Open):
    url: StrictStr = Field(description="data:<mime>;base64,<data> (remote URLs are not fetched).")
    detail: StrictStr | None = None


class InputAudio(_Open):
    data: StrictStr = Field(description="Base64 audio bytes.")
    format: StrictStr = Field(default="wav", description="wav, mp3, flac or ogg.")


class VideoURL(_Open):
    url: StrictStr = Field(description="data:<mime>;base64,<data> of an mp4, webm or avi container.")
    frames: StrictInt | None = Field(default=None, ge=1, le=1024, description="Frames sampled by the encoder.")


class ContentPart(_Open):
    """One part of a message's content: text, an image, an audio clip or a video.

    A video is a container (``video_url``: mp4, webm or avi) or, as Qwen's API takes it, its
    frames (``video``: a list of image data URLs of one size, in order, sampled at ``fps``)."""

    type: Literal["text", "image_url", "input_audio", "video_url", "video"]
    text: StrictStr | None = None
    image_url: ImageURL | StrictStr | None = None
    input_audio: InputAudio | None = None
    video_url: VideoURL | StrictStr | None = None
    video: VideoURL | StrictStr | list[StrictStr] | None = None
    fps: float | None = Field(default=None, gt=0, le=240, description="Frames per second of a frame-list video.")


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None


class StreamOptions(_Open):
    include_usage: StrictBool = False


class ChatCompletionRequest(_Open):
    """``POST /v1/chat/completions``: the OpenAI fields EAServe reads (others are accepted and ignored)."""

    model: StrictStr = Field(min_length=1, description="The served model name (GET /v1/models).")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31 - 1, description="At most spec.limits.maxOutputTokens.")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    seed: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    ignore_eos: StrictBool = Field(
        default=False,
        description="An extension, as in vLLM and SGLang: generate max_tokens tokens even past a stop "
        "token. For benchmarks (random-weight models stop at once); the output is not meant to be read.",
    )


def _loc(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a JSON path, union branch names dropped: messages[0].content[1].type."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif "[" in x or x in ("str", "int", "bool", "none", "ImageURL", "VideoURL", "function-after"):
            continue
        else:
            out += f".{x}" if out else x
    return out or "request body"


def validate_shape(body: Any) -> ChatCompletionRequest:
    """Validate the JSON shape with the request models; RequestError names the deepest failing field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        # a union reports one error per branch: the one that got furthest is the useful one
        first_field = errs[0]["loc"][:1]
        same = [e for e in errs if e["loc"][:1] == first_field]
        err = max(same, key=lambda e: len(e["loc"]))
        raise RequestError(400, f"{_loc(tuple(err['loc']))}: {err['msg']}") from None


def openapi_document(served_model: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the frontend, its request schema taken from the models above."""
    schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    defs["ChatCompletionRequest"] = schema
    error = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}},
            }
        },
    }
    defs["Error"] = error
    err_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "EAServe frontend", "version": "v1", "description": f"Serves {served_model}."},
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
                    },
                    "responses": {
                        "200": {"description": "A completion (JSON) or a stream of SSE chunks."},
                        "400": {"description": "Invalid request; the message names the field or limit.", **err_ref},
                        "401": {"description": "Missing or wrong API key.", **err_ref},
                        "404": {"description": "Unknown model.", **err_ref},
                        "413": {"description": "Body or media part too large.", **err_ref},
                        "415": {"description": "Content-Type is not application/json.", **err_ref},
                        "429": {"description": "Admission queue full; see Retry-After.", **err_ref},
                        "503": {"description": "Not ready or draining; see Retry-After.", **err_ref},
                    },
                }
            },
            "/v1/models": {"get": {"operationId": "listModels", "responses": {"200": {"description": "Served models."}}}},
            "/health": {"get": {"operationId": "health", "responses": {"200": {"description": "Ready."}, "503": {"description": "Not ready."}}}},
        },
        "components": {"schemas": defs},
    }


JSON_BYTES_PER_CHAR = 6
"""Most bytes one text character takes in a JSON body (a \\uXXXX escape)."""
BODY_OVERHEAD_BYTES = 64 * 1024
"""Room for everything in a body that is neither prompt text nor media (keys, roles, options)."""


def prescreen(raw: bytes, lim: LimitsSpec) -> None:
    """Refuse a body whose non-media bytes cannot fit ``maxPromptTokens`` of text, before parsing it.

    Parsing a 10 MB prompt only to count its characters costs tens of milliseconds (more on a
    busy host) and the memory of a copy; the bytes outside base64 payloads bound the text from
    above, and finding those payloads is a few ``bytes.find`` calls (C speed). Never refuses a
    body the full validation would accept.
    """
    media = 0
    i = raw.find(b";base64,")
    while i >= 0:
        end = raw.find(b'"', i)
        if end < 0:
            break
        media += end - i
        i = raw.find(b";base64,", end)
    text_bytes = len(raw) - media
    budget = lim.max_prompt_tokens * CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES
    if text_bytes > budget:
        raise RequestError(
            400,
            f"messages: {text_bytes} bytes of text cannot fit spec.limits.maxPromptTokens ({lim.max_prompt_tokens})",
            "maxPromptTokens",
        )


def json_depth(obj: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, iteratively; stops counting past ``limit``."""
    depth = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict | list):
            depth = max(depth, d)
            if depth > limit:
                return depth
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return depth


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
    ignore_eos: bool = False


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


def _data_url_text(path: str, url: Any) -> tuple[str, str]:
    """(mime, base64 text) of a data URL, not decoded yet."""
    if not isinstance(url, str) or not url:
        raise _bad(path, "must be a non-empty string")
    if not url.startswith("data:"):
        raise _bad(path, "only data: URLs are supported (fetching remote URLs is disabled)")
    comma = url.find(",")
    head = url[: comma + 1] if comma >= 0 else url[:512]
    m = _DATA_URL.match(head)
    if m is None or not m.group(3):
        raise _bad(path, "malformed data URL: expected data:<mime>;base64,<data>")
    return (m.group(1) or "").lower(), url[comma + 1 :]


def _data_url(path: str, url: Any) -> tuple[str, bytes]:
    mime, text = _data_url_text(path, url)
    return mime, _b64(path, text)


def _header_size(text: str) -> tuple[int, int] | None:
    """Image (height, width) from the first bytes of a base64 payload, the rest untouched.

    PNG/GIF/BMP/WebP headers sit in the first 64 bytes; a JPEG's frame header may come after
    its metadata segments, so a longer prefix is tried next. None if neither says.
    """
    for chars in (88, HEADER_PREFIX_CHARS):
        k = min(len(text), chars) // 4 * 4
        try:
            size = image_size(base64.b64decode(text[:k], validate=True))
        except (binascii.Error, ValueError, struct.error):
            size = None
        if size is not None:
            return size
    return None


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


def _check_pixels(path: str, size: tuple[int, int], lim: LimitsSpec) -> None:
    if size[0] * size[1] > lim.max_image_pixels:
        raise _bad(
            path,
            f"image of {size[1]}x{size[0]} = {size[0] * size[1]} pixels exceeds spec.limits.maxImagePixels "
            f"({lim.max_image_pixels})",
        )


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


def _part(path: str, part: Any, accepts: tuple[str, ...], lim: LimitsSpec) -> tuple[MediaPart | None, int]:
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
        upath = f"{path}.image_url.url"
        mime, text = _data_url_text(upath, url)
        size = _header_size(text)  # pixel limit from the header, before the full decode
        if size is not None:
            _check_pixels(upath, size, lim)
        data = _b64(upath, text)
        size = image_size(data)
        if size is None or min(size) <= 0:
            raise _bad(upath, "not a decodable image (png, jpeg, gif, webp or bmp)")
        _check_pixels(upath, size, lim)
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
        if secs > lim.max_audio_seconds:
            raise _bad(
                f"{path}.input_audio.data",
                f"{secs:.1f} s of audio exceeds spec.limits.maxAudioSeconds ({lim.max_audio_seconds:g} s)",
            )
        return MediaPart("audio", data, f"audio/{fmt}", {"audio_s": round(secs, 3)}), 0
    obj = part.get("video_url") if kind == "video_url" else part.get("video")
    if isinstance(obj, list):
        return _frame_list(f"{path}.video", obj, part.get("fps"), lim), 0
    url = obj.get("url") if isinstance(obj, dict) else obj
    mime, data = _data_url(f"{path}.{kind}.url", url)
    if not _video_ok(data):
        raise _bad(f"{path}.{kind}.url", "not a decodable video container (mp4, webm, avi)")
    frames = obj.get("frames", DEFAULT_VIDEO_FRAMES) if isinstance(obj, dict) else DEFAULT_VIDEO_FRAMES
    if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= 1024:
        raise _bad(f"{path}.{kind}.frames", "must be an integer between 1 and 1024")
    if frames > lim.max_video_frames:
        raise _bad(f"{path}.{kind}.frames", f"{frames} frames exceed spec.limits.maxVideoFrames ({lim.max_video_frames})")
    return MediaPart("video", data, mime, {"frames": frames, "height": VIDEO_SIDE, "width": VIDEO_SIDE}), 0


def _frame_list(path: str, frames: list[Any], fps: Any, lim: LimitsSpec) -> MediaPart:
    """A video sent as its frames: images of one size, in order. One media part whose ``data`` is
    the frames' bytes end to end (``media.frame_bytes`` says where each ends), so it travels and is
    charged (``media.frames``) as one video, and the encoder decodes the frames as images (nvJPEG
    on a GPU) instead of demuxing a container."""
    if not frames:
        raise _bad(path, "a frame list must hold at least one image")
    if len(frames) > lim.max_video_frames:
        raise _bad(path, f"{len(frames)} frames exceed spec.limits.maxVideoFrames ({lim.max_video_frames})")
    if fps is None:
        fps = FRAME_LIST_FPS
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 240:
        raise _bad(path.removesuffix(".video") + ".fps", "must be a number of frames per second in (0, 240]")
    datas: list[bytes] = []
    size: tuple[int, int] | None = None
    for k, url in enumerate(frames):
        fpath = f"{path}[{k}]"
        _mime, text = _data_url_text(fpath, url)
        data = _b64(fpath, text)
        got = image_size(data)
        if got is None or min(got) <= 0:
            raise _bad(fpath, "not a decodable image (png, jpeg, gif, webp or bmp)")
        _check_pixels(fpath, got, lim)
        if size is not None and got != size:
            raise _bad(fpath, f"frame of {got[1]}x{got[0]} differs from the first frame's {size[1]}x{size[0]}")
        size = got
        datas.append(data)
    assert size is not None
    media = {"frames": len(datas), "height": size[0], "width": size[1], "fps": float(fps),
             "frame_bytes": [len(d) for d in datas]}
    return MediaPart("video", b"".join(datas), FRAME_LIST_MIME, media)


def _text_chars(msg: Any) -> int:
    """Characters of text in one message (0 for anything malformed: the full parse reports it)."""
    if not isinstance(msg, dict):
        return 0
    c = msg.get("content")
    if isinstance(c, str):
        return len(c)
    if isinstance(c, list):
        return sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def parse_chat_request(
    body: Any,
    served_names: tuple[str, ...],
    modality: str,
    limits: LimitsSpec | None = None,
    media_tokens: Callable[[MediaPart], int] | None = None,
) -> ChatRequest:
    """Validate a decoded JSON body; raise RequestError naming the field or the limit on any problem.

    ``limits`` (``spec.limits``) bounds what one request may ask for; ``media_tokens`` sizes a media
    part in LLM tokens (the profile's patching) for the prompt and context limits. Text is checked
    before any media is decoded, so an oversized prompt is refused at the cost of a length.
    """
    lim = limits or LimitsSpec()
    if not isinstance(body, dict):
        raise RequestError(400, "request body: must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required (a string)")
    if model not in served_names:
        raise _bad("model", f"unknown model {model!r}; this deployment serves {served_names[0]!r}", 404)
    validate_shape(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required (a non-empty list)")
    accepts = ACCEPTS.get(modality, ("image",))
    chars = sum(_text_chars(m) for m in messages)
    if math.ceil(chars / CHARS_PER_TOKEN) > lim.max_prompt_tokens:
        raise RequestError(
            400,
            f"messages: about {math.ceil(chars / CHARS_PER_TOKEN)} prompt tokens of text exceed "
            f"spec.limits.maxPromptTokens ({lim.max_prompt_tokens})",
            "maxPromptTokens",
        )
    parts: list[MediaPart] = []
    chars = 0
    images = 0
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
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images += 1
                    if images > lim.max_images_per_request:
                        raise _bad(
                            f"{p}.content[{j}]",
                            f"more than spec.limits.maxImagesPerRequest ({lim.max_images_per_request}) images",
                        )
                mp, n = _part(f"{p}.content[{j}]", part, accepts, lim)
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
    max_tokens = _int(body, key, 1, 2**31 - 1, min(DEFAULT_MAX_TOKENS, lim.max_output_tokens))
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
    if max_tokens > lim.max_output_tokens:
        raise _bad(key, f"{max_tokens} exceeds spec.limits.maxOutputTokens ({lim.max_output_tokens})")
    text_tokens = max(1, math.ceil(chars / CHARS_PER_TOKEN))
    prompt = text_tokens + (sum(media_tokens(mp) for mp in parts) if media_tokens is not None else 0)
    if prompt > lim.max_prompt_tokens:
        raise RequestError(
            400,
            f"messages: {prompt} prompt tokens (text and media) exceed spec.limits.maxPromptTokens "
            f"({lim.max_prompt_tokens})",
            "maxPromptTokens",
        )
    if prompt + max_tokens > lim.max_context_tokens:
        raise RequestError(
            400,
            f"{key}: {prompt} prompt tokens + {max_tokens} output tokens exceed spec.limits.maxContextTokens "
            f"({lim.max_context_tokens})",
            "maxContextTokens",
        )
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p", "must be greater than 0")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "must be a boolean")
    stripped = [{"role": m["role"], "content": _stripped(m.get("content"))} for m in messages]
    return ChatRequest(
        messages=stripped,
        temperature=temperature,
        top_p=top_p,
        ignore_eos=ignore_eos,
        model=model,
        parts=parts,
        text_tokens=text_tokens,
        max_tokens=max_tokens,
        stream=stream,
        priority=priority,
        seed=int(seed),
        include_usage=bool(opts.get("include_usage", False)),
    )
