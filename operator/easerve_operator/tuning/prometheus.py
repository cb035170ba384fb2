"""Score a trial from Prometheus: the runtime's ``easerve_`` metrics over a measurement window.

WHY from Prometheus (issue 13): on a cluster the serving pods already export what HAS ranks by
(``docs/metrics.md``), and Prometheus is where an operator finds them; the load generator's
own report is kept as a cross-check, not the score. This module turns one window
[start, end] (unix seconds, warm-up already cut off by the caller) into ``PromFigures``:

- completed throughput: the increase of ``easerve_requests_total{status="ok"}`` over the
  window, divided by the window's length;
- goodput per tier: the same for ``easerve_goodput_requests_total{tier}``;
- TTFT / TPOT: mean from the histograms' ``_sum`` / ``_count`` increases (exact), percentiles
  from the ``_bucket`` increases with Prometheus's own ``histogram_quantile`` interpolation.

HOW the increases are exact. One query fetches the raw samples of every series
(``{__name__=~"easerve_...", <selector>}[range]``), counter resets are undone (a restarted
process starts again from 0), and each counter is read AT the window's edges:

- an edge where the system is idle is read exactly: the start of a window that starts with
  the load (``idle_before_start``) at the last scrape before it, the end of a window that ends
  with the load's last completion (``drained_at_end``, the default: a trial's window ends when
  the load generator's last request finished) at the first scrape after it;
- an edge that cuts into a busy run (the end of the warm-up) is interpolated linearly between
  the two scrapes around it: off by less than one scrape interval's worth of events, pro rata.
  Interpolating an idle edge instead is biased: measured with 1 s scrapes over a 43 s run,
  237.4 of 240 completions (drained end interpolated) and a TTFT count of 239.4 (idle start
  interpolated: the first TTFT lands within the first scrape interval).

PromQL's ``increase()`` would instead extrapolate to the range's edges.

Resolution of the percentiles: a histogram only knows which bucket a value fell in, so a
percentile is exact to its bucket: it lies in (lower, upper] of the bucket that holds the
quantile rank, and the estimate interpolates linearly inside it. With the runtime's buckets
(``easerve_runtime.metrics``) that is a factor of 2 for TTFT above 0.25 s (0.25, 0.5, 1, 2, 4,
…) and 1.3–2× for TPOT in 0.01–0.25 s. ``PromFigures`` reports each percentile's bucket so a
reader knows its resolution. The means are exact.

Prometheus unreachable: every request is retried with exponential back-off (``retries``
attempts, ``backoff_s`` doubling up to ``max_backoff_s``); then ``PrometheusUnreachable`` names
the URL, the attempts and the last error. A query Prometheus rejects (HTTP 4xx) is not retried.

The pure parts (``counter_at``, ``increases``, ``histogram_quantile``, ``figures_from_series``)
take plain data and are tested without a server; ``PrometheusScorer`` is the thin shell.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.metrics import histogram_quantile

from easerve_operator.tuning.runners import TrialMetrics

REQUESTS = "easerve_requests_total"
GOODPUT = "easerve_goodput_requests_total"
HISTOGRAMS = {"ttft": "easerve_ttft_seconds", "tpot": "easerve_tpot_seconds"}
ENGINE_VS_PROFILE = {  # engine seconds, the profile's seconds for the same batches (label ``stage`` for prefill)
    "encode": ("easerve_encode_batch_seconds_sum", "easerve_encode_profile_seconds_total"),
    "prefill": ("easerve_prefill_engine_seconds_total", "easerve_prefill_profile_seconds_total"),
}
_NAMES = (
    REQUESTS,
    GOODPUT,
    *(f"{h}_{part}" for h in HISTOGRAMS.values() for part in ("bucket", "sum", "count")),
    *(n for pair in ENGINE_VS_PROFILE.values() for n in pair),
)
NAME_REGEX = "|".join(re.escape(n) for n in _NAMES)

DEFAULT_RETRIES = 6
DEFAULT_BACKOFF_S = 0.5
DEFAULT_MAX_BACKOFF_S = 8.0
DEFAULT_MARGIN_S = 60.0
QUANTILES = (0.5, 0.99)

Sample = tuple[float, float]


class PrometheusUnreachable(RuntimeError):
    """Prometheus did not answer after every retry; ``url`` names the server asked."""

    def __init__(self, url: str, attempts: int, waited_s: float, last: BaseException | None) -> None:
        self.url = url
        self.attempts = attempts
        self.waited_s = waited_s
        why = "" if last is None else f": {type(last).__name__}: {last}"
        super().__init__(
            f"Prometheus at {url} unreachable after {attempts} attempts over {waited_s:.1f} s{why}"
        )


class PrometheusQueryError(RuntimeError):
    """Prometheus answered but rejected the query (a bug or a bad selector: not retried)."""


class ScrapeNotCaughtUp(RuntimeError):
    """The window's end has not been scraped yet for every target (the figures would be short)."""


# --------------------------------------------------------------------------------------------
# Pure part


def selector_string(selector: Mapping[str, str] | str) -> str:
    """A PromQL label matcher list (no braces) from a mapping, or the string as given."""
    if isinstance(selector, str):
        return selector.strip().strip("{}")
    parts = []
    for k, v in sorted(selector.items()):
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k):
            raise ValueError(f"not a Prometheus label name: {k!r}")
        esc = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{k}="{esc}"')
    return ",".join(parts)


def reset_corrected(samples: Sequence[Sample]) -> list[Sample]:
    """The samples with counter resets undone: a drop means the process restarted from 0."""
    out: list[Sample] = []
    offset = 0.0
    prev: float | None = None
    for t, v in sorted(samples):
        if prev is not None and v < prev:
            offset += prev
        prev = v
        out.append((t, v + offset))
    return out


INTERPOLATE, LAST_BEFORE, FIRST_AFTER = "interpolate", "last-before", "first-after"


def counter_at(samples: Sequence[Sample], t: float, edge: str = INTERPOLATE) -> float:
    """A (reset-corrected) counter's value at time ``t``.

    ``edge`` says how to read between the two scrapes around ``t``: ``interpolate`` linearly;
    ``last-before`` takes the scrape at or before ``t`` (exact when nothing changed between it
    and ``t``: the system was idle before ``t``); ``first-after`` the scrape at or after ``t``
    (exact when nothing changes after ``t``: the load drained at ``t``). Before the first
    sample the series did not exist yet, so its value is 0 (prometheus-client creates a
    labelled child at 0 on its first increment), unless ``first-after`` is asked. After the
    last sample it is the last value: the caller makes sure a scrape after ``t`` exists.
    """
    if edge not in (INTERPOLATE, LAST_BEFORE, FIRST_AFTER):
        raise ValueError(f"edge must be one of interpolate, last-before, first-after, got {edge!r}")
    if not samples:
        return 0.0
    if t < samples[0][0]:
        return samples[0][1] if edge == FIRST_AFTER else 0.0
    for (t0, v0), (t1, v1) in zip(samples, samples[1:], strict=False):
        if t0 <= t <= t1:
            if t == t0 or t1 == t0:
                return v0
            if t == t1:
                return v1
            if edge == LAST_BEFORE:
                return v0
            if edge == FIRST_AFTER:
                return v1
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return samples[-1][1]


def increases(
    series: Iterable[tuple[Mapping[str, str], Sequence[Sample]]],
    start: float,
    end: float,
    *,
    idle_before_start: bool = False,
    drained_at_end: bool = False,
) -> list[tuple[dict[str, str], float]]:
    """Each series' increase over [start, end] (labels kept, values reset-corrected).

    ``idle_before_start`` / ``drained_at_end`` pick the exact reading at an idle edge (see
    ``counter_at``); otherwise the edge is interpolated.
    """
    e_start = LAST_BEFORE if idle_before_start else INTERPOLATE
    e_end = FIRST_AFTER if drained_at_end else INTERPOLATE
    out = []
    for labels, samples in series:
        s = reset_corrected(samples)
        inc = counter_at(s, end, e_end) - counter_at(s, start, e_start)
        out.append((dict(labels), max(0.0, inc)))
    return out


def bucket_of(value: float, bounds: Iterable[float]) -> tuple[float, float]:
    """The bucket (lower, upper] holding ``value``: a percentile's resolution."""
    lower = 0.0
    for b in sorted(bounds):
        if value <= b:
            return (lower, b)
        lower = b
    return (lower, math.inf)


@dataclass(frozen=True)
class Distribution:
    """One latency histogram over the window: mean (exact), percentiles and their buckets."""

    count: float
    mean: float
    quantiles: dict[str, float]
    buckets: dict[str, tuple[float, float]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": _num(self.mean),
            "quantiles": {k: _num(v) for k, v in self.quantiles.items()},
            "buckets": {k: [_num(lo), _num(hi)] for k, (lo, hi) in self.buckets.items()},
        }


@dataclass(frozen=True)
class PromFigures:
    """What Prometheus says about one window."""

    start: float
    end: float
    completed: float
    failed: float
    throughput: float
    goodput: dict[str, float]
    ttft: Distribution
    tpot: Distribution
    series: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    engine_over_profile: dict[str, float] = field(default_factory=dict)
    """Per stage (encode; prefill and local-prefill by their ``stage`` label): the engine's busy
    seconds over the profile's seconds for the same batches, summed over the deployment's pods.
    1.0 is a stage running as profiled; a sim engine at speed-up k reads 1/k."""

    @property
    def window_s(self) -> float:
        return self.end - self.start

    def to_trial_metrics(self, cost_s: float = 0.0) -> TrialMetrics:
        return TrialMetrics(
            throughput=self.throughput,
            ttft_mean=self.ttft.mean,
            tpot_mean=self.tpot.mean,
            goodput=dict(self.goodput),
            ttft_p99=self.ttft.quantiles.get("p99"),
            tpot_p99=self.tpot.quantiles.get("p99"),
            completed=int(round(self.completed)),
            cost_s=cost_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": "prometheus",
            "start": self.start,
            "end": self.end,
            "window_s": self.window_s,
            "completed": self.completed,
            "failed": self.failed,
            "throughput": self.throughput,
            "goodput": dict(self.goodput),
            "ttft": self.ttft.to_dict(),
            "tpot": self.tpot.to_dict(),
            "series": self.series,
            "engine_over_profile": dict(self.engine_over_profile),
            **self.extra,
        }


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def _distribution(
    name: str, incs: list[tuple[dict[str, str], float]], quantiles: Sequence[float]
) -> Distribution:
    buckets: dict[float, float] = {}
    total_sum = total_count = 0.0
    for labels, inc in incs:
        metric = labels.get("__name__", "")
        if metric == f"{name}_bucket":
            le = float(labels["le"])  # "+Inf" parses to inf
            buckets[le] = buckets.get(le, 0.0) + inc
        elif metric == f"{name}_sum":
            total_sum += inc
        elif metric == f"{name}_count":
            total_count += inc
    mean = total_sum / total_count if total_count > 0 else math.nan
    qs: dict[str, float] = {}
    bks: dict[str, tuple[float, float]] = {}
    finite = [b for b in buckets if not math.isinf(b)]
    for q in quantiles:
        key = f"p{q * 100:g}"
        v = histogram_quantile(q, buckets) if buckets else math.nan
        qs[key] = v
        bks[key] = (math.nan, math.nan) if math.isnan(v) else bucket_of(v, finite)
    return Distribution(total_count, mean, qs, bks)


def figures_from_series(
    series: Sequence[tuple[Mapping[str, str], Sequence[Sample]]],
    start: float,
    end: float,
    quantiles: Sequence[float] = QUANTILES,
    *,
    idle_before_start: bool = False,
    drained_at_end: bool = True,
) -> PromFigures:
    """``PromFigures`` for [start, end] from raw samples of the ``easerve_`` series (pure).

    ``drained_at_end`` (default): the window ends with the load's last completion, so the
    counters are read at the first scrape after ``end``. ``idle_before_start``: nothing ran
    before ``start`` (the window starts with the load, no warm-up cut), so they are read at the
    last scrape before it. Otherwise an edge is interpolated (see the module docstring).
    """
    if not end > start:
        raise ValueError(f"measurement window must have end > start, got [{start}, {end}]")
    incs = increases(series, start, end, idle_before_start=idle_before_start, drained_at_end=drained_at_end)
    dur = end - start
    done = failed = 0.0
    goodput: dict[str, float] = {}
    busy: dict[str, list[float]] = {}  # stage -> [engine seconds, profile seconds]
    for labels, inc in incs:
        metric = labels.get("__name__")
        for kind, (engine_name, profile_name) in ENGINE_VS_PROFILE.items():
            if metric in (engine_name, profile_name):
                acc = busy.setdefault(labels.get("stage", kind) if kind == "prefill" else kind, [0.0, 0.0])
                acc[0 if metric == engine_name else 1] += inc
        if metric == REQUESTS:
            if labels.get("status") == "ok":
                done += inc
            elif labels.get("status") == "error":
                failed += inc
        elif metric == GOODPUT:
            tier = labels.get("tier", "")
            goodput[tier] = goodput.get(tier, 0.0) + inc / dur
    return PromFigures(
        start=start,
        end=end,
        completed=done,
        failed=failed,
        throughput=done / dur,
        goodput=goodput,
        ttft=_distribution(HISTOGRAMS["ttft"], incs, quantiles),
        tpot=_distribution(HISTOGRAMS["tpot"], incs, quantiles),
        series=len(series),
        engine_over_profile={st: e / prof for st, (e, prof) in sorted(busy.items()) if prof > 0},
    )


# --------------------------------------------------------------------------------------------
# Shell: prometheus-api-client with retries


class PrometheusScorer:
    """Query one Prometheus for one deployment's series (``selector``) over trial windows.

    ``selector`` is a mapping of Prometheus label to value (or a raw matcher string) that picks
    the deployment's scrape targets, e.g. ``{"namespace": "ns", "easerve_io_deployment": "x"}``.
    ``sleep`` and ``clock`` are injected so the back-off can be tested without waiting.
    """

    def __init__(
        self,
        url: str,
        selector: Mapping[str, str] | str,
        *,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        timeout_s: float = 10.0,
        margin_s: float = DEFAULT_MARGIN_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
        client: Any = None,
    ) -> None:
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        self.url = url.rstrip("/")
        self.selector = selector_string(selector)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.margin_s = margin_s
        self.sleep = sleep
        self.clock = clock
        self._client = client if client is not None else self._connect()

    def _connect(self) -> Any:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        # our own back-off below: the library's adapter retries would hide the attempts
        return PrometheusConnect(
            url=self.url,
            disable_ssl=True,
            retry=Retry(total=0, raise_on_status=False),
            timeout=self.timeout_s,
        )

    def _matcher(self, name_regex: str) -> str:
        sel = f",{self.selector}" if self.selector else ""
        return f'{{__name__=~"{name_regex}"{sel}}}'

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """One instant query with retries; ``PrometheusUnreachable`` names the URL at the end."""
        from prometheus_api_client import PrometheusApiClientException
        from requests import RequestException

        params = {} if at is None else {"time": f"{at:.3f}"}
        t0 = self.clock()
        last: BaseException | None = None
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return list(self._client.custom_query(promql, params=params))
            except PrometheusApiClientException as exc:
                if re.search(r"HTTP Status Code 4\d\d", str(exc)):
                    raise PrometheusQueryError(
                        f"Prometheus at {self.url} rejected {promql!r}: {exc}"
                    ) from exc
                last = exc
            except (RequestException, OSError) as exc:
                last = exc
            if attempt < self.retries:
                self.sleep(delay)
                delay = min(self.max_backoff_s, delay * 2)
        raise PrometheusUnreachable(self.url, self.retries, self.clock() - t0, last)

    def last_scrape(self) -> float | None:
        """The oldest of the targets' latest scrape times (``up``; None: no target matches yet)."""
        res = self.query(f"min(timestamp({self._matcher('up')}))")
        if not res:
            return None
        v = float(res[0]["value"][1])
        return None if math.isnan(v) else v

    def wait_scraped(self, after: float, timeout_s: float = 60.0, poll_s: float = 0.5) -> float:
        """Block until every matching target has a sample newer than ``after``; returns its time."""
        deadline = self.clock() + timeout_s
        while True:
            ts = self.last_scrape()
            if ts is not None and ts >= after:
                return ts
            if self.clock() >= deadline:
                raise ScrapeNotCaughtUp(
                    f"Prometheus at {self.url}: no scrape of {{{self.selector}}} after t={after:.1f} "
                    f"within {timeout_s:g} s (latest {ts})"
                )
            self.sleep(poll_s)

    def samples(self, start: float, end: float) -> list[tuple[dict[str, str], list[Sample]]]:
        """Raw samples of the ``easerve_`` series from ``margin_s`` before ``start`` to now."""
        at = max(end, self.clock())
        rng = max(1, math.ceil(at - start + self.margin_s))
        res = self.query(f"{self._matcher(NAME_REGEX)}[{rng}s]", at=at)
        out = []
        for r in res:
            vals = [(float(t), float(v)) for t, v in r.get("values", [])]
            out.append((dict(r.get("metric", {})), vals))
        return out

    def score(
        self,
        start: float,
        end: float,
        quantiles: Sequence[float] = QUANTILES,
        wait_timeout_s: float = 60.0,
        idle_before_start: bool = False,
        drained_at_end: bool = True,
    ) -> PromFigures:
        """Figures for [start, end]: waits for a scrape after ``end``, then one query.

        ``drained_at_end`` (default): ``end`` is the load's last completion; pass False for a
        window that ends inside a busy run. ``idle_before_start``: the window starts with the
        load (no warm-up cut). See the module docstring.
        """
        self.wait_scraped(end, timeout_s=wait_timeout_s)
        series = self.samples(start, end)
        if not any(lbl.get("__name__") == REQUESTS for lbl, _ in series):
            raise ScrapeNotCaughtUp(
                f"Prometheus at {self.url}: no {REQUESTS} series match {{{self.selector}}}"
            )
        return figures_from_series(
            series, start, end, quantiles, idle_before_start=idle_before_start, drained_at_end=drained_at_end
        )
