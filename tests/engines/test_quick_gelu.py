"""The one-kernel ``quick_gelu`` (``engines/quick_gelu.py``) against the library's activation:
the same values in float32, float16 and bfloat16 (each step rounded as torch rounds it), and the
swap leaves a CLIP tower's output unchanged.

Without CUDA the kernel runs under Triton's interpreter (the ``triton_kernels`` fixture).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_fused_activation_is_the_librarys(triton_kernels: None, dtype: str) -> None:
    """float16 and bfloat16: each step rounded as torch rounds it, so the library's values (a
    tie tipped by ``exp``'s last bit may differ by one unit in the last place); float32: within a
    few units of float32 rounding (the two ``exp`` implementations differ in the last bits)."""
    import torch
    from easerve_runtime.engines.quick_gelu import BLOCK, quick_gelu
    from transformers.activations import QuickGELUActivation

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "bfloat16" and dev == "cpu":
        pytest.skip("Triton's interpreter converts float32 to bfloat16 by truncation (checked on the GPU)")
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, BLOCK + 37, generator=gen) * 4).to(dev, dt)  # not a multiple of the block
    x[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-3])  # sigmoid's saturated ends and the origin
    want = QuickGELUActivation()(x)
    got = quick_gelu(x)
    assert got.dtype == dt and got.shape == x.shape
    if dt == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)
    else:
        step = torch.nextafter(want.abs(), torch.full_like(want, float("inf"))).float() - want.abs().float()
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= step).all())
        assert float((diff == 0).float().mean()) > 0.99
    # a non-contiguous input is read as the values it holds
    assert torch.equal(quick_gelu(x.t()), quick_gelu(x.t().contiguous()))


def test_the_swap_keeps_the_towers_output(triton_kernels: None, model_dirs: dict[str, Path]) -> None:
    import torch
    from easerve_runtime.engines.quick_gelu import fuse_quick_gelu
    from easerve_runtime.models.loading import load_stage

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tower = load_stage(model_dirs["llava-next"], "encode", device=dev).model.model.vision_tower
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.inference_mode():
        want = tower(px).last_hidden_state
        assert fuse_quick_gelu(tower) == len(tower.encoder.layers) > 0
        got = tower(px).last_hidden_state
        assert fuse_quick_gelu(tower) == 0  # already swapped
        assert fuse_quick_gelu(tower, fused=False) == len(tower.encoder.layers)  # and back
        again = tower(px).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, want)
