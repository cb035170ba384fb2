"""``KubeRunner``'s logic against a fake of its five-call ``TrialCluster`` and a fake Prometheus.

The fake cluster keeps applied objects in a dict, becomes ready after a few polls (or never),
and "runs" the load Job by producing a report in the bench's format with started/finished
times on the fake clock. The scorer is the real ``figures_from_series`` over synthetic scrapes
of one completion per second, so the window arithmetic (warm-up cut, idle edges) is real.
The end-to-end cluster test runs once pods run under the kubelet harness (issue 12).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from easerve_operator.tuning.loop import StopRules
from easerve_operator.tuning.prometheus import figures_from_series
from easerve_operator.tuning.runners.kube import (
    TRIAL_LABEL,
    TUNING_OF_LABEL,
    KubeRunner,
    TrialFailed,
    parse_report,
    render_trial,
)
from easerve_operator.tuning.search import tune
from easerve_operator.tuning.space import space_for

UID = "0000-parent-uid"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeCluster:
    def __init__(
        self,
        clock: Clock,
        ready_after: int = 2,
        never_ready: set[int] | None = None,
        job_fails: bool = False,
        run_s: float = 50.0,
    ) -> None:
        self.clock = clock
        self.ready_after = ready_after
        self.never_ready = never_ready or set()
        self.job_fails = job_fails
        self.run_s = run_s
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.polls = 0
        self.job_started: dict[str, float] = {}

    def apply(self, obj: dict[str, Any]) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("apply", key))
        self.objects[key] = obj
        if obj["kind"] == "Job":
            self.job_started[obj["metadata"]["name"]] = self.clock()

    def delete_labelled(self, namespace: str, labels: Mapping[str, str]) -> int:
        gone = [
            k
            for k, o in self.objects.items()
            if all(o["metadata"].get("labels", {}).get(a) == b for a, b in labels.items())
        ]
        for k in gone:
            del self.objects[k]
        self.calls.append(("delete", dict(labels)))
        return len(gone)

    def not_ready(self, namespace: str, deployments: list[str]) -> dict[str, str]:
        self.polls += 1
        trial = int(next(iter(self.objects.values()))["metadata"]["labels"][TRIAL_LABEL])
        if trial in self.never_ready or self.polls <= self.ready_after:
            return {d: "0/1 available" for d in deployments}
        return {}

    def job_state(self, namespace: str, name: str) -> str:
        if self.clock() < self.job_started[name] + self.run_s:
            return "active"
        return "failed" if self.job_fails else "succeeded"

    def job_logs(self, namespace: str, name: str) -> str:
        if "-profile-" in name:
            return twin_profile_log(self.objects[("Job", name)], self.objects[("ConfigMap", name)])
        if self.job_fails:
            return "Traceback: connection refused\n"
        start = self.job_started[name] + 2.0
        end = start + 40.0
        rep = {
            "completed": 40,
            "failed": 0,
            "throughput": 1.0,
            "goodput": {"moderate": 1.0},
            "ttft_mean": 0.3,
            "started_at": start,
            "finished_at": end,
        }
        return "bench: starting\n" + json.dumps(rep, indent=1) + "\n"


def twin_profile_log(job: dict[str, Any], cm: dict[str, Any]) -> str:
    """What the profiling Job prints, with the twin's capacities as its measurements (the fake runs
    no process; the Job itself runs under the kubelet harness in tests/cluster). The spec is the one
    the Job's ConfigMap carries."""
    import yaml
    from easerve_operator.tuning.runners.sim import SimStageProfiler
    from easerve_runtime.api import parse_spec

    c = job["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    arg = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    manifest = yaml.safe_load(cm["data"]["manifest.yaml"])
    tw = SimStageProfiler(parse_spec(manifest["spec"]), rate=2.0)
    stage = arg["--stage"]
    rep: dict[str, Any] = {"stage": stage, "backend": "sim", "time_scale": 1.0}
    if stage == "encode":
        b, rep["encode"] = 1, []
        while b <= int(arg["--max-batch"]):
            p = tw.encode_throughput(b)
            rep["encode"].append({"batch": b, "value": p.value, "cost_s": p.cost_s})
            b *= 2
    else:
        tps = [int(t) for t in arg["--tp"].split(",")]
        fn = tw.prefill_capacity if stage == "prefill" else tw.decode_capacity
        rep[stage] = {str(t): {"value": fn(t).value, "cost_s": fn(t).cost_s} for t in tps}
        if stage == "prefill":
            rep["local_ref"] = rep["prefill"][str(min(tps))]
            rep["local"] = {
                s: {"value": tw._inner.local_prefill_capacity(float(s)).value, "cost_s": 1.0}
                for s in arg["--local-shares"].split(",")
            }
    return "profiling\n" + json.dumps(rep) + "\n"


class SyntheticPrometheus:
    """Scrapes every second of one completion per second over the bench's run."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.calls: list[tuple[str, float, float, bool, bool]] = []

    def __call__(self, trial: str) -> SyntheticPrometheus:
        self.trial = trial
        return self

    def score(
        self, start: float, end: float, *, idle_before_start: bool = False, drained_at_end: bool = True
    ):
        self.calls.append((self.trial, start, end, idle_before_start, drained_at_end))
        job = self.cluster.job_started[f"{self.trial}-load"]
        t0, t1 = job + 2.0, job + 42.0  # the run of the fake bench: 40 completions, one per second
        pts = [(t0 - 5 + k, float(min(40, max(0, k - 5)))) for k in range(0, 60)]
        good = [(t, v * 0.9) for t, v in pts]
        series = [
            ({"__name__": "easerve_requests_total", "status": "ok"}, pts),
            ({"__name__": "easerve_goodput_requests_total", "tier": "moderate"}, good),
            ({"__name__": "easerve_ttft_seconds_sum"}, [(t, v * 0.2) for t, v in pts]),
            ({"__name__": "easerve_ttft_seconds_count"}, pts),
            ({"__name__": "easerve_ttft_seconds_bucket", "le": "0.25"}, pts),
            ({"__name__": "easerve_ttft_seconds_bucket", "le": "+Inf"}, pts),
        ]
        assert t0 <= start < end <= t1
        return figures_from_series(
            series, start, end, idle_before_start=idle_before_start, drained_at_end=drained_at_end
        )


def runner(cluster: FakeCluster, clock: Clock, tmp: Path | None = None, **kw: Any) -> KubeRunner:
    return KubeRunner(
        cluster=cluster,
        deployment="llava",
        namespace="ns",
        uid=UID,
        scorer_for=SyntheticPrometheus(cluster),
        clock=clock,
        sleep=clock.sleep,
        report_dir=tmp,
        ready_timeout_s=30.0,
        **kw,
    )


def test_trial_objects_are_the_deployments_children_labelled_and_owned(image_spec):
    objs = render_trial("llava", "ns", UID, 7, image_spec)
    assert {o["kind"] for o in objs} == {"ConfigMap", "Deployment", "Service"}
    for o in objs:
        assert o["metadata"]["name"].startswith("llava-t7-")
        assert o["metadata"]["labels"][TRIAL_LABEL] == "7"
        assert o["metadata"]["labels"][TUNING_OF_LABEL] == "llava"
        (ref,) = o["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "EPDDeployment",
            "llava",
            UID,
            False,
        )
        if o["kind"] == "Deployment":
            assert o["spec"]["template"]["metadata"]["labels"][TRIAL_LABEL] == "7"
    assert all(
        "ownerReferences" not in o["metadata"] for o in render_trial("llava", "ns", None, 7, image_spec)
    )


def test_a_trial_rolls_out_loads_scores_from_prometheus_and_tears_down(image_spec, tmp_path):
    clock = Clock()
    cluster = FakeCluster(clock)
    r = runner(cluster, clock, tmp_path)
    m = r.run_trial(image_spec, rate=1.0, requests=40, seed=4)
    # left-overs of the same trial are deleted before anything is applied; all is gone after
    assert cluster.calls[0] == ("delete", {TRIAL_LABEL: "1", TUNING_OF_LABEL: "llava"})
    assert cluster.calls[-1] == ("delete", {TRIAL_LABEL: "1", TUNING_OF_LABEL: "llava"})
    assert cluster.objects == {}
    applied = [k for c, k in cluster.calls if c == "apply"]
    assert applied[-1] == ("Job", "llava-t1-load") and applied[-2] == ("ConfigMap", "llava-t1-load")
    # the load Job ran bench against the trial's frontend Service with the search's workload
    rec = r.last
    assert rec["trial"] == 1 and rec["metrics_source"] == "prometheus"
    # the scorer got the warm-up-cut window (10 % of the 40 s run) and the whole run
    (_, s1, e1, idle1, drained1), (_, s2, e2, idle2, _) = r.scorer_for.calls  # type: ignore[attr-defined]
    start, end = rec["job_report"]["started_at"], rec["job_report"]["finished_at"]
    assert (s1, e1, idle1, drained1) == (pytest.approx(start + 4.0), end, False, True)
    assert (s2, e2, idle2) == (start, end, True)
    # metrics are Prometheus's: 36 completions in the 36 s after warm-up; goodput 0.9 of them
    assert m.throughput == pytest.approx(1.0) and m.completed == 36
    assert m.goodput["moderate"] == pytest.approx(0.9)
    assert m.ttft_mean == pytest.approx(0.2)
    # the Job's own report is kept beside it, and the cross-check compares the whole run
    assert rec["job_report"]["throughput"] == 1.0
    assert rec["crosscheck"]["ratios"]["throughput"] == pytest.approx(1.0)
    assert rec["crosscheck"]["ratios"]["goodput@moderate"] == pytest.approx(0.9)
    assert rec["crosscheck"]["within_3pct"] is False  # goodput differs by 10 %: flagged
    assert set(rec["phases_s"]) == {"rollout", "warmup", "measure", "load_job", "teardown"}
    assert rec["phases_s"]["warmup"] == pytest.approx(4.0) and rec["phases_s"]["measure"] == pytest.approx(
        36.0
    )
    assert json.loads((tmp_path / "trial-1.json").read_text())["trial"] == 1
    # numbering goes on
    r.run_trial(image_spec, rate=1.0, requests=40, seed=4)
    assert r.last["name"] == "llava-t2"


def test_the_load_job_targets_the_frontend_service(image_spec):
    clock = Clock()
    cluster = FakeCluster(clock)
    seen: dict[str, Any] = {}
    orig = cluster.apply

    def spy(obj: dict[str, Any]) -> None:
        if obj["kind"] in ("Job", "Service"):
            seen.setdefault(obj["kind"], []).append(obj)
        orig(obj)

    cluster.apply = spy  # type: ignore[method-assign]
    runner(cluster, clock).run_trial(image_spec, rate=2.5, requests=40, seed=9)
    (job,) = seen["Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    http = [
        s["metadata"]["name"] for s in seen["Service"] if any(p["name"] == "http" for p in s["spec"]["ports"])
    ]
    assert args[:3] == ["easerve", "bench", "--url"] and args[3] == f"http://{http[0]}.ns.svc:8000"
    assert args[args.index("--rate") + 1] == "2.5" and args[args.index("--seed") + 1] == "9"
    assert args[args.index("--requests") + 1] == "40" and "--json" in args
    assert job["spec"]["backoffLimit"] == 0


def test_a_trial_that_never_gets_ready_fails_after_the_timeout_and_is_torn_down(image_spec):
    clock = Clock()
    cluster = FakeCluster(clock, never_ready={1})
    r = runner(cluster, clock)
    t0 = clock()
    with pytest.raises(TrialFailed, match=r"trial 1 \(llava-t1\) not ready within 30 s: llava-t1-"):
        r.run_trial(image_spec, rate=1.0, requests=40, seed=4)
    assert 30.0 <= clock() - t0 <= 32.0
    assert cluster.objects == {} and "error" in r.last


def test_a_load_job_that_fails_without_a_report_fails_the_trial(image_spec):
    clock = Clock()
    cluster = FakeCluster(clock, job_fails=True)
    with pytest.raises(
        TrialFailed, match="load Job llava-t1-load failed without a report.*connection refused"
    ):
        runner(cluster, clock).run_trial(image_spec, rate=1.0, requests=40, seed=4)
    assert cluster.objects == {}


def test_the_search_records_a_never_ready_trial_as_failed_and_goes_on(image_spec, td):
    clock = Clock()
    cluster = FakeCluster(clock, ready_after=0, never_ready={2})
    r = runner(cluster, clock)
    res = tune(
        image_spec,
        runner=r,
        profiler=td.TableTestProfiler(),
        space=space_for(image_spec, 2, max_batch=4, s_step=0.5),
        rate=1.0,
        rules=StopRules(budget=4, patience=4, spread=0.0),
        requests=40,
        clock=td.FakeClock(),
    )
    real = res.real_trials
    assert [t.state for t in real][:3] == ["complete", "failed", "complete"]
    assert "not ready within 30 s" in (real[1].error or "")
    assert res.best is not None and cluster.objects == {}
    assert [h["trial"] for h in r.history] == list(range(1, len(real) + 1))


def test_parse_report_takes_the_last_json_report():
    log = 'warn: x\n{"not": "a report"}\n{\n "throughput": 2.0,\n "completed": 3\n}\n'
    assert parse_report(log) == {"throughput": 2.0, "completed": 3}
    assert parse_report("no json here") is None
    assert parse_report('{"throughput": 1.0, "x": [1, {"a": 2}]}') == {"throughput": 1.0, "x": [1, {"a": 2}]}


def test_cli_cluster_backend_runs_the_search_through_the_kube_runner(tmp_path, monkeypatch, capsys):
    """``easerve tune --backend cluster``: same search and report, trials from the cluster runner."""
    import easerve_operator.tuning.prometheus as prom
    import easerve_operator.tuning.runners.kube as kube
    from easerve_operator.cli import main

    clock = Clock()
    made: list[FakeCluster] = []

    class CliCluster(FakeCluster):
        def __init__(self) -> None:
            super().__init__(clock, ready_after=0, run_s=0.0)
            made.append(self)

        def owner_uid(self, namespace: str, name: str) -> str | None:
            assert (namespace, name) == ("ns", "ultravox-v0.6-27b")
            return UID

    def scorer(url: str, selector: Mapping[str, str]) -> SyntheticPrometheus:
        assert url == "http://prom:9090" and selector["namespace"] == "ns"
        return SyntheticPrometheus(made[0])(selector["epd_deployment"])

    monkeypatch.setattr(kube, "KubeTrialCluster", CliCluster)
    monkeypatch.setattr(prom, "PrometheusScorer", scorer)
    audio = str(Path(__file__).resolve().parents[2] / "examples" / "ultravox-v0.6-27b.yaml")
    args = ["tune", "-f", audio, "--backend", "cluster", "--namespace", "ns", "--rate", "1"]
    args += ["--requests", "40", "--budget", "3", "--max-batch", "4", "--s-step", "0.5"]
    args += ["--out", str(tmp_path), "--json", "--no-progress"]
    assert main(args) == 2  # no Prometheus URL anywhere: refused, naming the field
    assert "--prometheus-url" in capsys.readouterr().err
    assert main([*args, "--prometheus-url", "http://prom:9090"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "cluster" and out["best"] is not None and out["n_trials"] == 3
    trials = out["cluster_trials"]
    assert [t["name"] for t in trials] == [
        "ultravox-v0.6-27b-t1",
        "ultravox-v0.6-27b-t2",
        "ultravox-v0.6-27b-t3",
    ]
    assert all(t["metrics_source"] == "prometheus" and "job_report" in t for t in trials)
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == [f"trial-{k}.json" for k in (1, 2, 3)]
    assert out["cluster_profile"]["sources"] == {"encode": "job", "prefill": "job", "decode": "job"}  # Stage 1 Jobs
    assert made[0].objects == {}


class _Status:
    """The status subresource, as the tuning daemon writes it (patches recorded)."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(json.loads(json.dumps(status)))


class _OneSearch:
    """kopf.DaemonStopped that turns true at the daemon's first idle wait (after one search)."""

    waits = 0

    def __bool__(self) -> bool:
        return self.waits > 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return True


def _tuned_manifest(**tuning: Any) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "llava-v1.6-34b.yaml").read_text())
    doc["spec"]["tuning"] = {"enabled": True, "targetRate": 1.0, "trialBudget": 3, "requestsPerTrial": 40, **tuning}
    return doc


def test_the_operator_daemon_runs_cluster_trials_scored_from_prometheus(tmp_path, monkeypatch):
    """``spec.tuning.trials: cluster``: the operator's own search rolls each trial out through the
    KubeRunner and scores it from the Prometheus of the spec; status says so (twin vs cluster)."""
    import easerve_operator.tuning.prometheus as prom
    import easerve_operator.tuning.runners.kube as kube
    from easerve_operator.reconcile import tuning

    monkeypatch.setenv(tuning.STATE_DIR_ENV, str(tmp_path / "state"))
    clock = Clock()
    made: list[FakeCluster] = []
    urls: list[str] = []

    class OpCluster(FakeCluster):
        def __init__(self) -> None:
            super().__init__(clock, ready_after=0, run_s=0.0)
            made.append(self)

    def scorer(url: str, selector: Mapping[str, str]) -> SyntheticPrometheus:
        urls.append(url)
        assert selector["namespace"] == "ns" and selector["epd_deployment"].startswith("llava-t")
        return SyntheticPrometheus(made[0])(selector["epd_deployment"])

    monkeypatch.setattr(kube, "KubeTrialCluster", OpCluster)
    monkeypatch.setattr(prom, "PrometheusScorer", scorer)
    doc = _tuned_manifest(trials="cluster")
    doc["spec"]["observability"] = {"prometheusUrl": "http://prom.monitoring:9090"}
    st = _Status()
    tuning.run_daemon(st, _OneSearch(), doc, "ns", "llava", UID)
    done = st.patches[-1]["tuning"]
    assert done["state"] == "Succeeded", done.get("message")
    assert done["trialsOn"] == "cluster" and done["prometheusUrl"] == "http://prom.monitoring:9090"
    assert done["best"] is not None and done["nTrials"] >= 1
    jobs = [k for op, k in made[0].calls if op == "apply" and k[0] == "Job" and k[1].endswith("-load")]
    assert [name for _, name in jobs] == [f"llava-t{i}-load" for i in range(1, len(jobs) + 1)]
    profiles = sorted(k[1] for op, k in made[0].calls if op == "apply" and k[0] == "Job" and "-profile-" in k[1])
    assert profiles == ["llava-profile-decode", "llava-profile-encode", "llava-profile-prefill"]  # Stage 1 on the cluster
    assert len(jobs) == done["nTrials"] and set(urls) == {"http://prom.monitoring:9090"}
    assert made[0].objects == {}  # every trial torn down
    assert st.patches[0]["tuning"]["trialsOn"] == "cluster"  # said from the start


def test_cluster_trials_without_a_prometheus_fail_naming_where_to_set_it(tmp_path, monkeypatch):
    from easerve_operator.reconcile import tuning

    monkeypatch.setenv(tuning.STATE_DIR_ENV, str(tmp_path / "state"))
    st = _Status()
    tuning.run_daemon(st, _OneSearch(), _tuned_manifest(trials="cluster"), "ns", "llava", UID)
    done = st.patches[-1]["tuning"]
    assert done["state"] == "Failed" and done["trialsOn"] == "cluster"
    assert "spec.observability.prometheusUrl" in done["message"] and "--prometheus-url" in done["message"]


def test_twin_trials_are_the_default_and_say_so(tmp_path, monkeypatch):
    from easerve_operator.reconcile import tuning

    monkeypatch.setenv(tuning.STATE_DIR_ENV, str(tmp_path / "state"))
    st = _Status()
    tuning.run_daemon(st, _OneSearch(), _tuned_manifest(), "ns", "llava", UID)
    done = st.patches[-1]["tuning"]
    assert done["state"] == "Succeeded" and done["trialsOn"] == "twin" and done["prometheusUrl"] is None


def test_an_unreachable_prometheus_stops_the_search_naming_its_url(tmp_path, monkeypatch):
    """Prometheus gone (after the scorer's own retries with back-off): every later trial would fail
    the same way, so the search stops at the first, Failed, naming the URL, and tears the trial down."""
    import easerve_operator.tuning.prometheus as prom
    import easerve_operator.tuning.runners.kube as kube
    from easerve_operator.reconcile import tuning

    monkeypatch.setenv(tuning.STATE_DIR_ENV, str(tmp_path / "state"))
    clock = Clock()
    made: list[FakeCluster] = []

    class OpCluster(FakeCluster):
        def __init__(self) -> None:
            super().__init__(clock, ready_after=0, run_s=0.0)
            made.append(self)

    class Gone:
        def score(self, *a: Any, **k: Any) -> Any:
            raise prom.PrometheusUnreachable("http://prom.monitoring:9090", 6, 15.5, ConnectionError("refused"))

    monkeypatch.setattr(kube, "KubeTrialCluster", OpCluster)
    monkeypatch.setattr(prom, "PrometheusScorer", lambda url, selector: Gone())
    doc = _tuned_manifest(trials="cluster")
    doc["spec"]["observability"] = {"prometheusUrl": "http://prom.monitoring:9090"}
    st = _Status()
    tuning.run_daemon(st, _OneSearch(), doc, "ns", "llava", UID)
    done = st.patches[-1]["tuning"]
    assert done["state"] == "Failed" and done["phase"] == "Failed"
    assert "Prometheus at http://prom.monitoring:9090 unreachable after 6 attempts" in done["message"]
    loads = [k for op, k in made[0].calls if op == "apply" and k[0] == "Job" and k[1].endswith("-load")]
    assert len(loads) == 1, "stopped at the first trial"
    assert made[0].objects == {}, "the trial is torn down"


def test_sped_up_trial_pods_run_the_candidate_the_twin_predicts(image_spec, monkeypatch):
    """At speed-up k the pods read the spec's durations in wall time: the runner divides them by k, so
    the batcher's valve and the frontend's door are the twin's in model time (unscaled, the door held
    k times the twin's requests and the valve waited k times longer)."""
    from easerve_operator.tuning.runners.kube import compressed
    from easerve_runtime.api.runtime_config import RuntimeConfig
    from easerve_runtime.policies.admission import admission_queue
    from easerve_runtime.sim.frontdoor import FrontDoor
    from easerve_runtime.workers.frontend import FRONTENDS_ENV, measured_capacity

    k = 2.0
    spec = image_spec.model_copy(update={"engine": image_spec.engine.model_copy(update={"backend": "sim"})})
    run = compressed(spec, k)
    assert run.encode.max_age_ms * k == pytest.approx(spec.encode.max_age_ms)
    assert run.encode.rate_half_life_ms * k == pytest.approx(spec.encode.rate_half_life_ms)
    assert run.limits.request_timeout_seconds * k == pytest.approx(spec.limits.request_timeout_seconds)
    assert [t.ttft_seconds * k for t in run.slo.tiers] == pytest.approx([t.ttft_seconds for t in spec.slo.tiers])
    assert compressed(spec, 1.0) is spec

    monkeypatch.setenv("EASERVE_SIM_SPEEDUP", f"{k:g}")
    monkeypatch.setenv(FRONTENDS_ENV, "1")
    twin = FrontDoor(spec, frontends=1)

    def live_bound(s: Any) -> int:
        return admission_queue(s.limits, measured_capacity(RuntimeConfig(name="t", dynamo_namespace="t", spec=s))).bound

    assert live_bound(run) == twin.bound
    assert live_bound(spec) > twin.bound  # what the pods ran before the durations were scaled
