"""Tiny random model directories, made once per session with ``easerve model init`` (no downloads)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from easerve_operator.cli import main

    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llava-next", "qwen2-audio", "qwen2.5-vl"):
        assert main(["model", "init", "--arch", arch, "--tiny", "-o", str(root / arch)]) == 0
        out[arch] = root / arch
    return out


@pytest.fixture
def triton_kernels() -> None:
    """Our Triton kernels can run: without CUDA under Triton's interpreter (``TRITON_INTERPRET``,
    set by tests/conftest.py before anything imports Triton). Skipped when Triton is not installed."""
    import torch

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and Triton's interpreter is off (TRITON_INTERPRET=1 must be set before Triton loads)")


@pytest.fixture
def split_kv(triton_kernels: None) -> Iterator[None]:
    """Decode attention through the Triton split-KV kernel (``engines/decode_attention.py``) for one test."""
    from easerve_runtime.engines import hf

    before = hf._decode_kernel
    hf.set_decode_attention_kernel("split-kv")
    try:
        yield
    finally:
        hf.set_decode_attention_kernel(before)
