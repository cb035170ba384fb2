"""The autopilot on the local cluster (issue 14): B and s follow a step in the load while the video
example serves, through its frontend Service, with no failed request and no pod restart; the operator
reads the arrival rate from a real Prometheus, re-tunes at each step, and records each re-tune
(status.adapt.retunes) and each change (status.adapt.decisions).

Whether a step moves the knobs is the calibrated twin's answer, and near this load it is a near-tie
(s 0.6-0.9 within 1 % of the best goodput, decided by mean TTFT, which moves with the calibration
each run reads): the test asserts that each step is re-tuned for and that what runs, in status and
in the ConfigMap, is the last answer applied, not that the answer differs.

The deployment's B and s are left to HAS (its search runs on the twin: seconds), the allocation is the
example's. The sim engine runs 2x faster than modelled (``spec.pod.env``); the trace below is in
real time, so 1 / 2.6 / 1 req/s here are 0.5 / 1.3 / 0.5 req/s of the model, which is what the
operator compares with the tuned rate (1 req/s, band 0.3) after mapping the figures back: each
segment is out of the band of the one before. (At 2 model req/s this deployment refuses load on this
host even with the deeper admission queue set below.)
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest
import yaml

from .conftest import REPO, PodsCluster, send_load

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
EXAMPLE = REPO / "examples" / "qwen2.5-vl-32b.yaml"
STEPS = ((30.0, 1.0), (45.0, 2.6), (45.0, 1.0))  # (seconds, req/s), real time: 0.5 / 1.3 / 0.5 of the model


def step_trace(spec: Any) -> list[Any]:
    from easerve_runtime.workload import generate

    out, t0 = [], 0.0
    for i, (dur, rate) in enumerate(STEPS):
        for r in generate(spec, rate, int(dur * rate * 1.5), seed=40 + i):
            if r.arrival_s < dur:
                out.append(dataclasses.replace(r, id=f"s{i}-{r.id}", arrival_s=t0 + r.arrival_s))
        t0 += dur
    return out


def apply_and_wait_tuned(c: PodsCluster, ns: str, doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Apply the manifest; wait for its search to end and its pods to serve; (name, status)."""
    name = doc["metadata"]["name"]
    r = c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 300
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = c.epd(ns, name).get("status") or {}
        if (st.get("tuning") or {}).get("phase") == "Ready" and st.get("phase") == "Ready":
            break
        time.sleep(1)
    else:
        pytest.fail(f"not Ready: {json.dumps(st)[:1500]}\n{c.diagnose(ns)}")
    c.wait_ready(ns, name, timeout=120)
    return name, st


@pytest.mark.timeout(900)
def test_b_and_s_follow_a_step_in_the_load_live(pods_cluster: PodsCluster) -> None:
    from easerve_runtime.api import load_manifest

    c = pods_cluster
    ns = c.namespace()
    doc = yaml.safe_load(EXAMPLE.read_text())
    sp = doc["spec"]
    sp["encode"].pop("batchBound")
    sp.pop("offload")
    sp["smPartition"].pop("mode")
    sp["tuning"] = {"enabled": True, "targetRate": 1.0, "trialBudget": 3, "requestsPerTrial": 100, "trials": "twin",
                    "adapt": {"enabled": True, "band": 0.3, "holdSeconds": 8, "minIntervalSeconds": 15,
                              "guardWindowSeconds": 10}}
    sp["observability"] = {"prometheusUrl": c.prometheus_url}
    # the admission queue is sized from the profile's capacity (7 here); on a 2-core CI host the
    # cluster's own processes slow the pods at the 2.6 req/s step and a few requests were refused
    # (429). This test is about the knobs following the load, not about admission control (its
    # own tests are in tests/runtime): a deeper queue keeps refusals out, and every accepted
    # request must still complete
    sp.setdefault("limits", {})["maxQueuedRequests"] = 64
    sp["pod"] = {"env": [{"name": "EASERVE_SIM_SPEEDUP", "value": "2"}, {"name": "EASERVE_SIM_BYTES_SCALE", "value": "0.01"}]}
    name, st = apply_and_wait_tuned(c, ns, doc)
    tuned = st["effective"]
    pods_before = {p["metadata"]["name"] for p in c.pods(ns, name)}
    pids_before = dict(c.runner.pids(ns))

    _, spec = load_manifest(str(EXAMPLE))
    reqs = step_trace(spec)
    out = send_load(c.frontend_url(ns, name, stage="encode"), EXAMPLE, n=len(reqs), rate=0, reqs=reqs, timeout_s=240)
    failed = [o.record.error for o in out if not o.record.ok]
    time.sleep(12)  # the last window's observation
    st = c.epd(ns, name).get("status") or {}
    adapt = st.get("adapt") or {}
    print(json.dumps({"tuned": {k: tuned[k] for k in ("batchBound", "offloadRatio")}, "adapt": adapt,
                      "effective": st.get("effective"), "failed": failed[:5], "sent": len(reqs)}, indent=1)[:5000])
    assert not failed, failed[:5]
    ds = adapt.get("decisions") or []
    start = {"batchBound": tuned["batchBound"], "offloadRatio": tuned["offloadRatio"]}
    assert not ds or ds[0]["old"] == start, ds
    # the step up (0.5 -> 1.3 model req/s) was re-tuned for, and the step down after it; the observed
    # rate is the median of the hold window, read while a 10 s rate() window fills, so it lags a step
    # (it read 1.0 for the 1.3 step in one run): the directions are asserted, not the exact rates
    rs = adapt.get("retunes") or []
    ups = [r for r in rs if r["direction"] == "above" and r["observedRate"] >= 0.8]
    assert ups, rs
    up = ups[0]
    retunes_applied = [d for d in ds if d["kind"] == "retune"]
    assert [d["new"] for d in retunes_applied] == [r["answer"] for r in rs if r["applied"]][-len(retunes_applied):], (ds, rs)
    if up["applied"]:  # the knobs followed: the change is a decision, with the twin's expectation
        d = next(d for d in retunes_applied if d["at"] == up["at"])
        assert d["new"] == up["answer"] != d["old"] and "above the band" in d["reason"], d
        assert d["predictedGoodput"] == up["predictedGoodput"] is not None, d
    else:  # the knobs in force were already the twin's best for the new rate (near-ties at this load)
        before = [d["new"] for d in ds if d["at"] <= up["at"]]
        assert up["answer"] == (before[-1] if before else start), (up, ds)
    later = rs[rs.index(up) + 1:]
    assert any(r["direction"] == "below" for r in later) or any(d["kind"] == "rollback" for d in ds), (rs, ds)
    # what runs is the last answer applied, in status and in the ConfigMap the encode workers follow
    in_force = ds[-1]["new"] if ds else start
    assert adapt["knobs"] == in_force, (adapt["knobs"], ds)
    from easerve_operator.render.stages import config_map_name

    r = c.kubectl("get", "configmap", "-n", ns, config_map_name(name), "-o", "json")
    assert r.returncode == 0, r.stderr
    cm = json.loads(json.loads(r.stdout)["data"]["config.json"])["spec"]
    assert (cm["encode"]["batchBound"], cm["offload"]["ratio"]) == tuple(in_force.values()), cm
    assert {p["metadata"]["name"] for p in c.pods(ns, name)} == pods_before, "no pod was replaced"
    assert c.runner.pids(ns) == pids_before, "no process restarted"
    assert adapt["pinned"] == [] and st["effective"]["sources"]["allocation"] == "spec"
    # each re-tune ran a twin calibrated with the costs the pods measured (read from Prometheus)
    cal = adapt.get("calibration") or {}
    assert {"encodeBatchSeconds", "encodeItemsPerBatch", "tpotSeconds"} <= set(cal.get("measured") or {}), cal
    assert cal["encode"] > 0 and cal["decode"] > 0 and cal["prefill"] == 1.0, cal
    c.delete_namespace_and_wait(ns)


@pytest.mark.timeout(900)
def test_an_allowed_allocation_change_rolls_the_pods_under_load(pods_cluster: PodsCluster) -> None:
    """allowAllocationChanges with the allocation left to HAS: the pods run decode 2x slower than
    the profile says (``EASERVE_SIM_COST_SCALE``: hardware that differs from its profile), which the
    operator cannot know until it measures it. The load drops below the tuned band; the re-tune,
    calibrated with the TPOT read from Prometheus, finds that a decode pool with more GPUs pays,
    applies it, and the pods roll to it while the load goes on. Every request is answered."""
    c = pods_cluster
    ns = c.namespace()
    doc = yaml.safe_load(EXAMPLE.read_text())
    sp = doc["spec"]
    sp.pop("allocation")
    sp["encode"].pop("batchBound")
    sp.pop("offload")
    sp["smPartition"].pop("mode")
    sp["tuning"] = {"enabled": True, "targetRate": 1.0, "trialBudget": 3, "requestsPerTrial": 100, "trials": "twin",
                    "adapt": {"enabled": True, "band": 0.3, "holdSeconds": 8, "minIntervalSeconds": 15,
                              "guardWindowSeconds": 10, "allowAllocationChanges": True}}
    sp["observability"] = {"prometheusUrl": c.prometheus_url}
    sp.setdefault("limits", {})["maxQueuedRequests"] = 64
    sp["pod"] = {"env": [{"name": "EASERVE_SIM_SPEEDUP", "value": "2"}, {"name": "EASERVE_SIM_BYTES_SCALE", "value": "0.01"},
                         {"name": "EASERVE_SIM_COST_SCALE", "value": "decode=2"}]}
    tuned_rate, band = sp["tuning"]["targetRate"], sp["tuning"]["adapt"]["band"]
    name, st = apply_and_wait_tuned(c, ns, doc)
    tuned = st["effective"]
    assert tuned["sources"]["allocation"] == "tuned"
    pods_before = {p["metadata"]["name"]: p["metadata"]["labels"]["easerve.io/stage"] for p in c.pods(ns, name)}

    # 0.5 model req/s (1 real req/s at 2x): below the band around the tuned 1 req/s
    out = send_load(c.frontend_url(ns, name, stage="encode"), EXAMPLE, n=150, rate=1.0, seed=50, timeout_s=300)
    failed = [o.record.error for o in out if not o.record.ok]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the roll may outlast the load
        st = c.epd(ns, name).get("status") or {}
        adapt = st.get("adapt") or {}
        if (adapt.get("allocationLabel") and st.get("phase") == "Ready"
                and (st.get("effective") or {}).get("allocationLabel") == adapt["allocationLabel"]):
            break
        time.sleep(2)
    adapt = st.get("adapt") or {}
    print(json.dumps({"tuned": tuned, "adapt": adapt, "effective": st.get("effective"), "failed": failed[:5],
                      "sent": len(out)}, indent=1)[:6000])
    assert not failed, failed[:5]
    moves = [d for d in adapt.get("decisions") or [] if d.get("newAllocation")]
    assert moves, adapt
    d = moves[0]
    assert d["oldAllocation"] == tuned["allocationLabel"] and d["newAllocation"] != tuned["allocationLabel"]
    # the move is made for a load below the band around the tuned rate; its reason may name a later
    # reference: on a 2-core CI host the first hold window read the load while the 10 s rate()
    # window was still filling (0.255 model req/s), re-tuned the knobs for it, and the move came on
    # the next window, "above the band around 0.255" at 0.361. The claim is the load, not the wording
    assert "the band" in d["reason"] and d["predictedGoodput"] is not None
    assert d["observedRate"] < tuned_rate * (1 - band), d
    assert adapt["calibration"]["decode"] >= 1.5, adapt["calibration"]  # it measured the slow decode
    eff = st["effective"]
    assert eff["allocationLabel"] == adapt["allocationLabel"] == d["newAllocation"]
    assert eff["sources"]["allocation"] == "adapted"
    pods_after = {p["metadata"]["name"]: p["metadata"]["labels"]["easerve.io/stage"] for p in c.pods(ns, name)}
    assert set(pods_after) != set(pods_before), "the pods rolled"
    spec_now = c.epd(ns, name)["spec"]
    assert "allocation" not in spec_now, "the operator never writes spec"
    c.delete_namespace_and_wait(ns)
