"""``TrialRunner`` on a Kubernetes cluster: roll a trial out, drive it, score it from Prometheus.

One trial, in order (``KubeRunner.run_trial``):

1. **roll-out**: render the candidate spec with the operator's own public renderer
   (``render.render_children``) under the trial's name ``<deployment>-t<n>``, label every object
   with ``easerve.io/trial: <n>`` and ``easerve.io/tuning-of: <deployment>``, and owner-reference
   it to the EPDDeployment (so deleting the deployment deletes its trials; the reference is
   not the controller one, the deployment's own children keep that). Left-overs of the same
   trial number (a search killed mid-trial) are deleted first.
2. **readiness**: wait until every rendered Deployment is available, at most
   ``ready_timeout_s``. A trial that never gets ready raises ``TrialFailed``: the search records
   it as failed and goes on.
3. **load**: a Job runs ``easerve bench`` (the same image as the trial) against the trial's
   frontend Service at the target rate (or replays a trace) with the search's workload seed,
   and prints its JSON report, which carries the run's wall-clock edges (``started_at``,
   ``finished_at``). A Job that fails without a report fails the trial.
4. **score**: from Prometheus (``tuning.prometheus``) over the measurement window
   [started_at + warm-up, finished_at]: the warm-up (``warmup_fraction`` of the run) is cut off,
   the end is the last completion. The same query over the whole run is compared with the
   Job's own report (``crosscheck``: the ratios of throughput and goodput, which must agree
   within 3 %). Both stay in ``last`` and, with ``report_dir``, in ``trial-<n>.json``.
5. **teardown**: delete everything labelled with the trial (also after a failure).

**Sped-up sim pods** (``EASERVE_SIM_SPEEDUP = k`` in ``spec.pod.env``, engine ``sim``): every modelled
latency runs k times faster, so the trial runs the same system with time compressed by k. The runner
makes that exact: the pods and the load Job get every duration of the spec divided by k (SLO tiers,
the batcher's max age and rate half-life, the queue budget, the deadline: ``compressed``), the load runs at k·Λ (the
same seeded requests, arrivals k times closer; a trace's timestamps divided by k), and every figure is
mapped back (throughput and goodput / k, latencies · k) before the search sees it. ``time_scale`` in the
trial's record says which k; the raw real-time figures stay beside the mapped ones.

**Killed mid-trial** (the operator restarts while trial n runs): ``trial-<n>.json`` is written when the
trial starts (``state: running``) and when it ends. A resumed search numbers its next trial after the
recorded ones, so it asks for trial n again: a trial cut off mid-run is rerun once, marked
``rerun: true`` (cut off a second time, it fails, and the search goes on); a trial that finished but was
not yet recorded by the search (killed in between) is not rerun: its measurement is returned from the
file, marked ``recovered: true``, when it was measured for the same candidate.

The cluster is reached only through ``TrialCluster``, five calls wide, so the runner's logic is
tested against a fake; ``KubeTrialCluster`` implements it on the kubernetes client. Time goes
through injected ``clock`` / ``sleep``. Phase durations (roll-out, warm-up, measure, teardown)
are recorded per trial.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from easerve_runtime.api import GROUP, HTTP_PORT, KIND, VERSION, EPDDeploymentSpec

from easerve_operator.render import render_children
from easerve_operator.tuning.runners import TrialMetrics

TRIAL_LABEL = f"{GROUP}/trial"
TUNING_OF_LABEL = f"{GROUP}/tuning-of"
LOAD_MOUNT = "/etc/easerve-load"
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_WARMUP_FRACTION = 0.1
CROSSCHECK_TOLERANCE = 0.03
SPEEDUP_ENV = "EASERVE_SIM_SPEEDUP"


class TrialFailed(RuntimeError):
    """The trial could not be measured (not ready in time, load Job failed); the search goes on."""


class TrialCluster(Protocol):
    """The cluster calls a trial needs (``KubeTrialCluster``; tests use a fake)."""

    def apply(self, obj: dict[str, Any]) -> None:
        """Create or update one object (server-side apply)."""
        ...

    def delete_labelled(self, namespace: str, labels: Mapping[str, str]) -> int:
        """Delete every Deployment, Service, ConfigMap and Job carrying ``labels``; returns how many."""
        ...

    def not_ready(self, namespace: str, deployments: list[str]) -> dict[str, str]:
        """Deployments among ``deployments`` that are not available yet, with why (empty: all ready)."""
        ...

    def job_state(self, namespace: str, name: str) -> str:
        """``active``, ``succeeded`` or ``failed``."""
        ...

    def job_logs(self, namespace: str, name: str) -> str:
        """The output of the Job's (last) pod."""
        ...


class Scorer(Protocol):
    def score(
        self, start: float, end: float, *, idle_before_start: bool = False, drained_at_end: bool = True
    ) -> Any: ...


# ------------------------------------------------------------------------------------- pure


def trial_name(deployment: str, n: int) -> str:
    """The name every object of trial ``n`` is rendered under."""
    return f"{deployment}-t{n}"


def trial_labels(deployment: str, n: int) -> dict[str, str]:
    return {TRIAL_LABEL: str(n), TUNING_OF_LABEL: deployment}


def owner_ref(deployment: str, uid: str) -> dict[str, Any]:
    """Owned by the EPDDeployment (garbage-collected with it), not controlled by it."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": deployment,
        "uid": uid,
        "controller": False,
        "blockOwnerDeletion": True,
    }


def _label(obj: dict[str, Any], extra: Mapping[str, str]) -> None:
    obj.setdefault("metadata", {}).setdefault("labels", {}).update(extra)
    tmpl = obj.get("spec", {}).get("template")
    if isinstance(tmpl, dict):
        tmpl.setdefault("metadata", {}).setdefault("labels", {}).update(extra)


Render = Callable[[str, str, str, EPDDeploymentSpec], list[dict[str, Any]]]


def render_trial(
    deployment: str,
    namespace: str,
    uid: str | None,
    n: int,
    spec: EPDDeploymentSpec,
    render: Render = render_children,
) -> list[dict[str, Any]]:
    """Trial ``n``'s children: the deployment's own rendering under the trial name, labelled.

    ``render`` is the renderer the deployment's own children go through (the operator's fills in
    its operator-wide defaults, e.g. the discovery etcd), so a trial runs exactly what would run."""
    objs = render(trial_name(deployment, n), namespace, uid or "", spec)
    for o in objs:
        _label(o, trial_labels(deployment, n))
        meta = o["metadata"]
        if uid:
            meta["ownerReferences"] = [owner_ref(deployment, uid)]
        else:
            meta.pop("ownerReferences", None)
    return objs


def time_scale(spec: EPDDeploymentSpec) -> float:
    """k: how much faster than modelled the trial's pods run (the sim engine's speed-up), else 1."""
    if str(spec.engine.backend) != "sim":
        return 1.0
    for e in spec.pod.env or []:
        if e.name == SPEEDUP_ENV and e.value:
            k = float(e.value)
            if not k > 0 or math.isinf(k):
                raise ValueError(f"spec.pod.env {SPEEDUP_ENV}={e.value!r}: must be a positive finite number")
            return k
    return 1.0


def compressed(spec: EPDDeploymentSpec, k: float) -> EPDDeploymentSpec:
    """The spec the sped-up pods and the load Job run: every duration the pods read divided by ``k``.

    The sped-up pods run the model's latencies ``k`` times faster, but they read the spec's own
    durations in wall time. Unscaled, those would stretch ``k``-fold in the model's time: the
    micro-batcher's max-age valve (50 ms wall = 100 ms of model time at k = 2) and rate half-life,
    the frontend's queue budget (the admission bound is the capacity, itself x k, times
    ``limits.queueSeconds``: twice the twin's bound at k = 2, and the AIMD's late-token target twice
    as late), the request deadline. So the trial would run another system than the candidate the
    twin predicts. Scaled, it is the same system with time compressed by ``k`` (what
    ``trial_local.py`` measured: the B = 2 trials' TTFT 1.10-1.31x the twin's with the valve
    unscaled)."""
    if k == 1.0:
        return spec
    tiers = [t.model_copy(update={"ttft_seconds": t.ttft_seconds / k, "tpot_ms": t.tpot_ms / k}) for t in spec.slo.tiers]
    enc = spec.encode
    encode = enc.model_copy(update={"max_age_ms": enc.max_age_ms / k, "rate_half_life_ms": enc.rate_half_life_ms / k,
                                    "timeout_ms": enc.timeout_ms / k})
    lim = spec.limits
    limits = lim.model_copy(update={"queue_seconds": lim.queue_seconds / k,
                                    "request_timeout_seconds": lim.request_timeout_seconds / k})
    return spec.model_copy(update={"slo": spec.slo.model_copy(update={"tiers": tiers}), "encode": encode,
                                   "limits": limits})


def expanded(m: TrialMetrics, k: float) -> TrialMetrics:
    """Real-time figures of a sped-up trial back in the model's time (see the module docstring)."""
    if k == 1.0:
        return m

    def lat(v: float | None) -> float | None:
        return None if v is None else v * k

    return TrialMetrics(
        throughput=m.throughput / k,
        ttft_mean=m.ttft_mean * k,
        tpot_mean=m.tpot_mean * k,
        goodput={t: v / k for t, v in m.goodput.items()},
        ttft_p99=lat(m.ttft_p99),
        tpot_p99=lat(m.tpot_p99),
        completed=m.completed,
        cost_s=m.cost_s,
    )


def compress_trace(trace: str, k: float) -> str:
    """A JSONL trace with its arrival times divided by ``k``."""
    if k == 1.0:
        return trace
    out = []
    for line in trace.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        row["arrival_s"] = float(row["arrival_s"]) / k  # workload.trace's one time field
        out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def candidate_digest(spec: EPDDeploymentSpec) -> str:
    """Which candidate a trial measured (its full spec)."""
    return hashlib.sha256(json.dumps(spec.wire(), sort_keys=True).encode()).hexdigest()[:16]


def frontend_service(objs: list[dict[str, Any]]) -> str:
    """The Service that exposes the frontend's HTTP port."""
    for o in objs:
        if o["kind"] == "Service" and any(p.get("name") == "http" for p in o["spec"].get("ports", [])):
            return str(o["metadata"]["name"])
    raise ValueError("the rendered trial has no Service with an http port (no frontend)")


def trial_image(objs: list[dict[str, Any]]) -> str:
    for o in objs:
        if o["kind"] == "Deployment":
            return str(o["spec"]["template"]["spec"]["containers"][0]["image"])
    raise ValueError("the rendered trial has no Deployment")


def manifest_for(deployment: str, spec: EPDDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": deployment},
        "spec": spec.wire(),
    }


def render_load(
    deployment: str,
    namespace: str,
    uid: str | None,
    n: int,
    spec: EPDDeploymentSpec,
    *,
    image: str,
    url: str,
    rate: float,
    requests: int,
    seed: int,
    deadline_s: int,
    trace: str | None = None,
) -> list[dict[str, Any]]:
    """The load generator of trial ``n``: a ConfigMap (manifest, trace) and a Job running bench.

    The manifest gives bench the modality and the SLO tiers (goodput per tier); a trace, when
    given, is replayed instead of the generated Poisson workload.
    """
    name = f"{trial_name(deployment, n)}-load"
    data = {"manifest.yaml": json.dumps(manifest_for(deployment, spec))}  # JSON is YAML
    args = ["easerve", "bench", "--url", url, "--rate", f"{rate:g}", "--requests", str(requests)]
    # a connection per request: the trial's Service then deals requests across its frontends one
    # by one, as the twin's front door does (``sim.frontdoor``), not a keep-alive pool's connections
    args += ["--seed", str(seed), "--spec", f"{LOAD_MOUNT}/manifest.yaml", "--json", "--connection-per-request"]
    if trace is not None:
        data["trace.jsonl"] = trace
        args += ["--trace", f"{LOAD_MOUNT}/trace.jsonl"]
    labels = {
        "app.kubernetes.io/name": "easerve",
        "app.kubernetes.io/component": "load",
        **trial_labels(deployment, n),
    }
    return job_with_config(name, namespace, labels, deployment, uid, data, image=image, args=args,
                           deadline_s=deadline_s, container="load")


def job_with_config(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    deployment: str,
    uid: str | None,
    data: Mapping[str, str],
    *,
    image: str,
    args: list[str],
    deadline_s: int,
    container: str,
    env: list[dict[str, str]] | None = None,
    gpus: int = 0,
) -> list[dict[str, Any]]:
    """A ConfigMap of ``data`` mounted at ``LOAD_MOUNT`` and a one-shot Job (no retries, a deadline)
    running ``args``: what a trial's load generator and a stage's profiler are. Owned by the
    EPDDeployment when ``uid`` is known, so deleting it deletes them."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if uid:
        meta["ownerReferences"] = [owner_ref(deployment, uid)]
    c: dict[str, Any] = {
        "name": container,
        "image": image,
        "args": args,
        "volumeMounts": [{"name": "config", "mountPath": LOAD_MOUNT, "readOnly": True}],
    }
    if env:
        c["env"] = env
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": dict(meta), "data": dict(data)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": dict(meta),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline_s,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [c],
                    "volumes": [{"name": "config", "configMap": {"name": name}}],
                },
            },
        },
    }
    return [cm, job]


def parse_report(log: str) -> dict[str, Any] | None:
    """The bench's JSON report: the last JSON object in the Job's output that starts a line.

    The output may hold log lines before it; the report (``easerve bench --json``) is a dict
    with ``throughput``. None when there is none.
    """
    dec = json.JSONDecoder()
    starts = [i for i in range(len(log)) if log[i] == "{" and (i == 0 or log[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            obj, _ = dec.raw_decode(log, i)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "throughput" in obj:
            return obj
    return None


def crosscheck(prom: Mapping[str, Any], job: Mapping[str, Any], objective: str | None = None) -> dict[str, Any]:
    """Prometheus over the whole run against the Job's report: ratios, and whether within 3 %.

    ``within_3pct`` judges throughput and the goodput of the ``objective`` tier (what scores a
    trial); every tier's ratio is kept. WHY not every tier: the frontend counts a request good by the
    TTFT it measures, the Job by the TTFT its client sees (+ its own HTTP/SSE time on a busy host),
    so the few requests at a strict tier's bound can fall either side: 2 of 100 at a 1 s bound on
    the local cluster (a 0.96 ratio) while throughput agreed to 0.3 %."""
    ratios: dict[str, float | None] = {}

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        if b == 0:
            return 1.0 if a == 0 else None  # both saw no good request: they agree
        return float(a) / float(b)

    ratios["throughput"] = ratio(prom.get("throughput"), job.get("throughput"))
    for tier, v in (job.get("goodput") or {}).items():
        ratios[f"goodput@{tier}"] = ratio((prom.get("goodput") or {}).get(tier), v)
    judged = ["throughput"] + ([f"goodput@{objective}"] if f"goodput@{objective}" in ratios else [])
    ok = all(ratios[k] is not None and abs(float(ratios[k] or 0) - 1.0) <= CROSSCHECK_TOLERANCE for k in judged)
    return {"ratios": ratios, "within_3pct": ok, "judged": judged, "tolerance": CROSSCHECK_TOLERANCE}


# ------------------------------------------------------------------------------------ runner


@dataclass
class KubeRunner:
    """``TrialRunner`` that rolls trials out on a cluster (see the module docstring).

    ``scorer_for(trial_name)`` returns the Prometheus scorer of one trial's series (default
    selector: the trial's namespace and ``epd_deployment``, the chart's PodMonitor relabelling).
    ``first_trial`` numbers the first trial (a resumed search passes the records so far).
    """

    cluster: TrialCluster
    deployment: str
    namespace: str
    scorer_for: Callable[[str], Scorer]
    uid: str | None = None
    trace: str | None = None
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION
    poll_s: float = 2.0
    first_trial: int = 1
    report_dir: Path | None = None
    frontend_url: Callable[[str, str], str] | None = None
    render: Render = render_children
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        self.next_trial = self.first_trial
        self.last: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []

    def _url(self, service: str) -> str:
        if self.frontend_url is not None:
            return self.frontend_url(self.namespace, service)
        return f"http://{service}.{self.namespace}.svc:{HTTP_PORT}"

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> TrialMetrics:
        n = self.next_trial
        self.next_trial += 1
        name = trial_name(self.deployment, n)
        labels = trial_labels(self.deployment, n)
        digest = candidate_digest(spec)
        prev = self._read(n)
        if prev is not None and prev.get("state") == "done" and prev.get("digest") == digest and prev.get("metrics"):
            rec = {**prev, "recovered": True}  # measured before a kill, never recorded by the search
            self.last = rec
            self.history.append(rec)
            self._write(rec)
            return TrialMetrics.from_dict(rec["metrics"])
        reruns = int(prev.get("reruns", 0)) + 1 if prev is not None and prev.get("state") == "running" else 0
        k = time_scale(spec)
        rec: dict[str, Any] = {
            "trial": n, "name": name, "state": "running", "digest": digest, "phases_s": {},
            "rerun": reruns > 0, "reruns": reruns, "time_scale": k,
        }
        self.last = rec
        t0 = self.clock()
        try:
            if reruns > 1:
                raise TrialFailed(f"trial {n} ({name}) was cut off twice (operator restarts); not run again")
            self._write(rec)
            metrics = self._run(n, name, spec, rate, requests, seed, rec, t0)
            rec["state"], rec["metrics"] = "done", metrics.to_dict()
            return metrics
        except Exception as exc:
            rec["state"] = "failed"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            t = self.clock()
            self.cluster.delete_labelled(self.namespace, labels)
            rec["phases_s"]["teardown"] = self.clock() - t
            self.history.append(rec)
            self._write(rec)

    def _run(
        self,
        n: int,
        name: str,
        spec: EPDDeploymentSpec,
        rate: float,
        requests: int,
        seed: int,
        rec: dict[str, Any],
        t0: float,
    ) -> TrialMetrics:
        ph = rec["phases_s"]
        k = float(rec.get("time_scale", 1.0))
        run_spec = compressed(spec, k)
        self.cluster.delete_labelled(self.namespace, trial_labels(self.deployment, n))  # left-overs
        objs = render_trial(self.deployment, self.namespace, self.uid, n, run_spec, self.render)
        for o in objs:
            self.cluster.apply(o)
        deployments = [o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"]
        deadline = self.clock() + self.ready_timeout_s
        while True:
            waiting = self.cluster.not_ready(self.namespace, deployments)
            if not waiting:
                break
            if self.clock() >= deadline:
                why = "; ".join(f"{k}: {v}" for k, v in sorted(waiting.items()))
                raise TrialFailed(f"trial {n} ({name}) not ready within {self.ready_timeout_s:g} s: {why}")
            self.sleep(self.poll_s)
        ph["rollout"] = self.clock() - t0

        expected = requests / (rate * k)
        load = render_load(
            self.deployment,
            self.namespace,
            self.uid,
            n,
            run_spec,
            image=trial_image(objs),
            url=self._url(frontend_service(objs)),
            rate=rate * k,
            requests=requests,
            seed=seed,
            deadline_s=int(math.ceil(3 * expected + 300)),
            trace=None if self.trace is None else compress_trace(self.trace, k),
        )
        job = load[-1]["metadata"]["name"]
        t1 = self.clock()
        for o in load:
            self.cluster.apply(o)
        job_deadline = t1 + 3 * expected + 360
        state = "active"
        while True:
            state = self.cluster.job_state(self.namespace, job)
            if state != "active":
                break
            if self.clock() >= job_deadline:
                break
            self.sleep(self.poll_s)
        log = self.cluster.job_logs(self.namespace, job)
        report = parse_report(log)
        rec["job"] = {"name": job, "state": state}
        if report is None:
            raise TrialFailed(f"trial {n}: load Job {job} {state} without a report: {log[-500:]!r}")
        rec["job_report"] = report
        if "started_at" not in report or "finished_at" not in report:
            raise TrialFailed(f"trial {n}: load Job {job}'s report has no started_at/finished_at")
        start, end = float(report["started_at"]), float(report["finished_at"])
        warm = self.warmup_fraction * (end - start)
        ph["warmup"] = warm
        ph["measure"] = end - start - warm
        ph["load_job"] = self.clock() - t1
        scorer = self.scorer_for(name)
        figures = scorer.score(start + warm, end, idle_before_start=False, drained_at_end=True)
        whole = scorer.score(start, end, idle_before_start=True, drained_at_end=True)
        for f in (figures, whole):  # a tier no request met has no series yet: its goodput is 0
            for t in spec.slo.tiers:
                f.goodput.setdefault(t.name, 0.0)
        rec["prometheus"] = figures.to_dict()
        rec["crosscheck"] = {
            "prometheus_whole_run": whole.to_dict(),
            **crosscheck(whole.to_dict(), report, spec.slo.objective),
        }
        rec["metrics_source"] = "prometheus"
        metrics = expanded(figures.to_trial_metrics(cost_s=self.clock() - t0), k)
        return metrics

    def _path(self, n: int) -> Path | None:
        return None if self.report_dir is None else self.report_dir / f"trial-{n}.json"

    def _read(self, n: int) -> dict[str, Any] | None:
        path = self._path(n)
        if path is None or not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # torn by a kill while writing: treat as cut off
        return d if isinstance(d, dict) else None

    def _write(self, rec: dict[str, Any]) -> None:
        """Atomically (a kill never leaves half a file), so ``_read`` sees the last whole state."""
        path = self._path(int(rec["trial"]))
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=str))
        tmp.replace(path)


# ------------------------------------------------------------------------------ cluster shell


class KubeTrialCluster:
    """``TrialCluster`` on the kubernetes client: server-side apply, label deletes, status reads."""

    FIELD_MANAGER = "easerve-tuning"

    def __init__(self, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        # typed Any: the generated client's models make every field Optional
        self.api = api_client
        self.core: Any = client.CoreV1Api(api_client)
        self.apps: Any = client.AppsV1Api(api_client)
        self.batch: Any = client.BatchV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)

    def owner_uid(self, namespace: str, name: str) -> str | None:
        """The uid of EPDDeployment ``namespace/name`` (None when it does not exist)."""
        from easerve_runtime.api import PLURAL
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return str(obj["metadata"]["uid"])

    def _patch(self, obj: dict[str, Any]) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        fn = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Service": self.core.patch_namespaced_service,
            "Deployment": self.apps.patch_namespaced_deployment,
            "Job": self.batch.patch_namespaced_job,
        }[kind]
        fn(
            meta["name"],
            meta["namespace"],
            obj,
            field_manager=self.FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def apply(self, obj: dict[str, Any]) -> None:
        self._patch(obj)

    def delete_labelled(self, namespace: str, labels: Mapping[str, str]) -> int:
        from kubernetes.client.exceptions import ApiException

        sel = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        n = 0
        kinds = (
            (self.batch.list_namespaced_job, self.batch.delete_namespaced_job),
            (self.apps.list_namespaced_deployment, self.apps.delete_namespaced_deployment),
            (self.core.list_namespaced_service, self.core.delete_namespaced_service),
            (self.core.list_namespaced_config_map, self.core.delete_namespaced_config_map),
        )
        for lister, deleter in kinds:
            for item in lister(namespace, label_selector=sel).items:
                try:
                    # raw: the generated models of some client versions refuse the delete's V1Status
                    deleter(item.metadata.name, namespace, propagation_policy="Background", _preload_content=False)
                    n += 1
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        return n

    def not_ready(self, namespace: str, deployments: list[str]) -> dict[str, str]:
        from kubernetes.client.exceptions import ApiException

        out: dict[str, str] = {}
        for name in deployments:
            try:
                d = self.apps.read_namespaced_deployment_status(name, namespace)
            except ApiException as exc:
                out[name] = f"not found ({exc.status})"
                continue
            want = d.spec.replicas or 0
            have = d.status.available_replicas or 0
            if have < want:
                out[name] = f"{have}/{want} available"
        return out

    def job_state(self, namespace: str, name: str) -> str:
        j = self.batch.read_namespaced_job_status(name, namespace)
        if j.status.succeeded:
            return "succeeded"
        if j.status.failed:
            return "failed"
        return "active"

    def job_logs(self, namespace: str, name: str) -> str:
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
        if not pods:
            return ""
        pod = max(pods, key=lambda p: p.metadata.creation_timestamp)
        container = pod.spec.containers[0].name  # a load or profiling Job's pod has one container
        return str(self.core.read_namespaced_pod_log(pod.metadata.name, namespace, container=container))
