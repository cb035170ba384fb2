"""HAS run by the operator ON the local cluster (issue 13): profiling Jobs, trial roll-outs, load Jobs,
scores from a real Prometheus, the tuned configuration deployed and served, and a search that
survives SIGKILLs of the operator.

The pods run the sim engine, so a cluster trial must agree with the twin's prediction for the same
candidate and requests (``tuning.agreement``): this test asserts the throughput bar (5 %) and prints
the TTFT ratios. The P99 of a 100-request trial is its slowest request or two, and on a loaded 2-core
host it moved by -26 % to +9 % between two runs of the same candidate (docs/benchmarks.md): the 10 %
P99 bar is measured on longer trials by ``benchmarks/has_cluster.py``, not asserted here. The
Prometheus figures must agree with the load Job's own report (3 %), and the pick must be the one
``easerve tune --backend sim`` makes for the same spec. The sim engine runs at 2x (4x in the kill
test) with 1 % of the embedding bytes materialised (``spec.pod.env``); every figure is mapped back
to the model's time by the trial runner.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import REPO, PodsCluster, send_load

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"
RATE, REQUESTS, BUDGET = 2.0, 100, 3
PHASES = ["Profiling", "Tuning", "Deploying", "Ready"]


def tuned_manifest(prometheus: str, speedup: str) -> dict[str, Any]:
    """The example with every searched field left to HAS, trials on the cluster."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    sp = doc["spec"]
    sp.pop("allocation")
    sp["encode"].pop("batchBound")
    sp.pop("offload")
    sp["smPartition"].pop("mode")
    sp["tuning"] = {"enabled": True, "targetRate": RATE, "trialBudget": BUDGET, "requestsPerTrial": REQUESTS,
                    "trials": "cluster"}
    sp["observability"] = {"prometheusUrl": prometheus}
    sp["pod"] = {"env": [{"name": "EASERVE_SIM_SPEEDUP", "value": speedup},
                         {"name": "EASERVE_SIM_BYTES_SCALE", "value": "0.01"}]}
    return doc


class Watch:
    """Polls status.tuning; keeps the sequence of phases it saw."""

    def __init__(self, c: PodsCluster, ns: str, name: str) -> None:
        self.c, self.ns, self.name = c, ns, name
        self.phases: list[str] = []
        self.status: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        self.status = self.c.epd(self.ns, self.name).get("status") or {}
        phase = (self.status.get("tuning") or {}).get("phase")
        if phase and (not self.phases or self.phases[-1] != phase):
            self.phases.append(phase)
        return self.status

    def until(self, pred: Any, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.poll()
            if (st.get("tuning") or {}).get("state") == "Failed":
                pytest.fail(f"the search failed: {st['tuning'].get('message')}\n{self.c.diagnose(self.ns)}")
            if pred(st):
                return st
            time.sleep(1.0)
        raise TimeoutError(f"{what} not within {timeout}s (phases {self.phases}, tuning "
                           f"{json.dumps(self.status.get('tuning'))[:800]})\n{self.c.diagnose(self.ns)}")


def tuning_objects(c: PodsCluster, ns: str) -> list[str]:
    r = c.kubectl("get", "jobs,deployments,services,configmaps", "-n", ns, "-l", "easerve.io/tuning-of", "-o", "name")
    return [x for x in r.stdout.split() if x]


@pytest.mark.timeout(1200)
def test_the_operator_tunes_on_the_cluster_and_runs_the_result(pods_cluster: PodsCluster) -> None:
    from easerve_operator.tuning.agreement import trial_agreement
    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.space import space_for
    from easerve_runtime.api import parse_spec

    c = pods_cluster
    ns = c.namespace()
    doc = tuned_manifest(c.prometheus_url, "2")
    name = doc["metadata"]["name"]
    t0 = time.monotonic()
    r = c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    assert r.returncode == 0, r.stderr
    w = Watch(c, ns, name)
    st = w.until(lambda s: (s.get("tuning") or {}).get("phase") == "Ready", 900, "the tuned deployment")
    wall = time.monotonic() - t0
    tu = st["tuning"]
    print(json.dumps({"phases": w.phases, "wall_s": round(wall, 1), "tuning": tu}, indent=1)[:6000])

    # phases, in order; Stage 1 measured by this cluster's profiling Jobs
    assert [p for p in PHASES if p in w.phases] == PHASES and w.phases[-1] == "Ready", w.phases
    assert tu["stage1Sources"] == {"encode": "job", "prefill": "job", "decode": "job"}
    assert tu["state"] == "Succeeded" and tu["nTrials"] == BUDGET and tu["trialsOn"] == "cluster"
    assert sorted(tu["applies"]) == ["allocation", "encode.batchBound", "offload.ratio", "smPartition.mode"]

    # every trial scored from Prometheus, and Prometheus agrees with the load Job's own report
    spec = parse_spec(yaml.safe_load(EXAMPLE.read_text())["spec"])
    details = tu["trialsDetail"]
    assert [d["trial"] for d in details] == list(range(1, BUDGET + 1))
    agreement = []
    for d in details:
        assert d["metricsSource"] == "prometheus" and d["state"] == "complete", d
        assert d["cluster"]["crosscheck"]["within3pct"], d["cluster"]["crosscheck"]
        # each stage's engine time against its profile, from the scraped counters (model time): the
        # sim engine pays back its late sleeps, so not below the profile's time (an early wake-up aside)
        eop = d["prometheusWholeRun"]["engineOverProfile"]
        assert "encode" in eop and all(v >= 0.95 for v in eop.values()), eop
        a = trial_agreement(spec, d, RATE, REQUESTS)
        agreement.append(a)
        print("agreement", json.dumps({k: a[k] for k in ("trial", "candidate", "ratios")}))
        assert abs(a["ratios"]["throughput"] - 1) <= 0.05, a  # the bar; latency ratios: printed (see above)

    # the pick is the one the same search makes on the twin: the same candidates were tried, and the
    # cluster's pick is the twin's, or one the twin ranks level with it (throughput within the
    # selection's 1 %, mean TTFT within the 10 % that one measured trial's mean moves by here: the
    # tie-breaker cannot tell them apart on this host); goodput at the objective tier within 5 %
    twin_spec = parse_spec(copy.deepcopy(doc["spec"]))
    prof = SimStageProfiler(twin_spec, rate=RATE)
    sim = tune(twin_spec, runner=SimRunner(), profiler=prof, space=space_for(twin_spec, prof.min_tp(),
               local_tp=prof.local_prefill_tp()), rate=RATE, rules=StopRules(budget=BUDGET), requests=REQUESTS)
    assert sim.best is not None
    assert [r.candidate.to_dict() for r in sim.trials] == [d["point"] for d in details]
    best = tu["best"]
    won = next(a for a, d in zip(agreement, details, strict=True) if d["candidate"].startswith(
        f"{best['allocation']} B={best['batchBound']} "))
    twin_best = sim.best.metrics
    print("pick", json.dumps({"cluster": best["allocation"], "sim": sim.best.allocation}))
    if best["allocation"] != sim.best.allocation:
        assert won["twin"]["throughput"] == pytest.approx(twin_best.throughput, rel=0.01)
        assert won["twin"]["ttftMean"] == pytest.approx(twin_best.ttft_mean, rel=0.10)
    tier = spec.slo.objective
    won_d = next(d for d in details if d["trial"] == won["trial"])
    assert won_d["prometheusWholeRun"]["goodput"][tier] == pytest.approx(twin_best.goodput[tier], rel=0.05)

    # the tuned values run (spec untouched), and serve
    eff = st["effective"]
    assert eff["sources"] == {k: "tuned" for k in tu["applies"]}
    assert eff["allocationLabel"] == best["allocation"] and eff["batchBound"] == best["batchBound"]
    stored = c.epd(ns, name)["spec"]
    assert "allocation" not in stored and "offload" not in stored  # the operator never writes spec
    assert st["phase"] == "Ready"
    outcomes = send_load(c.frontend_url(ns, name), EXAMPLE, n=10, rate=2.0)
    assert all(o.record.ok for o in outcomes), [o.record.error for o in outcomes]
    assert tuning_objects(c, ns) == [], "trials and profiling Jobs are torn down"
    Path(c.work / "tuning_cluster_result.json").write_text(json.dumps(
        {"wall_s": wall, "phases": w.phases, "tuning": tu, "agreement": agreement}, indent=1, default=str))
    c.delete_namespace_and_wait(ns)  # its 8 GPUs go back to the node


@pytest.mark.timeout(1500)
def test_a_search_killed_during_profiling_and_mid_trial_resumes(pods_cluster: PodsCluster) -> None:
    """SIGKILL of the operator while the profiling Jobs run, and again while trial 2 runs: the search
    goes on from its records: finished profiles are reused, the cut-off trial is rerun once and
    marked so, no trial is lost or run twice. (Killed between trials: tests/operator/
    test_tuning_daemon.py, with twin trials.)"""
    c = pods_cluster
    ns = c.namespace()
    doc = tuned_manifest(c.prometheus_url, "4")
    name = doc["metadata"]["name"]
    r = c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    assert r.returncode == 0, r.stderr
    w = Watch(c, ns, name)

    def profile_done(stage: str) -> bool:
        out = c.kubectl("get", "job", "-n", ns, "-l", f"easerve.io/profile={stage}", "-o", "json").stdout
        items = json.loads(out or '{"items": []}')["items"]
        return any((j.get("status") or {}).get("succeeded") for j in items)

    w.until(lambda s: profile_done("encode") and (s.get("tuning") or {}).get("phase") == "Profiling", 300,
            "the encode profile finishing while the others run")
    time.sleep(3.0)  # the operator reads the encode report (it polls every 2 s)
    assert c.kill_operator() != 0
    c.start_operator()
    w.until(lambda s: ((s.get("tuning") or {}).get("currentTrial") or "").startswith("2:"), 600, "trial 2")
    w.until(lambda s: bool(c.kubectl("get", "deploy", "-n", ns, "-l", "easerve.io/trial=2", "-o", "name").stdout),
            120, "trial 2's Deployments")
    time.sleep(5.0)  # into the trial
    assert c.kill_operator() != 0
    c.start_operator()
    st = w.until(lambda s: (s.get("tuning") or {}).get("phase") == "Ready", 900, "the tuned deployment")
    tu = st["tuning"]
    print(json.dumps({"phases": w.phases, "tuning": tu}, indent=1)[:4000])
    details = tu["trialsDetail"]
    # each trial once: trial 1 from the records (measured before the second kill), 2 rerun, 3 fresh
    assert tu["nTrials"] == BUDGET and tu["resumedTrials"] == 1
    assert [d["trial"] for d in details] == list(range(1, BUDGET + 1))
    assert details[0].get("resumed") is True and details[0]["state"] == "complete"
    assert details[1]["cluster"]["rerun"] is True and details[2]["cluster"]["rerun"] is False
    assert all(d["state"] == "complete" for d in details)
    assert tu["stage1Sources"]["encode"] == "recovered"  # finished before the first kill: not profiled again
    assert st["effective"]["sources"]["allocation"] == "tuned" and st["phase"] == "Ready"
    assert tuning_objects(c, ns) == []
    c.delete_namespace_and_wait(ns)
