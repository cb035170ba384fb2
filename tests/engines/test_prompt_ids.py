"""The encode stage's inputs with the prompts tokenized before the image placeholders expand
(``engines/prompt_ids.py``) are the processor's own, tensor for tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _images(sizes: list[tuple[int, int]]) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


@pytest.mark.parametrize("arch", ["llava-next", "qwen2.5-vl"])
def test_expanded_inputs_equal_the_processors(model_dirs: dict[str, Path], arch: str) -> None:
    import torch
    from easerve_runtime.engines.prompt_ids import expanded_inputs
    from easerve_runtime.models.loading import load_processor

    proc = load_processor(model_dirs[arch])
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                        {"type": "text", "text": "and"}, {"type": "image"}]}]
    none = [{"role": "user", "content": [{"type": "text", "text": "No picture, a longer question here."}]}]
    texts = [proc.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (one, two, none, one)]
    images = _images([(40, 60), (90, 30), (64, 64), (33, 121)])  # every request's images, in order
    want = proc(text=texts, images=images, return_tensors="pt", padding=True)
    got = expanded_inputs(proc, texts, images)
    assert got is not None and sorted(got.keys()) == sorted(want.keys())
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_placeholder_without_its_image_falls_back_to_the_processor(model_dirs: dict[str, Path]) -> None:
    from easerve_runtime.engines.prompt_ids import expanded_inputs
    from easerve_runtime.models.loading import load_processor

    proc = load_processor(model_dirs["llava-next"])
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = proc.apply_chat_template(one, add_generation_prompt=True, tokenize=False)
    assert expanded_inputs(proc, [text, text], _images([(40, 60)])) is None  # two placeholders, one image
    assert expanded_inputs(proc, [text], _images([(40, 60), (50, 50)])) is None  # one placeholder, two images


@pytest.mark.gpu
def test_expanded_inputs_equal_the_processors_on_the_gpu(model_dirs: dict[str, Path]) -> None:
    """The same on CUDA tensors (nvJPEG's output, the processor's torchvision backend on the GPU)."""
    import torch
    from easerve_runtime.engines.prompt_ids import expanded_inputs
    from easerve_runtime.models.loading import load_processor

    proc = load_processor(model_dirs["llava-next"])
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    texts = [proc.apply_chat_template(one, add_generation_prompt=True, tokenize=False)] * 3
    images = [torch.from_numpy(np.asarray(im)).permute(2, 0, 1).contiguous().cuda()
              for im in _images([(40, 60), (90, 30), (64, 64)])]
    want = proc(text=texts, images=images, return_tensors="pt", padding=True, device="cuda")
    got = expanded_inputs(proc, texts, images, device="cuda")
    assert got is not None and sorted(got.keys()) == sorted(want.keys())
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k
