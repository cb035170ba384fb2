"""Admission rules of the real engines: what cannot be served yet is refused, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from easerve_runtime.api import parse_spec, spec_errors
from pydantic import ValidationError


def base(**engine: Any) -> dict[str, Any]:
    return {
        "model": {"name": "tiny", "modality": "image", "encoder": "clip-vit-l-336", "path": "/models/tiny"},
        "engine": {"profile": "llava-v1.6-34b@h200", **engine},
        "gpuBudget": 8,
        "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "offload": {"ratio": 1.0},
        "slo": {"objective": "moderate", "tiers": [{"name": "moderate", "ttftSeconds": 8, "tpotMs": 100}]},
    }


def errors(raw: dict[str, Any]) -> list[str]:
    try:
        parse_spec(raw)
    except ValidationError as exc:
        return spec_errors(exc)
    return []


def test_torch_spec_with_a_model_path_is_valid() -> None:
    spec = parse_spec(base(backend="torch") | {"decode": {"kvMemoryFraction": 0.5}})
    assert spec.model.path == "/models/tiny" and spec.decode.kv_memory_fraction == 0.5
    assert spec.model.trust_remote_code is False and spec.model.random_weights is False


def test_vllm_is_refused_naming_the_backend_field() -> None:
    errs = errors(base(backend="vllm"))
    assert any(e.startswith("spec.engine.backend: vllm is not supported") for e in errs), errs


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_torch_with_tensor_parallel_is_refused(stage: str) -> None:
    raw = base(backend="torch")
    raw["allocation"][stage]["tensorParallel"] = 2
    errs = errors(raw)
    assert any(e.startswith(f"spec.allocation.{stage}.tensorParallel: is 2") and "TP 1" in e for e in errs), errs


def test_torch_needs_a_model_path() -> None:
    raw = base(backend="torch")
    del raw["model"]["path"]
    assert any(e.startswith("spec.model.path: is required") for e in errors(raw))


def test_sim_ignores_the_torch_rules() -> None:
    raw = base(backend="sim")
    raw["allocation"]["decode"]["tensorParallel"] = 2
    del raw["model"]["path"]
    assert errors(raw) == []
