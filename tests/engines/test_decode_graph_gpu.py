"""On a CUDA GPU, a decode step replayed from a CUDA graph equals the eager step (skipped without CUDA).

A graph is captured on first use of a (batch, K/V length) bucket, usually while sequences are
running, and its warm-up and capture steps really run: they must not touch the running rows'
caches. Rows of very different lengths share the step. Run on the device machine:
``pytest -m gpu tests/engines``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.mark.parametrize("arch", ["llava-next", "qwen2-audio"])
def test_graph_replay_equals_the_eager_step_over_running_rows(model_dirs: dict[str, Path], arch: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    monkeypatch.setenv(hf.PRECAPTURE_ENV, "0")  # this test is about a capture made while rows run
    eng = HFDecodeEngine(model_dirs[arch], device="cuda", dtype=torch.float32, max_slots=4, max_len=1024,
                         stage_buffers=0, cuda_graphs=True)
    torch.manual_seed(0)
    with torch.inference_mode():
        eng.K.normal_()
        eng.V.normal_()
    lengths = [5, 300, 77]  # three running rows in a bucket of 4: one padding row
    ids = torch.arange(3, 6, device="cuda")
    pos = torch.tensor(lengths, device="cuda")
    kv_len = hf.kv_bucket(max(lengths) + 1, eng.max_len)
    with torch.inference_mode():
        eager = eng._forward(ids, pos, 3, kv_len).clone()
        graph = eng._graph_logits(ids, pos, 3, kv_len).clone()  # captures the bucket first
        again = eng._graph_logits(ids, pos, 3, kv_len).clone()
    assert eng.stats["captures"] == 1
    assert torch.allclose(graph, eager, atol=1e-4, rtol=1e-4), (graph - eager).abs().max()
    assert torch.equal(graph, again)


def test_graphs_captured_at_start_up_serve_every_bucket(model_dirs: dict[str, Path]) -> None:
    """With the start-up capture (the default), a step of any batch and length captures nothing
    more and still equals the eager step."""
    import torch
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    eng = HFDecodeEngine(model_dirs["llava-next"], device="cuda", dtype=torch.float32, max_slots=4, max_len=1024,
                         stage_buffers=0, cuda_graphs=True)
    assert eng.stats["precaptured"] == len(eng.graph_buckets()) == eng.stats["captures"]
    torch.manual_seed(0)
    with torch.inference_mode():
        eng.K.normal_()
        eng.V.normal_()
    for lengths in ([5], [300, 77], [1000, 3, 512]):
        n = len(lengths)
        ids = torch.arange(3, 3 + n, device="cuda")
        pos = torch.tensor(lengths, device="cuda")
        kv_len = hf.kv_bucket(max(lengths) + 1, eng.max_len)
        with torch.inference_mode():
            eager = eng._forward(ids, pos, n, kv_len).clone()
            graph = eng._graph_logits(ids, pos, n, kv_len).clone()
        assert torch.allclose(graph, eager, atol=1e-4, rtol=1e-4), (graph - eager).abs().max()
    assert eng.stats["captures"] == eng.stats["precaptured"]
