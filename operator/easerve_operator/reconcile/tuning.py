"""HAS inside the operator: with ``spec.tuning.enabled``, search and report the result in status.

The search runs in a kopf daemon (one thread per EPDDeployment that asks for it). Its Stage-2
trials run where ``spec.tuning.trials`` says: ``twin`` (the in-operator simulator, a prediction)
or ``cluster`` (``runners.kube.KubeRunner``: each trial rolled out as this deployment's children,
driven by a load Job, scored from Prometheus at ``spec.observability.prometheusUrl`` or the
operator's ``--prometheus-url``: a measurement). Stage 1 profiles where the trials run: the twin's
profiler, or one profiling Job per stage kind (``runners.kube_profile``). Progress (``phase``,
``currentTrial``, ``etaSeconds``) and the result go to ``status.tuning`` (the typed ``TuningStatus``,
``trialsOn`` saying which); the operator never writes ``spec``. The result runs where the manifest
leaves the searched fields unset (``reconcile.effective``); otherwise copy ``status.tuning.best``
into the manifest in Git. With ``spec.tuning.adapt`` the daemon then runs the autopilot
(``reconcile.adapt_loop``).

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
    TuningPhase,
    TuningState,
    TuningStatus,
    parse_spec,
)
from easerve_runtime.api.status import Stage1Summary, TuningBest
from pydantic import ValidationError

from easerve_operator.reconcile import metrics
from easerve_operator.reconcile.effective import fingerprint, partition, unset_fields
from easerve_operator.reconcile.kube import Kube

PROGRESS_EVERY_S = 2.0
STATE_DIR_ENV = "EASERVE_STATE_DIR"
log = logging.getLogger(__name__)


class _Abort(Exception):
    """The daemon is stopping, or the spec changed under the search."""


class SearchStopped(RuntimeError):
    """A trial failed in a way every later trial would too (Prometheus unreachable after its retries):
    the search stops, Failed, with the trial's reason, instead of spending its budget on failures."""


FATAL_TRIAL_ERRORS = ("PrometheusUnreachable",)

# ------------------------------------------------------------------------------------ identity
# fingerprint / partition: the search's identity, shared with ``reconcile.effective`` (pure)


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
) -> tuple[Any, str | None, Any]:
    """``(runner, prometheus url, profiler)`` for ``spec.tuning.trials``: the twin's, or on this cluster.

    A cluster runner numbers its trials after those already recorded in ``directory`` (a resumed
    search never reuses a trial's name) and keeps each trial's report beside the records; its
    Stage 1 runs profiling Jobs (``runners.kube_profile``), their reports kept there too. The
    profiler is a function of the search space (None: the twin's)."""
    from easerve_operator.tuning.runners.sim import SimRunner

    if spec.tuning.trials == TrialBackend.TWIN:
        return SimRunner(), None, None
    url = spec.observability.prometheus_url or prometheus_default
    if not url:
        raise ValueError(
            "spec.tuning.trials is cluster, but no Prometheus is known to score the trials: set "
            "spec.observability.prometheusUrl, or the operator's --prometheus-url (chart: monitoring.prometheusUrl)"
        )
    from easerve_operator.reconcile.handlers import render_with_defaults
    from easerve_operator.tuning.prometheus import PrometheusScorer
    from easerve_operator.tuning.records import RecordStore
    from easerve_operator.tuning.runners.kube import KubeRunner, KubeTrialCluster
    from easerve_operator.tuning.runners.kube_profile import ClusterStageProfiler

    store = RecordStore(directory)
    done = len(store.load()[2]) if store.exists() else 0
    cluster = KubeTrialCluster()
    rate = float(spec.tuning.target_rate or 1.0)

    def profiler(space: Any) -> ClusterStageProfiler:
        tps = sorted({a.prefill_tp for a in space.allocations} | {a.decode_tp for a in space.allocations})
        return ClusterStageProfiler(
            cluster, name, namespace, spec, rate=rate, tps=tps, max_batch=space.max_batch,
            report_dir=directory / "profile", uid=uid, render=render_with_defaults,
        )

    runner = KubeRunner(
        cluster=cluster,
        deployment=name,
        namespace=namespace,
        uid=uid,
        scorer_for=lambda trial: PrometheusScorer(url, {"namespace": namespace, PROMETHEUS_TRIAL_LABEL: trial}),
        first_trial=done + 1,
        report_dir=directory / "trials",
        render=render_with_defaults,  # the operator-wide defaults, as the deployment's own children
    )
    return runner, url, profiler


def search(
    spec: EPDDeploymentSpec,
    directory: Path,
    on_progress: Callable[[Any, list[Any]], None] | None = None,
    runner: Any = None,
    profiler: Any = None,
) -> tuple[Any, int]:
    # ``profiler``: a Stage-1 profiler, or a function of the search space that makes one (the
    # cluster's profiling Jobs need the space's TPs and largest B)
    """Run (or resume) HAS for ``spec``, recording trials under ``directory``; the trials run on
    ``runner`` (default: the twin's), Stage 1 asks ``profiler`` (default: the twin's). With a
    ``SearchReporter`` as ``on_progress``, the phase and the current trial reach status as they
    change.

    Returns ``(TuningResult, trials recovered from the records)``. Records of another search in
    the directory (the spec changed while the operator was down) are moved aside, not mixed in.
    """
    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.records import RecordMismatch, RecordStore
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.space import space_for

    rate = float(spec.tuning.target_rate or 1.0)
    twin = SimStageProfiler(spec, rate=rate)
    space = space_for(spec, twin.min_tp(), local_tp=twin.local_prefill_tp())
    store = RecordStore(directory)
    trials = runner if runner is not None else SimRunner()
    stage1 = twin if profiler is None else profiler(space) if callable(profiler) else profiler
    if isinstance(on_progress, SearchReporter):
        trials, stage1 = on_progress.runner(trials), on_progress.profiler(stage1)

    def run() -> Any:
        return tune(
            spec,
            runner=trials,
            profiler=stage1,
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


def result_status(
    result: Any,
    fp: str,
    part: str,
    started: str,
    resumed: int,
    budget: int,
    applies: list[str] | None = None,
    details: list[dict[str, Any]] | None = None,
) -> TuningStatus:
    """``TuningResult`` -> the typed ``status.tuning`` of a finished search: ``Deploying`` when its
    values fill fields the spec leaves unset (``applies``), else ``Ready`` (a recommendation)."""
    s = result.summary()
    best = s.get("best")
    stage1 = s.get("stage1")
    message = None
    if best is None:  # every trial failed: nothing to apply or recommend
        errors = [r.error for r in result.trials if r.error]
        message = f"no trial was measured ({len(result.trials)} failed)" + (f"; last: {errors[-1]}" if errors else "")
    return TuningStatus(
        state=TuningState.SUCCEEDED if best is not None else TuningState.FAILED,
        message=message,
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
        phase=(TuningPhase.FAILED if best is None else TuningPhase.DEPLOYING if applies else TuningPhase.READY),
        applies=list(applies or []),
        trials_detail=details,
    )


def tuning_patch(status: TuningStatus) -> dict[str, Any]:
    """The merge patch that *replaces* ``status.tuning``: unset fields are sent as null, so nothing
    of an earlier search (its best, its finish time) survives into a new one."""
    return {"tuning": status.model_dump(mode="json", by_alias=True)}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("tuning") or {}).get("enabled"))


def candidate_label(spec: EPDDeploymentSpec) -> str:
    """How a trial's candidate reads in status: ``2E-1P(tp2)-2D(tp2) B=8 s=0.5``."""
    return f"{spec.allocation.label()} B={spec.encode.batch_bound} s={spec.offload.ratio:g}"


def trial_detail(rec: Any, last: Mapping[str, Any] | None, trials_on: str) -> dict[str, Any]:
    """One finished trial for ``status.tuning.trialsDetail``: its candidate and metrics, where they came
    from, and (cluster trials) the load Job's own figures and the cross-check beside them."""
    c = rec.candidate
    d: dict[str, Any] = {
        "trial": rec.number + 1,  # 1-based, as currentTrial and the cluster trials' names (<name>-t<n>)
        "candidate": f"{c.alloc.label} B={c.batch_bound} s={c.offload_ratio:g}",
        "point": c.to_dict(),
        "state": "cached" if rec.cached else rec.state,
        "value": rec.value,
    }
    m = rec.metrics
    if m is not None:
        d["metrics"] = {
            "throughput": m.throughput, "ttftMean": m.ttft_mean, "ttftP99": m.ttft_p99,
            "tpotMean": m.tpot_mean, "goodput": dict(m.goodput), "completed": m.completed,
        }
    if rec.error:
        d["error"] = str(rec.error)[:300]
    if rec.cached:
        d["metricsSource"] = "cache"
    elif last is not None and last.get("metrics_source") == "prometheus":
        k = float(last.get("time_scale", 1.0))
        job = last.get("job_report") or {}
        whole = (last.get("crosscheck") or {}).get("prometheus_whole_run") or {}
        ttft = whole.get("ttft") or {}
        d["metricsSource"] = "prometheus"
        d["prometheusWholeRun"] = {  # the whole run, warm-up included: what the twin predicts
            "throughput": None if whole.get("throughput") is None else float(whole["throughput"]) / k,
            "goodput": {t: float(v) / k for t, v in (whole.get("goodput") or {}).items()},
            "ttftMean": None if ttft.get("mean") is None else float(ttft["mean"]) * k,
            "ttftP99": None if (ttft.get("quantiles") or {}).get("p99") is None else float(ttft["quantiles"]["p99"]) * k,
            # each stage's busy time over its profile's, in model time (a sim engine at speed-up k
            # sleeps 1/k of it): 1.0 is as profiled, above it the host made the stage slower
            "engineOverProfile": {st: round(float(v) * k, 4) for st, v in (whole.get("engine_over_profile") or {}).items()},
        }
        d["cluster"] = {
            "name": last.get("name"),
            "timeScale": k,
            "rerun": bool(last.get("rerun")),
            "recovered": bool(last.get("recovered")),
            "phasesS": {p: round(float(v), 2) for p, v in (last.get("phases_s") or {}).items()},
            "job": {
                "throughput": None if job.get("throughput") is None else float(job["throughput"]) / k,
                "goodput": {t: float(v) / k for t, v in (job.get("goodput") or {}).items()},
                "completed": job.get("completed"),
                "failed": job.get("failed"),
                # why requests failed (e.g. the door's "admission queue full (5 of 5 waiting)": the bound
                # then), the most frequent few, so a refusal count can be read against the twin's door
                "errors": dict(sorted((job.get("errors") or {}).items(), key=lambda kv: -int(kv[1]))[:6]),
            },
            "crosscheck": {
                "ratios": (last.get("crosscheck") or {}).get("ratios"),
                "within3pct": (last.get("crosscheck") or {}).get("within_3pct"),
            },
        }
    else:
        d["metricsSource"] = "twin" if trials_on == TrialBackend.TWIN else str(trials_on)
    return d


class SearchReporter:
    """Reports a search to ``status.tuning`` as it goes, and aborts it when the daemon stops or the
    spec changes (``on_trial`` callback of ``tune``). It wraps the search's runner and profiler
    (``runner()``, ``profiler()``) to see the phase change and each trial start: ``phase`` goes
    Profiling -> Tuning, ``currentTrial`` names the trial running now, ``etaSeconds`` bounds the time
    left (the mean trial so far times the budget left)."""

    def __init__(
        self,
        write: Callable[[TuningStatus], None],
        running: TuningStatus,
        body: Mapping[str, Any],
        stopped: Stopped,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write, self.running, self.body, self.stopped = write, running, body, stopped
        self.clock = clock
        self.last = 0.0
        self.started_trials = 0
        self.trial_s: list[float] = []
        self._t_trial: float | None = None
        self.details: list[dict[str, Any]] = []
        self._runner: Any = None

    def _same_search(self) -> bool:
        try:
            spec = parse_spec(dict(self.body.get("spec") or {}))
        except ValidationError:
            return False
        return fingerprint(spec) == self.running.fingerprint and (
            spec.sm_partition.mode == PartitionMode.NONE or partition(spec) == self.running.partition
        )

    def _check(self) -> None:
        if self.stopped or not self._same_search():
            raise _Abort()

    def _eta(self, done: int) -> float | None:
        budget = self.running.budget or 0
        if not self.trial_s:
            return None
        return round(sum(self.trial_s) / len(self.trial_s) * max(0, budget - done), 1)

    def _push(self, force: bool = False, **update: Any) -> None:
        self.running = self.running.model_copy(update=update)
        now = self.clock()
        if force or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.write(self.running)

    # -------------------------------------------------------------- hooks
    def profiling(self) -> None:
        self._check()
        if self.running.phase != TuningPhase.PROFILING:
            self._push(force=True, phase=TuningPhase.PROFILING)

    def trial_started(self, spec: EPDDeploymentSpec) -> None:
        self._check()
        self.started_trials += 1
        self._t_trial = self.clock()
        n = (self.running.trials or 0) + 1
        self._push(force=True, phase=TuningPhase.TUNING, current_trial=f"{n}: {candidate_label(spec)}")

    def __call__(self, rec: Any, records: list[Any]) -> None:
        if self._t_trial is not None and not rec.cached:
            self.trial_s.append(self.clock() - self._t_trial)
            self._t_trial = None
        last = getattr(self._runner, "last", None) if not rec.cached else None
        self.details.append(trial_detail(rec, last if isinstance(last, Mapping) else None, self.running.trials_on or ""))
        if rec.error and str(rec.error).startswith(FATAL_TRIAL_ERRORS):
            raise SearchStopped(f"trial {rec.number + 1} failed: {rec.error}")
        self._check()
        vals = [r.value for r in records if r.ok and not r.cached]
        done = len([r for r in records if not r.cached])
        self._push(
            trials=done, best_so_far=max(vals) if vals else None, eta_seconds=self._eta(done),
            trials_detail=list(self.details), current_trial=None,
        )

    # -------------------------------------------------------------- wrappers
    def runner(self, runner: Any) -> Any:
        self._runner = runner
        return _ReportedRunner(runner, self)

    def profiler(self, profiler: Any) -> Any:
        self._profiler = profiler
        return _ReportedProfiler(profiler, self)

    def stage1_sources(self) -> dict[str, str] | None:
        """Where each stage's Stage-1 capacity came from (a cluster profiler says: job, recovered, twin)."""
        report = getattr(getattr(self, "_profiler", None), "report", None)
        if not callable(report):
            return None
        return {k: str(v) for k, v in report().get("sources", {}).items()} or None


class _ReportedRunner:
    def __init__(self, inner: Any, reporter: SearchReporter) -> None:
        self.inner, self.reporter = inner, reporter

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> Any:
        self.reporter.trial_started(spec)
        return self.inner.run_trial(spec, rate, requests, seed)


class _ReportedProfiler:
    """The Stage-1 profiler; its first capacity question marks the Profiling phase."""

    def __init__(self, inner: Any, reporter: SearchReporter) -> None:
        self.inner, self.reporter = inner, reporter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("encode_throughput", "prefill_capacity", "decode_capacity", "local_prefill_efficiency"):

            def probe(*a: Any, **kw: Any) -> Any:
                self.reporter.profiling()
                return attr(*a, **kw)

            return probe
        return attr


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
    make_runner: Callable[..., tuple[Any, str | None, Any]] | None = None,
) -> None:
    """The daemon's loop: search when the spec asks for a search nobody finished, else wait.

    ``body`` is kopf's live view of the object (updated by watch events, so it lags behind our
    own status writes); ``client`` writes status. ``make_runner(spec, namespace, name, uid,
    directory)`` gives the trials' runner, the Prometheus it scores with and the Stage-1 profiler
    (default: ``trial_runner`` with the operator's ``--prometheus-url``). Once a search has
    succeeded, with ``spec.tuning.adapt.enabled`` the loop steps the autopilot every
    ``ADAPT_PERIOD_S`` instead of idling.
    """
    if make_runner is None:

        def make_runner(*args: Any) -> tuple[Any, str | None, Any]:
            from easerve_operator.reconcile.handlers import OPTIONS

            return trial_runner(*args, OPTIONS.defaults.prometheus_url)


    def write(st: TuningStatus) -> None:
        client.patch_status(namespace, name, tuning_patch(st))

    # What this daemon finished itself; kopf's body lags behind our own writes (module docstring).
    finished: dict[str, Any] | None = None
    autopilot = Autopilot(client, namespace, name, None, logger)
    while not stopped:
        try:
            spec = parse_spec(dict(body.get("spec") or {}))
        except ValidationError:
            stopped.wait(5)  # the reconciler reports InvalidSpec; nothing to search
            continue
        current = finished or (body.get("status") or {}).get("tuning") or {}
        if not needs_search(spec, current):  # idle: finish the phases, run the autopilot
            if deployed(current, body):
                ready = TuningStatus.model_validate(current).model_copy(update={"phase": TuningPhase.READY})
                write(ready)
                finished = ready.wire()
            if spec.tuning.adapt.enabled and current.get("state") == TuningState.SUCCEEDED:
                autopilot.step(body, spec, current)
                stopped.wait(ADAPT_PERIOD_S)
            else:
                stopped.wait(5)
            continue
        fp, part = fingerprint(spec), partition(spec)
        started = current.get("startedAt") if current.get("fingerprint") == fp else None
        started = started or _now()
        budget = spec.tuning.trial_budget
        directory = records_dir(namespace, name, uid, spec)
        trials_on = str(spec.tuning.trials)
        applies = unset_fields(dict(body.get("spec") or {}))
        running = TuningStatus(
            state=TuningState.RUNNING, fingerprint=fp, partition=part, started_at=started, trials=0, budget=budget,
            trials_on=trials_on, phase=TuningPhase.PROFILING, applies=applies,
        )
        write(running)
        prometheus: str | None = None
        reporter = SearchReporter(write, running, body, stopped)
        t0 = time.monotonic()
        try:
            runner, prometheus, profiler = make_runner(spec, namespace, name, uid, directory)
            reporter.running = reporter.running.model_copy(update={"prometheus_url": prometheus})
            result, resumed = search(spec, directory, reporter, runner=runner, profiler=profiler)
        except _Abort:
            logger.info("tuning search interrupted (operator stopping or spec changed)")
            continue
        except Exception as exc:  # noqa: BLE001 - report any failure of the search in status
            logger.exception("tuning search failed")
            metrics.SEARCHES.labels(outcome="failed").inc()
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
                phase=TuningPhase.FAILED,
                applies=applies,
                trials_detail=reporter.details or None,
            )
            write(failed)
            finished = failed.wire()
            continue
        for r in result.trials:
            metrics.TRIALS.labels(outcome="cached" if r.cached else r.state, trials_on=trials_on).inc()
        metrics.SEARCH_SECONDS.observe(time.monotonic() - t0)
        done = result_status(result, fp, part, started, resumed, budget, applies, all_details(result, reporter, trials_on)).model_copy(
            update={"trials_on": trials_on, "prometheus_url": prometheus, "stage1_sources": reporter.stage1_sources()}
        )
        metrics.SEARCHES.labels(outcome=str(done.state).lower()).inc()
        logger.info("tuning done (%d trials, %d resumed): %s", done.n_trials or 0, resumed,
                    json.dumps(done.wire().get("best"))[:300])
        write(done)
        finished = done.wire()


ADAPT_PERIOD_S = 2.0
"""How often the autopilot reads the load (its decisions are paced by spec.tuning.adapt's hold and interval)."""
ADAPT_WRITE_EVERY_S = 10.0


class Autopilot:
    """The daemon's side of ``reconcile.adapt_loop``: builds the loop once a Prometheus is known,
    steps it, and writes ``status.adapt`` when a decision is made (at once) or every 10 s."""

    def __init__(self, client: StatusWriter, namespace: str, name: str, prometheus_default: str | None,
                 logger: logging.Logger) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self.prometheus_default, self.logger = prometheus_default, logger
        self.loop: Any = None
        self.url: str | None = None
        self.last_write = 0.0
        self.last_decisions = -1

    def step(self, body: Mapping[str, Any], spec: EPDDeploymentSpec, tuning: Mapping[str, Any]) -> None:
        from easerve_operator.reconcile.adapt_loop import AdaptLoop, PrometheusRates
        from easerve_operator.reconcile.effective import resolve

        raw = dict(body.get("spec") or {})
        status = body.get("status") or {}
        r = resolve(raw, spec, tuning, status.get("effective"))
        if r.spec is None:
            return
        url = spec.observability.prometheus_url or self.default_url()
        if not url:
            self.write({"message": "spec.tuning.adapt needs a Prometheus: set spec.observability.prometheusUrl "
                        "or the operator's --prometheus-url (chart: monitoring.prometheusUrl)"}, force=False)
            return
        if self.loop is None or url != self.url:
            self.loop, self.url = AdaptLoop(PrometheusRates(url, self.namespace, self.name)), url
        st = self.loop.step(raw, r.spec, status.get("adapt"), deployment=status)
        if st is None:
            return
        n = len(st.decisions)
        self.write(st.model_dump(mode="json", by_alias=True), force=n != self.last_decisions)
        self.last_decisions = n

    def default_url(self) -> str | None:
        if self.prometheus_default is not None:
            return self.prometheus_default
        from easerve_operator.reconcile.handlers import OPTIONS

        return OPTIONS.defaults.prometheus_url

    def write(self, adapt: dict[str, Any], force: bool) -> None:
        now = time.monotonic()
        if not force and now - self.last_write < ADAPT_WRITE_EVERY_S:
            return
        self.last_write = now
        self.client.patch_status(self.namespace, self.name, {"adapt": adapt})


def all_details(result: Any, reporter: SearchReporter, trials_on: str) -> list[dict[str, Any]]:
    """Every trial of the search for status: those this daemon ran (with their cluster figures), and
    those recorded before a restart (``resumed``: their figures are in the records)."""
    mine = {d["trial"]: d for d in reporter.details}
    out = []
    for r in result.trials:
        d = mine.get(r.number + 1)
        if d is None:
            d = {**trial_detail(r, None, trials_on), "resumed": True}
        out.append(d)
    return out


def deployed(tuning: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
    """A finished search in ``Deploying`` whose values now serve: the deployment is Ready and
    ``status.effective`` shows this search's values on every field it tuned."""
    if tuning.get("phase") != TuningPhase.DEPLOYING or tuning.get("state") != TuningState.SUCCEEDED:
        return False
    status = body.get("status") or {}
    if status.get("phase") != "Ready" or status.get("observedGeneration") != (body.get("metadata") or {}).get(
        "generation", status.get("observedGeneration")
    ):
        return False
    eff = status.get("effective") or {}
    src = eff.get("sources") or {}
    best = tuning.get("best") or {}
    if "tuned" not in src.values():
        return False
    pairs = (("allocation", "allocationLabel", "allocation"), ("encode.batchBound", "batchBound", "batchBound"),
             ("offload.ratio", "offloadRatio", "offloadRatio"))
    return all(src.get(f) != "tuned" or eff.get(e) == best.get(b) for f, e, b in pairs)
