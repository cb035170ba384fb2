"""HAS inside the operator: with ``spec.tuning.enabled``, search and report the result in status.

The search runs in a kopf daemon (one thread per EPDDeployment that asks for it), with the twin
as its trial runner (``engine.backend: sim``; a Kubernetes trial runner comes later). Progress
and the result go to ``status.tuning``; the operator never writes ``spec``. To adopt the
recommendation, copy ``status.tuning.best`` (allocation, batchBound, offloadRatio) into the
manifest in Git.

The search is keyed by a *fingerprint* of the spec without the searched dimensions (allocation,
B, s): adopting the recommendation does not start a new search, while changing the model, the
profile, the SLOs or the tuning settings does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
from typing import Any

import kopf
from easerve_runtime.api import GROUP, PLURAL, VERSION, EPDDeploymentSpec, parse_spec
from pydantic import ValidationError

from easerve_operator.reconcile.kube import Kube

SEARCHED = ("allocation",)
PROGRESS_EVERY_S = 2.0


class _Abort(Exception):
    """The daemon is stopping, or the spec changed under the search."""


def fingerprint(spec: EPDDeploymentSpec) -> str:
    wire = spec.wire()
    for key in SEARCHED:
        wire.pop(key, None)
    wire.get("encode", {}).pop("batchBound", None)
    wire.get("offload", {}).pop("ratio", None)
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def camel(obj: Any) -> Any:
    """status is camelCase like the rest of the API."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            head, *rest = str(k).split("_")
            out[head + "".join(p[:1].upper() + p[1:] for p in rest)] = camel(v)
        return out
    if isinstance(obj, list):
        return [camel(v) for v in obj]
    return obj


def search(spec: EPDDeploymentSpec, on_progress: Any) -> dict[str, Any]:
    """Run HAS on the twin for ``spec``; return ``TuningResult.summary()``."""
    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.space import space_for

    rate = float(spec.tuning.target_rate or 1.0)
    profiler = SimStageProfiler(spec, rate=rate)
    space = space_for(spec, profiler.min_tp(), local_tp=profiler.local_prefill_tp())
    result = tune(
        spec,
        runner=SimRunner(),
        profiler=profiler,
        space=space,
        rate=rate,
        objective=spec.tuning.objective,
        rules=StopRules(budget=spec.tuning.trial_budget),
        requests=spec.tuning.requests_per_trial,
        on_trial=on_progress,
    )
    return result.summary()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("tuning") or {}).get("enabled"))


class _Progress:
    """``on_trial`` callback: aborts when the daemon stops or the spec changes, and reports progress."""

    def __init__(
        self, kube: Kube, namespace: str, name: str, fp: str, body: kopf.Body, stopped: kopf.DaemonStopped
    ) -> None:
        self.kube, self.namespace, self.name, self.fp = kube, namespace, name, fp
        self.body, self.stopped = body, stopped
        self.last = 0.0

    def _fingerprint_now(self) -> str | None:
        try:
            return fingerprint(parse_spec(dict(self.body.get("spec") or {})))
        except ValidationError:
            return None

    def __call__(self, rec: Any, records: list[Any]) -> None:
        if self.stopped or self._fingerprint_now() != self.fp:
            raise _Abort()
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        vals = [r.value for r in records if r.ok and not r.cached]
        self.kube.patch_status(
            self.namespace,
            self.name,
            {"tuning": {"trials": len(vals), "bestSoFar": max(vals) if vals else None}},
        )


@kopf.daemon(GROUP, VERSION, PLURAL, id="tuning", when=_enabled, cancellation_timeout=10.0)
def tuning_daemon(
    stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, logger: logging.Logger, **_: Any
) -> None:
    kube = Kube()
    while not stopped:
        try:
            spec = parse_spec(dict(body.get("spec") or {}))
        except ValidationError:
            stopped.wait(5)  # the reconciler reports InvalidSpec; nothing to search
            continue
        fp = fingerprint(spec)
        current = (body.get("status") or {}).get("tuning") or {}
        if current.get("fingerprint") == fp and current.get("state") in ("Succeeded", "Failed"):
            stopped.wait(5)
            continue
        budget = spec.tuning.trial_budget
        started = _now()
        kube.patch_status(
            namespace,
            name,
            {
                "tuning": {
                    "state": "Running",
                    "fingerprint": fp,
                    "startedAt": started,
                    "trials": 0,
                    "budget": budget,
                }
            },
        )
        try:
            summary = search(spec, _Progress(kube, namespace, name, fp, body, stopped))
        except _Abort:
            logger.info("tuning search interrupted (operator stopping or spec changed)")
            continue
        except Exception as exc:  # noqa: BLE001 - report any failure of the search in status
            logger.exception("tuning search failed")
            kube.patch_status(
                namespace,
                name,
                {
                    "tuning": {
                        "state": "Failed",
                        "fingerprint": fp,
                        "message": f"{type(exc).__name__}: {exc}",
                        "finishedAt": _now(),
                    }
                },
            )
            continue
        logger.info("tuning done: %s", json.dumps(summary.get("best"))[:300])
        kube.patch_status(
            namespace,
            name,
            {
                "tuning": {
                    **camel(summary),
                    "state": "Succeeded",
                    "fingerprint": fp,
                    "startedAt": started,
                    "finishedAt": _now(),
                    "trials": summary.get("n_trials"),
                    "budget": budget,
                }
            },
        )
