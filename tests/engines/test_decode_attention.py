"""The split-KV decode attention kernel (``engines/decode_attention.py``) against plain attention,
and the decode engine's step through it against the masked SDPA step.

Without CUDA the Triton kernels run under Triton's interpreter (the ``split_kv`` fixture); the
interpreter's bfloat16 matmul is wrong (a limitation of the interpreter, not of the kernel), so
the CPU checks float32 and float16 and a CUDA device adds bfloat16. Skipped without Triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def reference(q: Any, key: Any, value: Any, lengths: Any, scale: float) -> Any:
    """Plain attention of each row over its first ``lengths[row]`` keys, in float32."""
    import torch

    steps = torch.arange(key.shape[2], device=key.device)
    mask = (steps[None, :] < lengths[:, None])[:, None, None, :]
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), value.float())


def dtypes() -> list[str]:
    import torch

    return ["float32", "float16"] + (["bfloat16"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize(("groups", "head_dim"), [(4, 32), (7, 64), (1, 128)])
def test_the_kernel_equals_attention_over_each_rows_own_prefix(split_kv: None, dtype: str, groups: int,
                                                              head_dim: int) -> None:
    import torch
    from easerve_runtime.engines.decode_attention import split_kv_decode_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cpu").manual_seed(groups * head_dim)
    n, kv_heads, slot_len, kv_len = 4, 2, 400, 333
    # views of a larger slot tensor, as the engine passes them: strided, never copied
    slots_k = torch.randn(n + 2, kv_heads, slot_len, head_dim, generator=gen).to(dev, dt)
    slots_v = torch.randn(n + 2, kv_heads, slot_len, head_dim, generator=gen).to(dev, dt)
    key, value = slots_k[:n, :, :kv_len], slots_v[:n, :, :kv_len]
    query = torch.randn(n, 1, kv_heads * groups, head_dim, generator=gen).to(dev, dt).transpose(1, 2)
    q = query.reshape(n, kv_heads, groups, head_dim)
    lengths = torch.tensor([1, 64, 65, kv_len], device=dev)  # one key; a tile's edge; past it; the whole bucket
    scale = head_dim ** -0.5
    out = split_kv_decode_attention(q, key, value, lengths, scale)
    want = reference(q, key, value, lengths, scale)
    assert out.dtype == dt and out.shape == (n, kv_heads, groups, head_dim)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert torch.allclose(out.float(), want, atol=tol, rtol=tol), (out.float() - want).abs().max()
    # what lies past a row's length is never read: garbage there changes nothing
    slots_k[:n, :, 100:kv_len] = float("nan")
    slots_v[:n, :, 100:kv_len] = float("nan")
    short = torch.tensor([1, 64, 65, 100], device=dev)
    assert torch.allclose(split_kv_decode_attention(q, key, value, short, scale)[:3].float(), want[:3],
                          atol=tol, rtol=tol)


def test_split_plans_cover_each_row_and_fill_the_device() -> None:
    pytest.importorskip("triton")
    from easerve_runtime.engines.decode_attention import BLOCK_N, plan_splits

    for n in (1, 2, 7, 32, 128):
        for kv_len in (1, 63, 64, 65, 256, 2560, 4096):
            splits, chunk = plan_splits(n, 8, kv_len, 132)
            assert chunk % BLOCK_N == 0
            assert splits * chunk >= kv_len > (splits - 1) * chunk  # covered, and no split past the bucket
    one, _ = plan_splits(1, 8, 2560, 132)
    many, _ = plan_splits(128, 8, 2560, 132)
    assert one > many == 1  # one row is split over the SMs; 128 rows fill them without splitting


@pytest.mark.parametrize("arch", ["llava-next", "qwen2.5-vl", "qwen2-audio"])
def test_the_engine_step_through_the_kernel_equals_the_masked_step(split_kv: None, model_dirs: dict[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    import torch
    from easerve_runtime.engines import decode_attention, hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    calls = []
    kernel = decode_attention.split_kv_decode_attention

    def counted(*args: Any) -> Any:
        calls.append(args[3].tolist())
        return kernel(*args)

    monkeypatch.setattr(decode_attention, "split_kv_decode_attention", counted)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = HFDecodeEngine(model_dirs[arch], device=dev, dtype=torch.float32, max_slots=4, max_len=512,
                         stage_buffers=0, cuda_graphs=False)
    torch.manual_seed(0)
    with torch.inference_mode():
        eng.K.normal_()
        eng.V.normal_()
    lengths = [5, 300, 77]
    ids = torch.arange(3, 6, device=dev)
    pos = torch.tensor(lengths, device=dev)
    kv_len = hf.kv_bucket(max(lengths) + 1, eng.max_len)
    with torch.inference_mode():
        fast = eng._forward(ids, pos, 3, kv_len).clone()
        hf.set_decode_attention_kernel("math")
        masked = eng._forward(ids, pos, 3, kv_len).clone()
    assert calls and all(c == [6, 301, 78] for c in calls)  # each layer got each row's length (position + 1)
    assert len(calls) == eng.layers
    assert torch.allclose(fast, masked, atol=1e-4, rtol=1e-4), (fast - masked).abs().max()
