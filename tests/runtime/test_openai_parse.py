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


def _frames(*sizes: tuple[int, int]) -> list[str]:
    return ["data:image/png;base64," + base64.b64encode(png(h, w)).decode() for h, w in sizes]


def test_video_as_a_frame_list_is_one_part_of_its_frames() -> None:
    from easerve_runtime.engines.base import FRAME_LIST_MIME, video_frames

    frames = _frames((64, 96), (64, 96), (64, 96))
    req = parse_chat_request(body({"type": "video", "video": frames, "fps": 4}), NAMES, "video")
    (part,) = req.parts
    assert part.kind == "video" and part.mime == FRAME_LIST_MIME
    assert {k: part.media[k] for k in ("frames", "height", "width", "fps")} == {
        "frames": 3, "height": 64, "width": 96, "fps": 4.0}
    assert video_frames(part) == [png(64, 96)] * 3
    default = parse_chat_request(body({"type": "video", "video": frames[:1]}), NAMES, "video")
    assert default.parts[0].media["fps"] == 2.0  # qwen-vl-utils' default rate


@pytest.mark.parametrize(
    ("part", "field", "says"),
    [
        ({"type": "video", "video": []}, "content[1].video", "at least one image"),
        ({"type": "video", "video": _frames((64, 96), (32, 96))}, "content[1].video[1]", "differs from the first"),
        ({"type": "video", "video": ["data:image/png;base64,AAAA"]}, "content[1].video[0]", "not a decodable image"),
        ({"type": "video", "video": ["https://x/y.png"]}, "content[1].video[0]", "only data: URLs"),
        ({"type": "video", "video": _frames((64, 96)), "fps": 0}, "content[1].fps", "greater than 0"),
    ],
)
def test_a_bad_frame_list_is_refused_naming_the_frame(part: dict[str, Any], field: str, says: str) -> None:
    err = reject(body(part), "video")
    assert err.status == 400 and field in str(err) and says in str(err)


def test_a_frame_list_longer_than_the_limit_is_refused() -> None:
    from easerve_runtime.api.spec import LimitsSpec

    with pytest.raises(RequestError, match="maxVideoFrames"):
        parse_chat_request(body({"type": "video", "video": _frames(*[(8, 8)] * 5)}), NAMES, "video",
                           LimitsSpec(maxVideoFrames=4))


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


def test_the_bench_sends_a_jpeg_video_as_frames_the_frontend_takes() -> None:
    """``easerve bench --image-format jpeg``: a video goes as its JPEG frames (what the torch engine
    serves); the frontend reads it back as one video of that many frames at that size."""
    from easerve_runtime.bench.payloads import media_part
    from easerve_runtime.engines.base import FRAME_LIST_MIME

    part = media_part("video", {"frames": 5, "height": 48, "width": 64}, "jpeg")
    assert part is not None and part["type"] == "video" and len(part["video"]) == 5
    (got,) = parse_chat_request(body(part), NAMES, "video").parts
    assert got.mime == FRAME_LIST_MIME and {k: got.media[k] for k in ("frames", "height", "width")} == {
        "frames": 5, "height": 48, "width": 64}
    container = media_part("video", {"frames": 5, "height": 48, "width": 64}, "png")
    assert container is not None and container["type"] == "video_url"  # the sim path's mp4 box, as before


@pytest.mark.parametrize("prompt_tokens", [1, 37, 128, 1024])
def test_a_bench_prompt_of_n_tokens_is_n_tokens_to_the_tokenizer_and_to_the_sim_estimate(prompt_tokens: int) -> None:
    """``easerve bench``'s text is as many tokens as its workload says: to the BPE tokenizer that
    ``easerve model init`` writes (what the torch engine's frontend counts with) and to the sim
    path's ``ceil(chars / 4)``. The old filler (``"lorem "``) made a 128-token prompt 427 tokens to
    that tokenizer, and every GPU run's prompts ~300 tokens longer than the twin's."""
    import math

    from easerve_runtime.bench.payloads import chat_body
    from easerve_runtime.models.init import train_tokenizer
    from easerve_runtime.workers.openai import CHARS_PER_TOKEN
    from easerve_runtime.workload.request import Request

    tok = _bench_tokenizer(train_tokenizer)
    req = Request(id="r", arrival_s=0.0, modality="text", prompt_tokens=prompt_tokens, output_tokens=4)
    text = chat_body(req, "m")["messages"][0]["content"][0]["text"]
    assert len(tok(text)["input_ids"]) == prompt_tokens
    assert math.ceil(len(text) / CHARS_PER_TOKEN) == prompt_tokens


_TOKENIZER: list[Any] = []


def _bench_tokenizer(train: Any) -> Any:
    if not _TOKENIZER:  # trained once per session (a second or so)
        _TOKENIZER.append(train("llava-next"))
    return _TOKENIZER[0]
