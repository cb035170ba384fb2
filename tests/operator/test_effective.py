"""What runs: tuned values fill the searched fields a spec leaves unset; explicit values win.

``reconcile.effective.resolve`` is pure; the Reconciler tests drive the loop against the in-memory
fake client of test_loop.py: nothing is deployed during the first search, the tuned values are
applied once it ends (with no new generation), and the values tuned before keep running while a
new search runs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from easerve_operator.reconcile.effective import fingerprint, resolve, unset_fields
from easerve_operator.reconcile.loop import Owner, Reconciler
from easerve_runtime.api import parse_spec

from .test_loop import NS, FakeClient

REPO = Path(__file__).resolve().parents[2]
TUNED = {
    "allocation": {"encode": {"replicas": 4}, "prefill": {"replicas": 1, "tensorParallel": 2},
                   "decode": {"replicas": 1, "tensorParallel": 2}},
    "batchBound": 4,
    "offloadRatio": 0.3,
}


def raw_spec(**drop: bool) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "llava-v1.6-34b.yaml").read_text())
    spec = doc["spec"]
    spec["tuning"] = {"enabled": True, "targetRate": 2.0, "trialBudget": 6}
    if drop.get("allocation"):
        spec.pop("allocation")
    if drop.get("b"):
        spec["encode"].pop("batchBound")
    if drop.get("s"):
        spec.pop("offload")
    if drop.get("mode"):
        spec["smPartition"].pop("mode")
    return spec


def succeeded(raw: dict[str, Any], **best: Any) -> dict[str, Any]:
    spec = parse_spec(raw)
    b = {**TUNED, **best}
    return {
        "state": "Succeeded",
        "fingerprint": fingerprint(spec),
        "partition": "dynamic",
        "best": {
            "allocation": "4E-1P(tp2)-1D(tp2)",
            "specAllocation": b["allocation"],
            "batchBound": b["batchBound"],
            "offloadRatio": b["offloadRatio"],
        },
    }


def test_unset_fields_are_read_from_the_stored_spec() -> None:
    assert unset_fields(raw_spec()) == []
    assert unset_fields(raw_spec(allocation=True, b=True, s=True, mode=True)) == [
        "allocation", "encode.batchBound", "offload.ratio", "smPartition.mode"
    ]


def test_the_first_search_deploys_nothing_and_says_what_it_chooses() -> None:
    raw = raw_spec(allocation=True, b=True)
    r = resolve(raw, parse_spec(raw), {"state": "Running", "fingerprint": fingerprint(parse_spec(raw)),
                                        "phase": "Tuning", "trials": 2, "budget": 6, "trialsOn": "cluster"}, None)
    assert r.waiting == "HAS chooses allocation, encode.batchBound: Tuning, trial 2/6 (cluster trials)"
    assert r.effective() is None


def test_tuned_values_fill_only_the_unset_fields() -> None:
    raw = raw_spec(allocation=True, b=True)  # s = 0.5 and mode dynamic are explicit
    r = resolve(raw, parse_spec(raw), succeeded(raw), None)
    assert r.spec is not None and r.waiting is None
    assert r.spec.allocation.label() == "4E-1P(tp2)-1D(tp2)" and r.spec.encode.batch_bound == 4
    assert r.spec.offload.ratio == 0.5  # explicit wins over the tuned 0.3
    eff = r.effective()
    assert eff is not None and eff.source == "tuning"
    assert eff.sources == {"allocation": "tuned", "encode.batchBound": "tuned", "offload.ratio": "spec",
                           "smPartition.mode": "spec"}


def test_a_tuned_s_of_one_switches_an_unset_partition_off() -> None:
    raw = raw_spec(allocation=True, b=True, s=True, mode=True)
    r = resolve(raw, parse_spec(raw), succeeded(raw, offloadRatio=1.0), None)
    assert r.spec is not None and r.spec.offload.ratio == 1.0 and str(r.spec.sm_partition.mode) == "none"
    r = resolve(raw, parse_spec(raw), succeeded(raw), None)
    assert r.spec is not None and str(r.spec.sm_partition.mode) == "dynamic"


def test_a_tuned_value_that_breaks_an_explicit_one_is_refused_naming_the_field() -> None:
    raw = raw_spec(s=True)  # smPartition.mode dynamic stays explicit; a tuned s = 1 cannot run with it
    r = resolve(raw, parse_spec(raw), succeeded(raw, offloadRatio=1.0), None)
    assert r.spec is None and "spec.smPartition.mode" in r.errors[0]


def test_a_result_of_another_search_is_not_applied_but_what_ran_keeps_running() -> None:
    raw = raw_spec(allocation=True, b=True, s=True, mode=True)
    old = succeeded(raw)
    first = resolve(raw, parse_spec(raw), old, None)
    previous = first.effective()
    assert previous is not None
    raw2 = copy.deepcopy(raw)
    raw2["tuning"]["targetRate"] = 4.0  # a new search: another fingerprint
    running = {"state": "Running", "fingerprint": fingerprint(parse_spec(raw2))}
    r = resolve(raw2, parse_spec(raw2), running, previous.wire())
    assert r.waiting is None and r.spec is not None
    assert r.spec.allocation.label() == "4E-1P(tp2)-1D(tp2)" and r.spec.offload.ratio == 0.3


def test_a_failed_search_runs_the_defaults_and_tuning_off_needs_no_search() -> None:
    raw = raw_spec(b=True)
    failed = {"state": "Failed", "fingerprint": fingerprint(parse_spec(raw))}
    r = resolve(raw, parse_spec(raw), failed, None)
    assert r.waiting is None and r.spec is not None and r.spec.encode.batch_bound == 8
    assert r.sources["encode.batchBound"] == "default"
    raw["tuning"]["enabled"] = False
    r = resolve(raw, parse_spec(raw), None, None)
    assert r.waiting is None and r.sources["encode.batchBound"] == "default"


def owner(raw: dict[str, Any], status: dict[str, Any], generation: int = 1) -> Owner:
    return Owner(NS, "llava", "uid-1", generation, raw, status)


def test_the_loop_deploys_once_the_search_ends_without_a_new_generation() -> None:
    client = FakeClient()
    rec = Reconciler(client)
    raw = raw_spec(allocation=True, b=True, s=True, mode=True)
    fp = fingerprint(parse_spec(raw))
    o = owner(raw, {"tuning": {"state": "Running", "fingerprint": fp, "phase": "Profiling"}})
    rec.reconcile(o, lambda: client.children("llava"))
    assert client.objects == {}, "nothing is deployed while the first search runs"
    st = client.status_writes[-1]
    assert st["phase"] == "Progressing" and "effective" not in st
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["reason"] == "Tuning" and "HAS chooses allocation" in ready["message"]

    done = owner(raw, {"tuning": succeeded(raw)})
    assert rec.overlay_changed(done), "a finished search changes what runs"
    rec.reconcile(done, lambda: client.children("llava"))
    deps = {n: o for (k, _, n), o in client.objects.items() if k == "Deployment"}
    # 4 encode GPUs (one encode pod spans local_tp = 2 of them: the 34B backbone's TP for local prefill)
    enc = deps["llava-encode"]["spec"]
    per_pod = sum(int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
                  for c in enc["template"]["spec"]["containers"] if c["name"].startswith("encode"))
    assert enc["replicas"] * per_pod == 4
    assert not rec.overlay_changed(done)
    eff = client.status_writes[-1]["effective"]
    assert eff["allocationLabel"] == "4E-1P(tp2)-1D(tp2)" and eff["batchBound"] == 4 and eff["source"] == "tuning"
