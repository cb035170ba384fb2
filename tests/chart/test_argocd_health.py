"""The Argo CD health check (charts/easerve/argocd/health.lua), run in Lua 5.1 as Argo CD runs it.

Statuses come from the operator's own pure status function (easerve_operator.reconcile.status), so
the check is tested against what the operator really writes, plus hand-made edge cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_operator.reconcile import status as status_rules
from easerve_operator.reconcile.status import StageObservation
from easerve_runtime.api import load_manifest

REPO = Path(__file__).resolve().parents[2]
LUA = REPO / "charts" / "easerve" / "argocd" / "health.lua"
NOW = "2026-01-01T00:00:00Z"


def compute_status(**kw: Any) -> dict[str, Any]:
    """The status as the operator writes it (the typed model's wire form)."""
    return status_rules.compute_status(**kw).wire()


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """Run health.lua with `obj` as Argo CD does (a global `obj`; the chunk returns a table)."""
    from lupa import lua51

    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(LUA.read_text())
    return str(hs["status"]), str(hs["message"] or "")


def epd(generation: int, status: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "easerve.io/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": "llava", "namespace": "default", "generation": generation},
        "spec": {},
    }
    if status is not None:
        obj["status"] = status
    return obj


@pytest.fixture(scope="module")
def spec() -> Any:
    _name, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    return spec


def stages(spec: Any, ready: bool) -> dict[str, StageObservation]:
    out = {}
    for stage in ("encode", "prefill", "decode"):
        n = getattr(spec.allocation, stage).replicas
        out[stage] = StageObservation(desired=n, ready=n if ready else 0, updated=n, total=n, rolled_out=True)
    return out


def test_all_ready_is_healthy(spec: Any) -> None:
    st = compute_status(generation=3, spec=spec, errors=[], stages=stages(spec, True), now=NOW)
    status, msg = health(epd(3, st))
    assert status == "Healthy"
    assert "AllStagesReady" in msg


def test_pods_not_ready_is_progressing(spec: Any) -> None:
    st = compute_status(generation=1, spec=spec, errors=[], stages=stages(spec, False), now=NOW)
    status, msg = health(epd(1, st))
    assert status == "Progressing"
    assert msg.startswith("PodsNotReady")


def test_invalid_spec_is_degraded_with_the_reason() -> None:
    st = compute_status(
        generation=2, spec=None, errors=["spec.encode.batchBound: must be >= 1"], stages={}, now=NOW
    )
    status, msg = health(epd(2, st))
    assert status == "Degraded"
    assert msg.startswith("InvalidSpec") and "spec.encode.batchBound" in msg


def test_insufficient_capacity_is_degraded(spec: Any) -> None:
    st = compute_status(
        generation=1,
        spec=spec,
        errors=[],
        stages=stages(spec, False),
        unschedulable=["llava-encode-0: 0/1 nodes have enough nvidia.com/gpu"],
        now=NOW,
    )
    status, msg = health(epd(1, st))
    assert status == "Degraded"
    assert msg.startswith("InsufficientCapacity") and "nvidia.com/gpu" in msg


def test_apply_failure_is_degraded(spec: Any) -> None:
    st = compute_status(
        generation=1,
        spec=spec,
        errors=[],
        stages=stages(spec, False),
        apply_error="Deployment llava-encode: forbidden",
        now=NOW,
    )
    assert health(epd(1, st))[0] == "Degraded"


def test_stale_observed_generation_is_progressing_even_if_old_status_was_ready(spec: Any) -> None:
    st = compute_status(generation=4, spec=spec, errors=[], stages=stages(spec, True), now=NOW)
    status, msg = health(epd(5, st))
    assert status == "Progressing"
    assert "generation 5" in msg


def test_stale_generation_beats_an_old_degraded_status() -> None:
    st = compute_status(generation=1, spec=None, errors=["spec.gpuBudget: too small"], stages={}, now=NOW)
    assert health(epd(2, st))[0] == "Progressing"


def test_no_status_yet_is_progressing() -> None:
    status, msg = health(epd(1, None))
    assert status == "Progressing" and "operator" in msg


def test_hand_made_edge_cases() -> None:
    # observedGeneration missing altogether
    assert health(epd(1, {"phase": "Pending", "conditions": []}))[0] == "Progressing"
    # phase Failed without conditions
    assert health(epd(1, {"observedGeneration": 1, "phase": "Failed"}))[0] == "Degraded"
    # Stalled alone (kstatus style, no Degraded condition) is enough
    stalled = {"observedGeneration": 1, "conditions": [{"type": "Stalled", "status": "True", "reason": "X"}]}
    assert health(epd(1, stalled)) == ("Degraded", "X")
    # Ready False and nothing else: still progressing, with Ready's reason
    nready = {
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "False", "reason": "Waiting"}],
    }
    assert health(epd(1, nready)) == ("Progressing", "Waiting")


def test_values_snippet_carries_the_same_script() -> None:
    snippet = yaml.safe_load((LUA.parent / "argocd-cm-values.yaml").read_text())
    script = snippet["configs"]["cm"]["resource.customizations.health.easerve.io_EPDDeployment"]
    assert script.strip() == LUA.read_text().strip(), (
        "argocd-cm-values.yaml is out of date with health.lua: regenerate it (see docs/gitops.md)"
    )
