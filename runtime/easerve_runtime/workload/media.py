"""Media descriptors and what the encoder makes of them (items to batch, tokens for the LLM).

These follow the encoders' own patching so that request sizes match the real models:

* CLIP ViT-L/14-336: one 336×336 crop → 24×24 = 576 tokens. LLaVA-1.6 ("anyres") adds tiles: the
  image is fitted to the best grid of 336-px tiles (336×672, 672×336, 672×672, 1008×336,
  336×1008), every tile plus a downscaled base image is one encoder item, and the tile features
  are unpadded to the image's aspect ratio with one newline token per row (HF
  ``LlavaNextProcessor``). 256×256 → 3 crops, 1176 tokens; 720×1280 → 5 crops, 1899 tokens
  (the upper bound 2880 = 5×576 before unpadding).
* Qwen2-VL vision tower: 14-px patches, temporal patch 2, 2×2 merge. A 448×448 frame pair is
  one encoder item of 1024 patches (what the H200 profile measured) → 256 tokens.
* Whisper-large-v3: 30 s windows (3000 mel frames) are the encoder items; Ultravox stacks 8
  encoder frames of 20 ms → 6.25 tokens per second of audio.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

CLIP_TOKENS = 576  # 24×24 patches of 14 px on a 336-px crop
ANYRES_GRIDS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # (height, width)
QWEN_FRAME_SIDE = 448
QWEN_TOKENS_PER_ITEM = (QWEN_FRAME_SIDE // 28) ** 2  # 256 merged tokens per frame pair
WHISPER_WINDOW_S = 30.0
ULTRAVOX_TOKENS_PER_S = 50.0 / 8.0


def _anyres_grid(height: int, width: int) -> tuple[int, int]:
    """LLaVA-NeXT's select_best_resolution: most effective pixels, then least waste."""
    best: tuple[int, int] = ANYRES_GRIDS[0]
    best_eff, best_waste = -1, math.inf
    for gh, gw in ANYRES_GRIDS:
        scale = min(gw / width, gh / height)
        dw, dh = int(width * scale), int(height * scale)
        eff = min(dw * dh, width * height)
        waste = gw * gh - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (gh, gw), eff, waste
    return best


def image_items_tokens(height: int, width: int, anyres: bool) -> tuple[int, int]:
    """(encoder items, LLM tokens) for one image."""
    if height < 1 or width < 1:
        raise ValueError(f"media: image size must be positive, got {height}x{width}")
    if not anyres:
        return 1, CLIP_TOKENS
    gh, gw = _anyres_grid(height, width)
    tiles = (gh // 336) * (gw // 336)
    fh, fw = (gh // 336) * 24, (gw // 336) * 24  # tile feature grid
    if width / height > fw / fh:  # wider than the grid: unpad rows
        rows = int(round(height * fw / width))
        rows, cols = min(rows, fh), fw
    else:  # taller: unpad columns
        cols = int(round(width * fh / height))
        rows, cols = fh, min(cols, fw)
    return tiles + 1, CLIP_TOKENS + rows * cols + rows


def video_items_tokens(frames: int) -> tuple[int, int]:
    if frames < 1:
        raise ValueError(f"media: frames must be >= 1, got {frames}")
    items = math.ceil(frames / 2)
    return items, items * QWEN_TOKENS_PER_ITEM


def audio_items_tokens(seconds: float) -> tuple[int, int]:
    if not seconds > 0:
        raise ValueError(f"media: audio_s must be > 0, got {seconds}")
    return math.ceil(seconds / WHISPER_WINDOW_S), math.ceil(seconds * ULTRAVOX_TOKENS_PER_S)


def is_anyres(model_name: str) -> bool:
    n = model_name.lower()
    return "v1.6" in n or "next" in n or "anyres" in n


def items_tokens(modality: str, media: dict[str, Any], anyres: bool = False) -> tuple[int, int]:
    """(encoder items, media tokens) for a media descriptor of the given modality."""
    if modality == "image":
        return image_items_tokens(int(media["height"]), int(media["width"]), anyres)
    if modality == "video":
        return video_items_tokens(int(media["frames"]))
    if modality == "audio":
        return audio_items_tokens(float(media["audio_s"]))
    if modality == "text":
        return 0, 0
    raise ValueError(f"modality: unsupported {modality!r} (image, video, audio or text)")


def encoder_items(parts: Iterable[Any], anyres: bool, default: int | None = None) -> int:
    """Encoder items of media parts (anything with ``kind`` and a ``media`` descriptor), summed: the
    one count the engine profile, the twin and every encode engine index encode time by (a
    micro-batch's ``batch_items``). ``default``: what a part without a usable descriptor counts
    (a served request may carry none); None: such a part is an error."""
    n = 0
    for part in parts:
        if default is None:
            n += items_tokens(part.kind, dict(part.media), anyres)[0]
            continue
        try:
            n += items_tokens(part.kind, dict(part.media), anyres)[0] if part.media else default
        except (KeyError, TypeError, ValueError):
            n += default
    return n
