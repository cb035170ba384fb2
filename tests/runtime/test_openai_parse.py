"""Request validation: every rejection names its field; accepted media are sized from headers."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from easerve_runtime.bench.payloads import mp4, png, wav
from easerve_runtime.workers.openai import (
    MAX_PART_BYTES,
    RequestError,
    audio_seconds,
    image_size,
    parse_chat_request,
)

NAMES = ("llava", "llava-hf/llava-v1.6-34b-hf")


def body(*parts: dict[str, Any], **kw: object) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": "llava",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}],
    }
    b.update(kw)
    return b


def img(data: bytes, mime: str = "image/png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"},
    }


def reject(b: object, modality: str = "image") -> RequestError:
    with pytest.raises(RequestError) as ei:
        parse_chat_request(b, NAMES, modality)
    return ei.value


def test_image_sized_from_png_header() -> None:
    req = parse_chat_request(body(img(png(720, 1280)), max_tokens=7, priority=3), NAMES, "image")
    assert len(req.parts) == 1
    assert req.parts[0].kind == "image"
    assert dict(req.parts[0].media) == {"height": 720, "width": 1280}
    assert (req.max_tokens, req.priority, req.stream) == (7, 3, False)


def test_audio_duration_from_wav_header() -> None:
    data = base64.b64encode(wav(2.5)).decode()
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    req = parse_chat_request(body(part), NAMES, "audio")
    assert req.parts[0].media == {"audio_s": 2.5}
    assert audio_seconds(wav(1.0), "wav") == pytest.approx(1.0)


def test_video_part_with_frames_hint() -> None:
    url = "data:video/mp4;base64," + base64.b64encode(mp4()).decode()
    req = parse_chat_request(
        body({"type": "video_url", "video_url": {"url": url, "frames": 12}}), NAMES, "video"
    )
    assert req.parts[0].kind == "video" and req.parts[0].media["frames"] == 12


def test_seed_is_deterministic_without_client_seed() -> None:
    a = parse_chat_request(body(img(png(8, 8))), NAMES, "image")
    b = parse_chat_request(body(img(png(8, 8))), NAMES, "image")
    c = parse_chat_request(body(img(png(8, 9))), NAMES, "image")
    assert a.seed == b.seed != c.seed


@pytest.mark.parametrize(
    ("b", "status", "needle"),
    [
        ([1, 2], 400, "request body"),
        ({"messages": []}, 400, "model"),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"model": "llava"}, 400, "messages"),
        ({"model": "llava", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        (body({"type": "file", "file": {}}), 400, "messages[0].content[1].type"),
        (body({"type": "image_url", "image_url": {"url": "http://x/y.png"}}), 400, "only data: URLs"),
        (
            body({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}),
            400,
            "undecodable base64",
        ),
        (body(img(b"not an image at all")), 400, "not a decodable image"),
        (body(img(png(4, 4)), max_tokens=0), 400, "max_tokens"),
        (body(img(png(4, 4)), stream="yes"), 400, "stream"),
    ],
)
def test_rejections_name_the_field(b: object, status: int, needle: str) -> None:
    err = reject(b)
    assert err.status == status
    assert needle in err.message


def test_oversized_part_is_413() -> None:
    big = "A" * (MAX_PART_BYTES * 4 // 3 + 100)
    err = reject(body({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{big}"}}))
    assert err.status == 413 and "messages[0].content[1].image_url.url" in err.message


def test_modality_mismatch_rejected() -> None:
    data = base64.b64encode(wav(1.0)).decode()
    err = reject(body({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}), "image")
    assert err.status == 400 and "not accepted by this deployment" in err.message


def test_image_size_formats() -> None:
    assert image_size(png(3, 5)) == (3, 5)
    gif = b"GIF89a" + (5).to_bytes(2, "little") + (3).to_bytes(2, "little") + b"\x00" * 8
    assert image_size(gif) == (3, 5)
    jpeg = (
        b"\xff\xd8"
        + b"\xff\xe0\x00\x04ab"
        + b"\xff\xc0\x00\x11\x08"
        + (3).to_bytes(2, "big")
        + (5).to_bytes(2, "big")
    )
    assert image_size(jpeg + b"\x00" * 16) == (3, 5)
    assert image_size(b"\x00" * 32) is None
