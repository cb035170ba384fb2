"""The one-kernel Gumbel-max draw (``engines/gumbel_argmax.py``) against the torch form of the same
draw (``hf.gumbel_noise`` + argmax): the same token for every row, top-p masks and ties included.

Without CUDA the kernel runs under Triton's interpreter (the ``triton_kernels`` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_fused_draw_is_the_torch_forms_token(triton_kernels: None) -> None:
    import torch
    from easerve_runtime.engines.gumbel_argmax import gumbel_argmax
    from easerve_runtime.engines.hf import gumbel_keys, gumbel_noise

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, vocab = 6, 3000  # not a multiple of the kernel's block
    gen = torch.Generator().manual_seed(3)
    scaled = (torch.randn(rows, vocab, generator=gen) * 3).to(dev)
    scaled[1, 100:] = float("-inf")  # a top-p mask: only the first 100 tokens may be drawn
    scaled[2] = 0.0  # a flat row: the noise alone decides
    seeds, positions = [1, 2, 3, 2**63 + 5, 0, 7], [0, 5, 9, 1, 2**40, 3]
    want = (scaled.double() + gumbel_noise(seeds, positions, vocab, dev)).argmax(-1)
    got = gumbel_argmax(scaled, gumbel_keys(seeds, positions, dev))
    assert got.tolist() == want.tolist()
    assert int(got[1]) < 100
    # a strided view (rows of a larger logits tensor) is read as it is
    wide = torch.full((rows, vocab + 7), -5.0, device=dev)
    wide[:, :vocab] = scaled
    assert gumbel_argmax(wide[:, :vocab], gumbel_keys(seeds, positions, dev)).tolist() == want.tolist()


def test_sampling_on_a_gpu_takes_the_fused_draw_and_keeps_its_tokens(triton_kernels: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.base import Sampling

    if not torch.cuda.is_available():
        pytest.skip("the fused draw is taken on CUDA only")
    logits = torch.randn(5, 32064, device="cuda")
    ss = [Sampling(temperature=0.7, top_p=0.9, seed=i) for i in range(4)] + [None]
    fused = hf.sample_rows(logits, ss, [3, 4, 5, 6, 7])
    monkeypatch.setenv("EASERVE_FUSED_SAMPLING", "0")
    assert hf.sample_rows(logits, ss, [3, 4, 5, 6, 7]) == fused


def test_the_sampling_benchmark_smoke_writes_both_forms_side_by_side(tmp_path: Path) -> None:
    """``benchmarks/sampling.py --smoke`` (CPU, Triton's interpreter): both forms per point, JSON and plot."""
    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(repo / "benchmarks" / "sampling.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    res = json.loads((tmp_path / "sampling.json").read_text())
    assert {(p["setting"], p["rows"]) for p in res["points"]} == {(s, r) for s in ("temperature 1", "temperature 0.7, top-p 0.9",
                                                                                  "greedy") for r in (1, 4)}
    assert all(p["torch"] > 0 and p["fused"] > 0 for p in res["points"])
    assert (tmp_path / "sampling.png").stat().st_size > 0
