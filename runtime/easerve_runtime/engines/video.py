"""Video parts for the torch engine: a frame list's frames as one ``[T, 3, H, W]`` uint8 tensor.

Why frames, not containers: a request may send a video as its frames (Qwen's API form, see
``engines.base.FRAME_LIST_MIME``), which the encoder decodes like images, all frames of the
micro-batch in one nvJPEG call on a GPU, then hands to the model's own video processor (the
library's Qwen2-VL video processor: resize, temporal patching, normalisation; on the GPU when the
frames are there). A container (mp4, webm) would need a demuxer and a video decoder in the worker
image; the torch engine refuses one with a message that says to send frames instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from easerve_runtime.engines.base import FRAME_LIST_FPS, MediaPart, video_frames


def decode_videos(videos: Sequence[tuple[str, MediaPart]], device: str, gpu_decode: bool) -> tuple[list[Any], bool]:
    """Each ``(request id, video part)`` as a ``[T, 3, H, W]`` uint8 tensor, and whether they were
    decoded on the GPU (every frame of every video a JPEG: one nvJPEG call), else on the CPU (PIL)."""
    import torch

    from easerve_runtime.engines.hf import decode_image, gpu_decode_jpegs

    per_video: list[list[bytes]] = []
    for request_id, part in videos:
        frames = video_frames(part)
        if frames is None:
            raise ValueError(
                f"request {request_id}: a {part.mime or 'container'} video is not decoded by the torch engine; "
                "send the video as its frames (a 'video' content part holding a list of image data URLs)"
            )
        per_video.append(frames)
    flat = [MediaPart("image", f, "image/jpeg") for frames in per_video for f in frames]
    decoded = gpu_decode_jpegs(flat, device) if gpu_decode else None
    out: list[Any] = []
    at = 0
    for frames in per_video:
        if decoded is not None:
            out.append(torch.stack(decoded[at : at + len(frames)]))
        else:
            arr = np.stack([np.asarray(decode_image(MediaPart("image", f))) for f in frames])
            out.append(torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous())
        at += len(frames)
    return out, decoded is not None


def video_metadata(part: MediaPart) -> dict[str, Any]:
    """What the library's video processor reads of a video it is handed as frames: its frame rate
    (the temporal positions' spacing, ``second_per_grid_ts``) and length. The frames are taken as
    sent (``do_sample_frames=False``): the client sampled them."""
    frames = int(part.media.get("frames") or len(video_frames(part) or ()))
    return {"fps": float(part.media.get("fps") or FRAME_LIST_FPS), "total_num_frames": frames}
