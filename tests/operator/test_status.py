"""Status and drift rules, as pure functions (no cluster)."""

from __future__ import annotations

from pathlib import Path

from easerve_operator.reconcile import status as status_rules
from easerve_operator.reconcile.drift import covers, drifted
from easerve_operator.reconcile.status import StageObservation, status_differs
from easerve_runtime.api import load_manifest

REPO = Path(__file__).resolve().parents[2]
NAME, SPEC = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def obs(ready: int, desired: int, rolled: bool = True) -> StageObservation:
    return StageObservation(desired=desired, ready=ready, updated=desired, total=desired, rolled_out=rolled)


def compute_status(**kw: object) -> dict:  # noqa: D103
    """The wire form: what the operator writes."""
    return status_rules.compute_status(**kw).wire()  # type: ignore[arg-type]


def conds(st: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_ready_when_every_stage_is_complete() -> None:
    st = compute_status(generation=3, spec=SPEC, errors=[], stages={"encode": obs(2, 2), "prefill": obs(1, 1),
                                                                    "decode": obs(2, 2)}, now=NOW)
    assert st["phase"] == "Ready" and st["observedGeneration"] == 3
    c = conds(st)
    assert c["Ready"] == ("True", "AllStagesReady")
    assert c["Progressing"][0] == c["Degraded"][0] == c["Reconciling"][0] == c["Stalled"][0] == "False"
    assert st["readySummary"] == "2/2,1/1,2/2"
    assert st["effective"] == {"allocation": SPEC.allocation.wire(), "allocationLabel": "2E-1P(tp2)-2D(tp2)",
                               "batchBound": 8, "offloadRatio": 0.5, "source": "spec",
                                "smPartition": "dynamic", "sources": {}}


def test_progressing_while_pods_start_or_a_rollout_runs() -> None:
    st = compute_status(generation=1, spec=SPEC, errors=[], stages={"encode": obs(1, 2), "prefill": obs(1, 1),
                                                                    "decode": obs(2, 2, rolled=False)}, now=NOW)
    c = conds(st)
    assert st["phase"] == "Progressing"
    assert c["Ready"] == ("False", "PodsNotReady") and c["Progressing"] == ("True", "PodsNotReady")
    assert c["Reconciling"][0] == "True" and c["Stalled"][0] == "False"
    msg = next(x["message"] for x in st["conditions"] if x["type"] == "Ready")
    assert "encode 1/2 ready" in msg and "decode 2/2 ready (rolling out)" in msg


def test_invalid_spec_and_capacity_and_apply_errors_are_distinct() -> None:
    bad = compute_status(generation=2, spec=None, errors=["spec.allocation: too many GPUs"], stages={}, now=NOW)
    assert bad["phase"] == "Failed" and conds(bad)["Ready"] == ("False", "InvalidSpec")
    assert conds(bad)["Stalled"] == ("True", "InvalidSpec") and "stages" not in bad
    stages = {"encode": obs(0, 2), "prefill": obs(0, 1), "decode": obs(0, 2)}
    cap = compute_status(generation=2, spec=SPEC, errors=[], stages=stages, unschedulable=["p: Insufficient nvidia.com/gpu"],
                         now=NOW)
    assert cap["phase"] == "Degraded" and conds(cap)["Degraded"] == ("True", "InsufficientCapacity")
    assert conds(cap)["Ready"] == ("False", "InsufficientCapacity")
    err = compute_status(generation=2, spec=SPEC, errors=[], stages=stages, apply_error="Service x: Forbidden", now=NOW)
    assert conds(err)["Degraded"] == ("True", "ApplyFailed") and err["phase"] == "Degraded"


def test_transition_time_moves_only_when_status_flips() -> None:
    stages = {"encode": obs(1, 2), "prefill": obs(1, 1), "decode": obs(2, 2)}
    first = compute_status(generation=1, spec=SPEC, errors=[], stages=stages, now=NOW)
    again = compute_status(generation=1, spec=SPEC, errors=[], stages=stages, previous_conditions=first["conditions"],
                           now=LATER)
    assert not status_differs(first, again), "re-observing the same state writes nothing"
    stages["encode"] = obs(2, 2)
    done = compute_status(generation=1, spec=SPEC, errors=[], stages=stages, previous_conditions=again["conditions"],
                          now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times["Ready"] == LATER and times["Degraded"] == NOW  # Degraded stayed False
    assert status_differs(again, done)


def test_scaled_to_zero_stage_counts_as_complete() -> None:
    zero = StageObservation(desired=0, rolled_out=True)
    assert zero.complete
    assert not StageObservation(desired=0, total=1, rolled_out=True).complete


def test_covers_ignores_server_defaults_but_not_edits() -> None:
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "a", "ports": [
        {"containerPort": 80, "protocol": "TCP"}]}], "volumes": []}}}}
    live = {"spec": {"replicas": 2, "revisionHistoryLimit": 10, "template": {"spec": {"containers": [
        {"name": "a", "imagePullPolicy": "IfNotPresent", "ports": [{"containerPort": 80, "protocol": "TCP"}]}]}}}}
    assert covers(live, desired)
    live["spec"]["replicas"] = 7
    assert not covers(live, desired)
    live["spec"]["replicas"] = 2
    live["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"})
    assert not covers(live, desired), "an extra container in a list we own is drift"


def test_drifted_checks_metadata_we_own() -> None:
    desired = {"kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "1"}, "annotations": {"h": "1"},
                                                 "ownerReferences": [{"uid": "u"}]}, "data": {"k": "v"}}
    live = {"kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "1", "other": "2"},
                                              "annotations": {"h": "1"}, "ownerReferences": [{"uid": "u"}]},
            "data": {"k": "v"}}
    assert not drifted(live, desired)
    assert drifted(None, desired)
    assert drifted({**live, "data": {"k": "edited"}}, desired)
    assert drifted({**live, "metadata": {**live["metadata"], "annotations": {}}}, desired)


def test_docs_print_the_one_conditions_table() -> None:
    from easerve_runtime.api.status import conditions_table_markdown

    assert conditions_table_markdown() in (REPO / "docs" / "api.md").read_text()


def _undeclared(value: object, schema: dict, path: str) -> list[str]:
    """Paths in ``value`` that the structural schema would prune."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        props, addl = schema.get("properties"), schema.get("additionalProperties")
        out = []
        for k, v in value.items():
            sub = (props or {}).get(k) if props else addl
            if sub is None:
                out.append(f"{path}.{k}")
            else:
                out += _undeclared(v, sub, f"{path}.{k}")
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _undeclared(v, schema.get("items", {}), f"{path}[{i}]")]
    return []


def test_every_written_status_field_is_in_the_crd_schema() -> None:
    """What the operator writes (disaggregated, omni, invalid, tuning) is never pruned."""
    from easerve_operator.api.crd import build_crd
    from easerve_operator.reconcile.tuning import tuning_patch
    from easerve_runtime.api import TuningState, TuningStatus

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    _, omni = load_manifest(REPO / "examples" / "qwen2.5-omni.yaml")
    written = [
        compute_status(generation=1, spec=SPEC, errors=[], stages={"encode": obs(1, 2), "prefill": obs(1, 1),
                                                                   "decode": obs(2, 2)}, config_hash="abc", now=NOW),
        compute_status(generation=1, spec=omni, errors=[], stages={"omni": obs(1, 1)}, now=NOW),
        compute_status(generation=2, spec=None, errors=["metadata.name: too long"], stages={}, now=NOW),
        tuning_patch(TuningStatus(state=TuningState.RUNNING, fingerprint="f", trials=0, budget=4)),
    ]
    assert written[1]["stages"] == {"omni": {"desired": 1, "ready": 1}}
    assert written[0]["configHash"] == "abc"
    for st in written:
        assert _undeclared(st, schema, "status") == []
    assert _undeclared({"stages": {"bogus": {}}}, schema, "status") == ["status.stages.bogus"]
