from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from easerve_runtime.api import load_manifest  # noqa: E402
from easerve_runtime.sim.latency import StageModel  # noqa: E402
from toy import ToyProfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    m: ROOT / "examples" / f"{m}.yaml" for m in ("llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b")
}


@pytest.fixture
def toy_model() -> StageModel:
    return StageModel(ToyProfile())


@pytest.fixture
def llava_spec():
    return load_manifest(EXAMPLES["llava-v1.6-34b"])[1]
