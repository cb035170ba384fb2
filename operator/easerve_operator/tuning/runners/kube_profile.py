"""HAS Stage 1 on a Kubernetes cluster: one profiling Job per stage kind, in parallel.

``ClusterStageProfiler`` is the ``Profiler`` a cluster search uses (``spec.tuning.trials: cluster``).
On its first capacity question it starts three Jobs at once, each running ``easerve profile-stage``
(``workers.stage_profile``: the same probes as the twin's profiler, on the engine the pods run) on
GPUs of its own, labelled and owner-referenced like the trials:

- ``<deployment>-profile-encode``: one encode worker (1 GPU), B doubled 1, 2, 4, ... up to the
  space's largest B;
- ``<deployment>-profile-prefill``: one prefill worker per TP of the space (the largest TP's GPUs),
  plus the local prefill worker at the SM shares the partition policy gives it while a
  micro-batch encodes and while the encoder is idle (for α);
- ``<deployment>-profile-decode``: one decode worker per TP of the space.

Stage 1 then reads every answer from the reports. The scheduler places the Jobs on disjoint GPUs
(each requests its own); with fewer free GPUs than the three need, one waits for another.

**Crash-safe.** Each report is written beside the search's records (``profile-<stage>.json``) as
soon as its Job ends, and its Job deleted. A restarted operator reuses the reports it finds and
reruns only the stages whose Job had not finished (their left-over Jobs are deleted first), so a
kill during profiling costs at most that stage's profile again. Once Stage 1 is recorded in the
search's records, a resumed search never profiles again (``search.tune``).

**What is not measured here** is read from the twin's profiler and says so in the report
(``sources``): the model's smallest TP (from its weights, not a measurement); a stage whose engine
the profiling command cannot drive (``unsupported``: prefill and decode of the torch engine, issue
17); and the SM shares themselves (the partition policy's decision).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from easerve_runtime.api import GROUP, EPDDeploymentSpec
from easerve_runtime.workers.stage_profile import batches_up_to

from easerve_operator.render import render_children
from easerve_operator.tuning.runners import Probe
from easerve_operator.tuning.runners.kube import (
    LOAD_MOUNT,
    TUNING_OF_LABEL,
    TrialCluster,
    TrialFailed,
    job_with_config,
    manifest_for,
    time_scale,
    trial_image,
)
from easerve_operator.tuning.runners.sim import SimStageProfiler, duty_alpha

PROFILE_LABEL = f"{GROUP}/profile"
STAGES = ("encode", "prefill", "decode")
DEFAULT_PROFILE_TIMEOUT_S = 900.0


def profile_labels(deployment: str, stage: str) -> dict[str, str]:
    return {PROFILE_LABEL: stage, TUNING_OF_LABEL: deployment}


def parse_profile(log: str) -> dict[str, Any] | None:
    """The ``easerve profile-stage`` report: the last line of the log that is a JSON object with ``stage``."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(d, dict) and "stage" in d:
                return d
    return None


def render_profile_job(
    deployment: str,
    namespace: str,
    uid: str | None,
    stage: str,
    spec: EPDDeploymentSpec,
    *,
    image: str,
    args: Sequence[str],
    gpus: int,
    env: list[dict[str, str]],
    deadline_s: int,
) -> list[dict[str, Any]]:
    """The ConfigMap (the manifest) and the Job of one stage's profile."""
    name = f"{deployment}-profile-{stage}".replace(".", "-")
    labels = {"app.kubernetes.io/name": "easerve", "app.kubernetes.io/component": "profile",
              **profile_labels(deployment, stage)}
    argv = ["easerve", "profile-stage", "--spec", f"{LOAD_MOUNT}/manifest.yaml", "--stage", stage, *args]
    return job_with_config(name, namespace, labels, deployment, uid,
                           {"manifest.yaml": json.dumps(manifest_for(deployment, spec))},
                           image=image, args=argv, deadline_s=deadline_s, container="profile", env=env, gpus=gpus)


class ClusterStageProfiler:
    """``Profiler`` answered by profiling Jobs on the cluster (module docstring)."""

    def __init__(
        self,
        cluster: TrialCluster,
        deployment: str,
        namespace: str,
        spec: EPDDeploymentSpec,
        *,
        rate: float,
        tps: Sequence[int],
        max_batch: int,
        report_dir: Path,
        uid: str | None = None,
        render: Callable[[str, str, str, EPDDeploymentSpec], list[dict[str, Any]]] = render_children,
        timeout_s: float = DEFAULT_PROFILE_TIMEOUT_S,
        poll_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cluster, self.deployment, self.namespace, self.spec = cluster, deployment, namespace, spec
        self.rate, self.tps, self.max_batch = rate, tuple(sorted(set(tps))), max_batch
        self.report_dir, self.uid, self.render = report_dir, uid, render
        self.timeout_s, self.poll_s, self.clock, self.sleep = timeout_s, poll_s, clock, sleep
        self.twin = SimStageProfiler(spec, rate=rate)
        self.reports: dict[str, dict[str, Any]] = {}
        self.sources: dict[str, str] = {}
        self.phases_s: dict[str, float] = {}
        self.alpha_parts: dict[str, float] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- facts, not measurements
    def min_tp(self) -> int:
        return self.twin.min_tp()

    def local_prefill_tp(self) -> int:
        return self.twin.local_prefill_tp()

    # ---------------------------------------------------------------- the Jobs
    def _path(self, stage: str) -> Path:
        return self.report_dir / f"profile-{stage}.json"

    def _image_and_env(self) -> tuple[str, list[dict[str, str]]]:
        """The serving pods' image, and ``spec.pod.env`` (the sim engine's speed-up reaches the Job so)."""
        image = trial_image(self.render(self.deployment, self.namespace, self.uid or "", self.spec))
        return image, [{"name": e.name, "value": e.value} for e in self.spec.pod.env or []]

    def _args(self, stage: str) -> tuple[list[str], int]:
        tps = ",".join(str(t) for t in self.tps)
        if stage == "encode":
            return ["--max-batch", str(self.max_batch)], 1
        if stage == "prefill":
            shares = ",".join(f"{s:.6g}" for s in self.twin.local_shares())
            return ["--tp", tps, "--local-shares", shares], max(self.tps)
        return ["--tp", tps], max(self.tps)

    def run(self) -> dict[str, dict[str, Any]]:
        """Every stage's report: from disk when a finished Job left one, else from a fresh Job."""
        with self._lock:
            if len(self.reports) == len(STAGES):
                return self.reports
            t0 = self.clock()
            todo = []
            for stage in STAGES:
                path = self._path(stage)
                if path.exists():
                    self.reports[stage] = json.loads(path.read_text())
                    self.sources.setdefault(stage, "recovered")
                    # its Job finished before a restart, which left it behind: nothing more to read
                    self.cluster.delete_labelled(self.namespace, profile_labels(self.deployment, stage))
                else:
                    todo.append(stage)
            image, env = self._image_and_env() if todo else ("", [])
            jobs = {}
            for stage in todo:
                self.cluster.delete_labelled(self.namespace, profile_labels(self.deployment, stage))  # left-overs
                args, gpus = self._args(stage)
                objs = render_profile_job(self.deployment, self.namespace, self.uid, stage, self.spec, image=image,
                                          args=args, gpus=gpus, env=env, deadline_s=int(self.timeout_s))
                for o in objs:
                    self.cluster.apply(o)
                jobs[stage] = objs[-1]["metadata"]["name"]
            try:
                self._wait(jobs, t0)
            finally:
                for stage in todo:
                    self.cluster.delete_labelled(self.namespace, profile_labels(self.deployment, stage))
            self.phases_s["profile"] = self.clock() - t0
            self.report_dir.mkdir(parents=True, exist_ok=True)
            (self.report_dir / "sources.json").write_text(json.dumps(self.sources, sort_keys=True))
            return self.reports

    def _wait(self, jobs: dict[str, str], t0: float) -> None:
        deadline = t0 + self.timeout_s + 60
        left = dict(jobs)
        while left:
            for stage, job in list(left.items()):
                state = self.cluster.job_state(self.namespace, job)
                if state == "active":
                    continue
                report = parse_profile(self.cluster.job_logs(self.namespace, job))
                if state != "succeeded" or report is None:
                    raise TrialFailed(f"profiling Job {job} {state} without a report")
                self.report_dir.mkdir(parents=True, exist_ok=True)
                self._path(stage).write_text(json.dumps(report, sort_keys=True))
                self.reports[stage] = report
                self.sources[stage] = "job"
                self.phases_s[stage] = self.clock() - t0
                del left[stage]
            if left and self.clock() >= deadline:
                raise TrialFailed(f"profiling Jobs {sorted(left.values())} not done within {self.timeout_s:g} s")
            if left:
                self.sleep(self.poll_s)

    def _measured(self, stage: str) -> dict[str, Any] | None:
        r = self.run()[stage]
        if "unsupported" in r:
            if not self.sources.get(stage, "").startswith("twin"):
                self.sources[stage] = f"twin ({r['unsupported']})"
                (self.report_dir / "sources.json").write_text(json.dumps(self.sources, sort_keys=True))
            return None
        return r

    # ---------------------------------------------------------------- the Profiler protocol
    def encode_throughput(self, batch: int) -> Probe:
        r = self._measured("encode")
        if r is not None:
            for p in r["encode"]:
                if int(p["batch"]) == batch:
                    return Probe(float(p["value"]), float(p["cost_s"]))
        return self.twin.encode_throughput(batch)

    def _per_tp(self, stage: str, tp: int, fallback: Callable[[int], Probe]) -> Probe:
        r = self._measured(stage)
        p = None if r is None else r[stage].get(str(tp))
        return fallback(tp) if p is None else Probe(float(p["value"]), float(p["cost_s"]))

    def prefill_capacity(self, tp: int) -> Probe:
        return self._per_tp("prefill", tp, self.twin.prefill_capacity)

    def decode_capacity(self, tp: int) -> Probe:
        return self._per_tp("decode", tp, self.twin.decode_capacity)

    def local_prefill_efficiency(self) -> float | None:
        r = self._measured("prefill")
        if r is None or not r.get("local"):
            return self.twin.local_prefill_efficiency()
        busy_share, idle_share = self.twin.local_shares()
        local = {float(k): float(v["value"]) for k, v in r["local"].items()}

        def at(share: float) -> float:
            return min(local.items(), key=lambda kv: abs(kv[0] - share))[1]

        ref = r.get("local_ref")  # C_P on the local probes' own sample
        c_p = float(ref["value"]) if ref else self.prefill_capacity(min(self.tps)).value
        c_e = max(self.encode_throughput(b).value for b in batches_up_to(self.max_batch))
        alpha, self.alpha_parts = duty_alpha(at(busy_share) / c_p, at(idle_share) / c_p, c_e, self.rate)
        return alpha

    def report(self) -> dict[str, Any]:
        """What the Jobs measured, where each answer came from, and how long they took (a resumed
        search that did not profile again reports what its first profiling recorded)."""
        sources = dict(self.sources)
        path = self.report_dir / "sources.json"
        if not sources and path.exists():
            sources = json.loads(path.read_text())
        return {"sources": sources, "phases_s": dict(self.phases_s), "alpha_parts": dict(self.alpha_parts),
                "time_scale": time_scale(self.spec),
                "reports": {k: {kk: vv for kk, vv in v.items()} for k, v in self.reports.items()}}
