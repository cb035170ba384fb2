"""The decode step's attention kernels on a CUDA GPU compute the same step (skipped without CUDA).

``flash-varlen`` (flash attention over per-row key lengths, no mask) replaces the masked SDPA of a
step over mixed lengths; here rows of very different lengths in one step give the same logits
with it as with the plain two-matmul kernel, eagerly and from a captured CUDA graph. Run on the
device machine: ``pytest -m gpu tests/engines``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (torch.cuda unavailable)"),
]


def _step(eng: Any, kernel: str, lengths: list[int], graph: bool) -> Any:
    import torch
    from easerve_runtime.engines import hf

    hf.set_decode_attention_kernel(kernel)
    try:
        n = len(lengths)
        ids = torch.arange(3, 3 + n, device="cuda")
        pos = torch.tensor(lengths, device="cuda")
        kv_len = hf.kv_bucket(max(lengths) + 1, eng.max_len)
        with torch.inference_mode():
            if not graph:
                return eng._forward(ids, pos, n, kv_len).float().clone()
            eng._graphs.clear()
            return eng._graph_logits(ids, pos, n, kv_len).float().clone()
    finally:
        hf.set_decode_attention_kernel("sdpa")


@pytest.mark.parametrize("arch", ["llava-next", "qwen2-audio"])
def test_flash_varlen_step_equals_the_masked_step(model_dirs: dict[str, Path], arch: str) -> None:
    import torch
    from easerve_runtime.engines.hf import HFDecodeEngine

    eng = HFDecodeEngine(model_dirs[arch], device="cuda", dtype=torch.bfloat16, max_slots=4, max_len=1024,
                         stage_buffers=0)
    torch.manual_seed(0)
    with torch.inference_mode():
        eng.K.normal_()
        eng.V.normal_()
    lengths = [5, 300, 77, 611]  # one step over very different prefixes (buckets: 1024)
    ref = _step(eng, "math", lengths, graph=False)
    for graph in (False, True):
        got = _step(eng, "flash-varlen", lengths, graph)
        assert torch.allclose(got, ref, atol=3e-2, rtol=3e-2), (graph, (got - ref).abs().max())
    # the kernel really reads only each row's prefix: garbage past it changes nothing
    with torch.inference_mode():
        for row, n in enumerate(lengths):
            eng.K[:, row, :, n + 1:] = 1e4
    got = _step(eng, "flash-varlen", lengths, graph=False)
    assert torch.allclose(got, ref, atol=3e-2, rtol=3e-2), (got - ref).abs().max()
