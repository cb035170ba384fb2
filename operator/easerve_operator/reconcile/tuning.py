"""HAS inside the operator: with ``spec.tuning.enabled``, search and report the result in status.

The search runs in a kopf daemon (one thread per EPDDeployment that asks for it). Its Stage-2
trials run where ``spec.tuning.trials`` says: ``twin`` (the in-operator simulator, a prediction)
or ``cluster`` (``runners.kube.KubeRunner``: each trial rolled out as this deployment's children,
driven by a load Job, scored from Prometheus at ``spec.observability.prometheusUrl`` or the
operator's ``--prometheus-url``: a measurement). Stage 1 profiles on the twin either way. Progress
and the result go to ``status.tuning`` (the typed ``TuningStatus``, ``trialsOn`` saying which);
the operator never writes ``spec``. To adopt the recommendation, copy ``status.tuning.best`` (allocation, batchBound,
offloadRatio) into the manifest in Git.

**What identifies a search.** A *fingerprint* of the spec without what the search chooses
(allocation, B, s) and without ``smPartition.mode``/``staticEncodeSms``: adopting a
recommendation with s = 1 *forces* ``smPartition.mode: none`` (a cross-field rule), so a
fingerprint that included the mode restarted the search on adoption. The partition the search's
s < 1 trials ran with is recorded separately (``status.tuning.partition``), and a spec asks for a
new search only when it names a *different* partition explicitly (``none`` means "whatever the
search used", which is what an adopted s = 1 leaves behind).

**No second search after the first.** The daemon remembers what it finished itself: kopf's
``body`` is updated by watch events, so right after writing ``state: Succeeded`` it may still
show ``Running``; reading it back started a new search (the intermittent failure of
``test_tuning_result_goes_to_status_never_spec``). Status is only read to learn what an earlier
operator process did.

**Resume after a kill.** Every trial is appended (fsync'ed) to ``trials.jsonl`` in a per-search
directory (``$EASERVE_STATE_DIR`` or ``$TMPDIR/easerve-operator``; an emptyDir in the chart, so
it survives container restarts). A daemon that finds ``state: Running`` with its fingerprint
resumes from the records through ``tuning.records``: finished trials are neither repeated nor
lost (tested by killing the process at three points).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import kopf
from easerve_runtime.api import (
    GROUP,
    PLURAL,
    VERSION,
    EPDDeploymentSpec,
    PartitionMode,
    TrialBackend,
    TuningState,
    TuningStatus,
    parse_spec,
)
from easerve_runtime.api.status import Stage1Summary, TuningBest
from pydantic import ValidationError

from easerve_operator.reconcile.kube import Kube

PROGRESS_EVERY_S = 2.0
STATE_DIR_ENV = "EASERVE_STATE_DIR"
log = logging.getLogger(__name__)


class _Abort(Exception):
    """The daemon is stopping, or the spec changed under the search."""


# ------------------------------------------------------------------------------------ identity
def fingerprint(spec: EPDDeploymentSpec) -> str:
    """The search's inputs: the spec without the searched dimensions and the SM partition."""
    wire = spec.wire()
    wire.pop("allocation", None)
    wire.get("encode", {}).pop("batchBound", None)
    wire.get("offload", {}).pop("ratio", None)
    wire.get("smPartition", {}).pop("mode", None)
    wire.get("smPartition", {}).pop("staticEncodeSms", None)
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def partition(spec: EPDDeploymentSpec) -> str:
    """The partition the search's s < 1 trials run with (``tuning.space.apply_candidate``:
    ``none`` becomes ``dynamic``; ``static`` keeps its encode SMs)."""
    if spec.sm_partition.mode == PartitionMode.STATIC:
        return f"static:{spec.sm_partition.static_encode_sms}"
    return PartitionMode.DYNAMIC.value


def needs_search(spec: EPDDeploymentSpec, done: dict[str, Any] | None) -> bool:
    """Whether ``spec`` asks for a search that ``done`` (a finished ``status.tuning``) did not run."""
    if not done or done.get("state") not in (TuningState.SUCCEEDED, TuningState.FAILED):
        return True
    if done.get("fingerprint") != fingerprint(spec):
        return True
    explicit = spec.sm_partition.mode != PartitionMode.NONE
    return explicit and done.get("partition") not in (None, partition(spec))


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or Path(tempfile.gettempdir()) / "easerve-operator")


def records_dir(namespace: str, name: str, uid: str, spec: EPDDeploymentSpec) -> Path:
    """One directory per (object, search): a recreated object never resumes a stranger's search."""
    return state_dir() / "tuning" / namespace / f"{name}-{uid}" / f"{fingerprint(spec)}-{partition(spec)}"


# ------------------------------------------------------------------------------------ search
PROMETHEUS_TRIAL_LABEL = "epd_deployment"
"""The Prometheus label that carries a pod's deployment (trial) name: the chart's PodMonitor sets it."""


def trial_runner(
    spec: EPDDeploymentSpec, namespace: str, name: str, uid: str, directory: Path, prometheus_default: str | None
) -> tuple[Any, str | None]:
    """``(runner, prometheus url)`` for ``spec.tuning.trials``: the twin's, or one on this cluster.

    A cluster runner numbers its trials after those already recorded in ``directory`` (a resumed
    search never reuses a trial's name) and keeps each trial's report beside the records."""
    from easerve_operator.tuning.runners.sim import SimRunner

    if spec.tuning.trials == TrialBackend.TWIN:
        return SimRunner(), None
    url = spec.observability.prometheus_url or prometheus_default
    if not url:
        raise ValueError(
            "spec.tuning.trials is cluster, but no Prometheus is known to score the trials: set "
            "spec.observability.prometheusUrl, or the operator's --prometheus-url (chart: monitoring.prometheusUrl)"
        )
    from easerve_operator.tuning.prometheus import PrometheusScorer
    from easerve_operator.tuning.records import RecordStore
    from easerve_operator.tuning.runners.kube import KubeRunner, KubeTrialCluster

    store = RecordStore(directory)
    done = len(store.load()[2]) if store.exists() else 0
    runner = KubeRunner(
        cluster=KubeTrialCluster(),
        deployment=name,
        namespace=namespace,
        uid=uid,
        scorer_for=lambda trial: PrometheusScorer(url, {"namespace": namespace, PROMETHEUS_TRIAL_LABEL: trial}),
        first_trial=done + 1,
        report_dir=directory / "trials",
    )
    return runner, url


def search(
    spec: EPDDeploymentSpec,
    directory: Path,
    on_progress: Callable[[Any, list[Any]], None] | None = None,
    runner: Any = None,
) -> tuple[Any, int]:
    """Run (or resume) HAS for ``spec``, recording trials under ``directory``; the trials run on
    ``runner`` (default: the twin's).

    Returns ``(TuningResult, trials recovered from the records)``. Records of another search in
    the directory (the spec changed while the operator was down) are moved aside, not mixed in.
    """
    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.records import RecordMismatch, RecordStore
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.space import space_for

    rate = float(spec.tuning.target_rate or 1.0)
    profiler = SimStageProfiler(spec, rate=rate)
    space = space_for(spec, profiler.min_tp(), local_tp=profiler.local_prefill_tp())
    store = RecordStore(directory)

    def run() -> Any:
        return tune(
            spec,
            runner=runner if runner is not None else SimRunner(),
            profiler=profiler,
            space=space,
            rate=rate,
            objective=spec.tuning.objective,
            rules=StopRules(budget=spec.tuning.trial_budget),
            requests=spec.tuning.requests_per_trial,
            store=store,
            resume=True,
            on_trial=on_progress,
        )

    try:
        resumed = len(store.load()[2]) if store.exists() else 0
        return run(), resumed
    except RecordMismatch as exc:  # another search, or records the proposer does not replay
        aside = directory.with_name(f"{directory.name}.stale-{int(time.time())}")
        log.warning("records in %s belong to another search (%s); moved to %s", directory, exc, aside)
        shutil.move(str(directory), str(aside))
        return run(), 0


def result_status(result: Any, fp: str, part: str, started: str, resumed: int, budget: int) -> TuningStatus:
    """``TuningResult`` -> the typed ``status.tuning`` of a finished search."""
    s = result.summary()
    best = s.get("best")
    stage1 = s.get("stage1")
    return TuningStatus(
        state=TuningState.SUCCEEDED,
        fingerprint=fp,
        partition=part,
        started_at=started,
        finished_at=_now(),
        trials=s["n_trials"],
        resumed_trials=resumed,
        budget=budget,
        method=s["method"],
        objective=s["objective"],
        rate=s["rate"],
        best=None if best is None else TuningBest.model_validate(best),
        stop_reason=s["stop_reason"],
        n_trials=s["n_trials"],
        stage1=None if stage1 is None else Stage1Summary.model_validate(stage1),
        device_s=s["device_s"],
    )


def tuning_patch(status: TuningStatus) -> dict[str, Any]:
    """The merge patch that *replaces* ``status.tuning``: unset fields are sent as null, so nothing
    of an earlier search (its best, its finish time) survives into a new one."""
    return {"tuning": status.model_dump(mode="json", by_alias=True)}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("tuning") or {}).get("enabled"))


class _Progress:
    """``on_trial`` callback: aborts when the daemon stops or the spec changes, and reports progress."""

    def __init__(
        self,
        write: Callable[[TuningStatus], None],
        running: TuningStatus,
        body: Mapping[str, Any],
        stopped: Stopped,
    ) -> None:
        self.write, self.running, self.body, self.stopped = write, running, body, stopped
        self.last = 0.0

    def _same_search(self) -> bool:
        try:
            spec = parse_spec(dict(self.body.get("spec") or {}))
        except ValidationError:
            return False
        return fingerprint(spec) == self.running.fingerprint and (
            spec.sm_partition.mode == PartitionMode.NONE or partition(spec) == self.running.partition
        )

    def __call__(self, rec: Any, records: list[Any]) -> None:
        if self.stopped or not self._same_search():
            raise _Abort()
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        vals = [r.value for r in records if r.ok and not r.cached]
        self.running = self.running.model_copy(
            update={"trials": len(vals), "best_so_far": max(vals) if vals else None}
        )
        self.write(self.running)


class StatusWriter(Protocol):
    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...


class Stopped(Protocol):
    """kopf.DaemonStopped: true once the daemon must stop; ``wait`` sleeps unless it is stopped."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Any: ...


@kopf.daemon(GROUP, VERSION, PLURAL, id="tuning", when=_enabled, cancellation_timeout=10.0)
def tuning_daemon(
    stopped: kopf.DaemonStopped,
    body: kopf.Body,
    meta: kopf.Meta,
    namespace: str,
    name: str,
    logger: logging.Logger,
    **_: Any,
) -> None:
    run_daemon(Kube(), stopped, body, namespace, name, str(meta.get("uid")), logger)


def run_daemon(
    client: StatusWriter,
    stopped: Stopped,
    body: Mapping[str, Any],
    namespace: str,
    name: str,
    uid: str,
    logger: logging.Logger = log,
    make_runner: Callable[..., tuple[Any, str | None]] | None = None,
) -> None:
    """The daemon's loop: search when the spec asks for a search nobody finished, else wait.

    ``body`` is kopf's live view of the object (updated by watch events, so it lags behind our
    own status writes); ``client`` writes status. ``make_runner(spec, namespace, name, uid,
    directory)`` gives the trials' runner and the Prometheus it scores with (default:
    ``trial_runner`` with the operator's ``--prometheus-url``).
    """
    if make_runner is None:

        def make_runner(*args: Any) -> tuple[Any, str | None]:
            from easerve_operator.reconcile.handlers import OPTIONS

            return trial_runner(*args, OPTIONS.defaults.prometheus_url)


    def write(st: TuningStatus) -> None:
        client.patch_status(namespace, name, tuning_patch(st))

    # What this daemon finished itself; kopf's body lags behind our own writes (module docstring).
    finished: dict[str, Any] | None = None
    while not stopped:
        try:
            spec = parse_spec(dict(body.get("spec") or {}))
        except ValidationError:
            stopped.wait(5)  # the reconciler reports InvalidSpec; nothing to search
            continue
        current = finished or (body.get("status") or {}).get("tuning") or {}
        if not needs_search(spec, current):
            stopped.wait(5)
            continue
        fp, part = fingerprint(spec), partition(spec)
        started = current.get("startedAt") if current.get("fingerprint") == fp else None
        started = started or _now()
        budget = spec.tuning.trial_budget
        directory = records_dir(namespace, name, uid, spec)
        running = TuningStatus(
            state=TuningState.RUNNING, fingerprint=fp, partition=part, started_at=started, trials=0, budget=budget
        )
        trials_on = str(spec.tuning.trials)
        running = running.model_copy(update={"trials_on": trials_on})
        write(running)
        prometheus: str | None = None
        try:
            runner, prometheus = make_runner(spec, namespace, name, uid, directory)
            result, resumed = search(spec, directory, _Progress(write, running, body, stopped), runner=runner)
        except _Abort:
            logger.info("tuning search interrupted (operator stopping or spec changed)")
            continue
        except Exception as exc:  # noqa: BLE001 - report any failure of the search in status
            logger.exception("tuning search failed")
            failed = TuningStatus(
                state=TuningState.FAILED,
                fingerprint=fp,
                partition=part,
                started_at=started,
                finished_at=_now(),
                budget=budget,
                message=f"{type(exc).__name__}: {exc}",
                trials_on=trials_on,
                prometheus_url=prometheus,
            )
            write(failed)
            finished = failed.wire()
            continue
        done = result_status(result, fp, part, started, resumed, budget).model_copy(
            update={"trials_on": trials_on, "prometheus_url": prometheus}
        )
        logger.info("tuning done (%d trials, %d resumed): %s", done.n_trials or 0, resumed,
                    json.dumps(done.wire().get("best"))[:300])
        write(done)
        finished = done.wire()
