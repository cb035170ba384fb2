"""Tiny random model directories, made once per session with ``easerve model init`` (no downloads)."""

from __future__ import annotations

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
