"""Scoring from Prometheus (``easerve_operator.tuning.prometheus``).

The pure part on hand-computed samples; the shell against a REAL Prometheus (Debian's, started
by e2e/prom-up.sh) scraping a real ``easerve serve`` (sim engine, file discovery) driven by
``easerve bench``: the Prometheus figures must agree with the bench's own report.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from easerve_operator.tuning.prometheus import (
    PrometheusQueryError,
    PrometheusScorer,
    PrometheusUnreachable,
    bucket_of,
    counter_at,
    figures_from_series,
    histogram_quantile,
    increases,
    reset_corrected,
    selector_string,
)
from easerve_runtime.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from easerve_runtime.workers.launcher import free_port
from serve_process import serve_process

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "e2e"
SPEC = ROOT / "tests" / "runtime" / "spec_small.yaml"


# ----------------------------------------------------------------------------- pure part


def test_counter_at_interpolates_between_scrapes_and_is_zero_before_the_series():
    s = [(10.0, 0.0), (11.0, 0.0), (12.0, 4.0), (13.0, 4.0)]
    assert counter_at(s, 9.0) == 0.0
    assert counter_at(s, 11.5) == pytest.approx(2.0)
    assert counter_at(s, 12.5) == 4.0  # idle after the last completion: exact
    assert counter_at(s, 20.0) == 4.0
    assert counter_at([], 1.0) == 0.0
    # idle edges: the scrape after (nothing changes after t) or before (nothing changed before)
    assert counter_at(s, 11.5, "first-after") == 4.0
    assert counter_at(s, 11.5, "last-before") == 0.0
    assert counter_at(s, 11.0, "first-after") == 0.0
    with pytest.raises(ValueError, match="edge"):
        counter_at(s, 11.0, "nearest")


def test_resets_are_undone_and_increases_are_per_series():
    s = reset_corrected([(1.0, 5.0), (2.0, 7.0), (3.0, 1.0), (4.0, 3.0)])  # restart between 2 and 3
    assert s == [(1.0, 5.0), (2.0, 7.0), (3.0, 8.0), (4.0, 10.0)]
    incs = increases([({"a": "x"}, [(1.0, 5.0), (2.0, 7.0), (3.0, 1.0), (4.0, 3.0)])], 1.0, 4.0)
    assert incs == [({"a": "x"}, 5.0)]


def test_histogram_quantile_matches_prometheus_interpolation():
    # 10 values: 4 in (0, 1], 4 in (1, 2], 2 in (2, 4]
    b = {1.0: 4.0, 2.0: 8.0, 4.0: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, b) == pytest.approx(1.0 + 1.0 * (5 - 4) / 4)
    assert histogram_quantile(0.2, b) == pytest.approx(0.5)
    assert histogram_quantile(0.99, b) == pytest.approx(2.0 + 2.0 * (9.9 - 8) / 2)
    # a rank in +Inf returns the largest finite bound, as Prometheus does
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0
    assert math.isnan(histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}))
    assert bucket_of(1.25, [1.0, 2.0, 4.0]) == (1.0, 2.0)
    assert bucket_of(5.0, [1.0, 2.0, 4.0]) == (4.0, math.inf)


def _series(name: str, labels: dict[str, str], pts: list[tuple[float, float]]) -> tuple[dict[str, str], Any]:
    return ({"__name__": name, **labels}, pts)


def test_figures_from_series_hand_computed():
    idle_then = [(0.0, 0.0), (10.0, 0.0), (20.0, 30.0), (30.0, 30.0)]
    series = [
        _series("easerve_requests_total", {"status": "ok", "pod": "fe"}, idle_then),
        _series("easerve_requests_total", {"status": "error", "pod": "fe"}, [(0.0, 0.0), (30.0, 2.0)]),
        _series("easerve_goodput_requests_total", {"tier": "t"}, [(0.0, 0.0), (10.0, 0.0), (30.0, 15.0)]),
        _series("easerve_ttft_seconds_bucket", {"le": "1.0"}, [(10.0, 0.0), (30.0, 20.0)]),
        _series("easerve_ttft_seconds_bucket", {"le": "2.0"}, [(10.0, 0.0), (30.0, 30.0)]),
        _series("easerve_ttft_seconds_bucket", {"le": "+Inf"}, [(10.0, 0.0), (30.0, 30.0)]),
        _series("easerve_ttft_seconds_sum", {}, [(10.0, 0.0), (30.0, 27.0)]),
        _series("easerve_ttft_seconds_count", {}, [(10.0, 0.0), (30.0, 30.0)]),
    ]
    # drained end (the default): counters are read at the first scrape after t = 25
    f = figures_from_series(series, 10.0, 25.0)
    assert f.completed == 30.0 and f.throughput == pytest.approx(2.0)
    assert f.failed == pytest.approx(2.0 - 2.0 * 10 / 30)  # start interpolated, end settled
    assert f.goodput == {"t": pytest.approx(1.0)}
    assert f.ttft.mean == pytest.approx(0.9) and f.ttft.count == 30.0
    # p99 rank 0.99 * 30 = 29.7 lies in (1, 2] holding 10 of them (20 -> 30)
    assert f.ttft.quantiles["p99"] == pytest.approx(1.0 + (29.7 - 20.0) / 10.0)
    assert f.ttft.buckets["p99"] == (1.0, 2.0)
    assert math.isnan(f.tpot.mean)  # no TPOT series at all
    # a window starting with the load: the start is read at the last scrape before it
    assert figures_from_series(series, 10.0, 25.0, idle_before_start=True).failed == 2.0
    # a window ending inside a busy run: both edges interpolated between scrapes
    g = figures_from_series(series, 10.0, 25.0, drained_at_end=False)
    assert g.completed == 30.0  # idle from t = 20 on: still exact
    assert g.failed == pytest.approx(2.0 * 15 / 30)
    assert g.goodput == {"t": pytest.approx(15.0 * 15 / 20 / 15)}
    assert g.ttft.mean == pytest.approx((27.0 * 0.75) / (30.0 * 0.75))
    # p99 rank 0.99 * 22.5 = 22.275 lies in (1, 2] holding 7.5 of them (15 -> 22.5)
    assert g.ttft.quantiles["p99"] == pytest.approx(1.0 + (22.275 - 15.0) / 7.5)
    m = f.to_trial_metrics(cost_s=7.0)
    assert (m.throughput, m.completed, m.cost_s) == (2.0, 30, 7.0)
    assert f.engine_over_profile == {}  # no engine counters scraped: no figure, not a zero
    # each stage's engine time over its profile's over the window, summed over pods; prefill by stage
    stages = [
        _series("easerve_encode_batch_seconds_sum", {"pod": "e1"}, [(10.0, 0.0), (30.0, 3.0)]),
        _series("easerve_encode_batch_seconds_sum", {"pod": "e2"}, [(10.0, 0.0), (30.0, 1.0)]),
        _series("easerve_encode_profile_seconds_total", {"pod": "e1"}, [(10.0, 0.0), (30.0, 2.0)]),
        _series("easerve_encode_profile_seconds_total", {"pod": "e2"}, [(10.0, 0.0), (30.0, 2.0)]),
        _series("easerve_prefill_engine_seconds_total", {"stage": "prefill"}, [(10.0, 0.0), (30.0, 5.0)]),
        _series("easerve_prefill_profile_seconds_total", {"stage": "prefill"}, [(10.0, 0.0), (30.0, 10.0)]),
        _series("easerve_prefill_engine_seconds_total", {"stage": "local-prefill"}, [(10.0, 0.0), (30.0, 1.0)]),
        _series("easerve_prefill_profile_seconds_total", {"stage": "local-prefill"}, [(10.0, 0.0), (30.0, 0.0)]),
    ]
    h = figures_from_series(series + stages, 10.0, 25.0)
    assert h.engine_over_profile == {"encode": pytest.approx(1.0), "prefill": pytest.approx(0.5)}  # no profile time: none
    assert h.to_dict()["engine_over_profile"] == h.engine_over_profile
    with pytest.raises(ValueError, match="end > start"):
        figures_from_series(series, 5.0, 5.0)


def test_selector_string_escapes_and_rejects_bad_names():
    assert selector_string({"b": 'x"y', "a": "1"}) == 'a="1",b="x\\"y"'
    assert selector_string('{job="x"}') == 'job="x"'
    with pytest.raises(ValueError, match="label name"):
        selector_string({"bad-name": "x"})


# ----------------------------------------------------------------------------- retries


class FlakyClient:
    """A stand-in for PrometheusConnect: fails ``fails`` times with ``exc``, then answers."""

    def __init__(self, fails: int, exc: BaseException) -> None:
        self.fails, self.exc, self.calls = fails, exc, 0

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.calls += 1
        if self.calls <= self.fails:
            raise self.exc
        return [{"metric": {}, "value": [0, "1"]}]


def test_retries_back_off_then_succeed():
    slept: list[float] = []
    c = FlakyClient(3, requests.ConnectionError("refused"))
    p = PrometheusScorer("http://prom:9090", {}, client=c, sleep=slept.append, retries=5)
    assert p.query("up") == [{"metric": {}, "value": [0, "1"]}]
    assert slept == [0.5, 1.0, 2.0] and c.calls == 4


def test_unreachable_after_retries_names_the_url():
    slept: list[float] = []
    c = FlakyClient(99, requests.ConnectionError("refused"))
    p = PrometheusScorer("http://prom.example:9090/", {}, client=c, sleep=slept.append, retries=6)
    with pytest.raises(
        PrometheusUnreachable, match=r"Prometheus at http://prom.example:9090 unreachable"
    ) as e:
        p.query("up")
    assert e.value.url == "http://prom.example:9090" and e.value.attempts == 6 and c.calls == 6
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0]  # doubling, capped at max_backoff_s


def test_a_rejected_query_is_not_retried():
    from prometheus_api_client import PrometheusApiClientException

    c = FlakyClient(99, PrometheusApiClientException("HTTP Status Code 400 (b'bad_data')"))
    p = PrometheusScorer("http://prom:9090", {}, client=c, sleep=lambda s: None)
    with pytest.raises(PrometheusQueryError, match="rejected"):
        p.query("up{")
    assert c.calls == 1


def test_real_connection_refused_is_retried_and_named():
    """Through the real prometheus-api-client, against a port nobody listens on."""
    port = free_port()
    slept: list[float] = []
    p = PrometheusScorer(f"http://127.0.0.1:{port}", {"job": "x"}, sleep=slept.append, retries=3)
    with pytest.raises(PrometheusUnreachable, match=f"127.0.0.1:{port}.*3 attempts.*ConnectionError"):
        p.score(0.0, 1.0)
    assert slept == [0.5, 1.0]


# ----------------------------------------------------------------------------- real Prometheus


def _served(tmp: Path, speedup: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    env = {"EASERVE_SIM_SPEEDUP": speedup, "EASERVE_SIM_BYTES_SCALE": "0.01"}
    with serve_process(SPEC.read_text(), tmp, env, timeout_s=120) as (port, workdir):
        procs = json.loads((workdir / "processes.json").read_text())["processes"]
        yield f"http://127.0.0.1:{port}", procs


def _prometheus(tmp: Path, targets: list[str]) -> Iterator[str]:
    cfg = tmp / "prometheus.yml"
    tgt = ", ".join(f"'{t}'" for t in targets)
    cfg.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n- job_name: easerve\n"
        f"  static_configs:\n  - targets: [{tgt}]\n    labels: {{deployment: rt-test}}\n"
    )
    env = dict(os.environ, PROM_DIR=str(tmp / "prom"))
    up = subprocess.run(["bash", str(E2E / "prom-up.sh"), str(cfg)], env=env, capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stderr
        yield up.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run(["bash", str(E2E / "prom-down.sh")], env=env, capture_output=True, text=True)


def _bench(url: str, n: int, rate: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", url, "--spec", str(SPEC)]
    cmd += ["--rate", str(rate), "--requests", str(n), "--seed", "5", "--output-mean", "24"]
    cmd += ["--prompt-mean", "16", "--json"]
    out = subprocess.run(cmd, capture_output=True, timeout=600, check=False)
    assert out.stdout, out.stderr.decode()[-2000:]
    return dict(json.loads(out.stdout))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (e2e/setup-host.sh)")
def test_prometheus_figures_agree_with_the_bench_report(tmp_path: Path) -> None:
    work = tmp_path / "serve"
    work.mkdir()
    for url, procs in _served(work, speedup="4"):
        targets = [
            f"127.0.0.1:{p['http_port'] if p['stage'] == 'frontend' else p['system_port']}" for p in procs
        ]
        for prom in _prometheus(tmp_path, targets):
            scorer = PrometheusScorer(prom, {"deployment": "rt-test"})
            scorer.wait_scraped(time.time(), timeout_s=60)  # every target scraped once before load
            rep = _bench(url, 240, rate=6.0)
            assert rep["failed"] == 0 and rep["completed"] == 240, rep["errors"]
            f = scorer.score(rep["started_at"], rep["finished_at"], idle_before_start=True)
            # the frontend's /metrics directly, for the report
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                assert "easerve_requests_total" in r.read().decode()
        print(json.dumps({"bench": rep, "prometheus": f.to_dict()}, indent=1, default=str))
        # counts are exact (idle before the start, drained at the end) and the window is the
        # bench's own (started_at, finished_at): within 3 %, in fact to the request
        assert f.completed == pytest.approx(rep["completed"], rel=0.03)
        assert f.completed == rep["completed"] == f.ttft.count == f.tpot.count
        assert f.throughput == pytest.approx(rep["throughput"], rel=0.03)
        assert set(f.goodput) == set(rep["goodput"])
        # the engines' busy time against their profile: a sim engine at speed-up 4 sleeps a quarter
        # of the profile's time (a late return is paid back from the next sleep, so not less)
        assert set(f.engine_over_profile) >= {"encode"}, f.engine_over_profile
        assert all(v >= 0.95 / 4 for v in f.engine_over_profile.values()), f.engine_over_profile
        for tier, v in rep["goodput"].items():
            assert f.goodput[tier] == pytest.approx(v, rel=0.03)
        # percentiles: a histogram resolves a value to its bucket. TPOT's buckets are coarse (1.3-2x):
        # the bench's client-side percentile lies in the estimate's bucket or a neighbouring one.
        # TTFT's are 9 % apart (TTFT_BUCKETS): the client adds its own HTTP/SSE and event-loop delay
        # on a busy host (+77 ms on the mean here), so it may sit a few buckets higher; 4 buckets up
        # is a factor of 1.41. Lower by more than one bucket only at P99: histogram_quantile ranks at
        # q*n (here the 238th of 240 values' bucket), the bench at q*(n-1) between the 237th and the
        # 238th (numpy's rule), and with three slow requests on top of the rest those two values lie
        # buckets apart (CI: the bench's 0.334 s against Prometheus's 0.406 s). No bound holds
        # between two order statistics, so P99's lower side is not checked; P50's is.
        for name, bounds, up in (("ttft", TTFT_BUCKETS, 4), ("tpot", TPOT_BUCKETS, 1)):
            for q in ("p50", "p99"):
                est = getattr(f, name).quantiles[q]
                i = _bucket_index(est, bounds)
                j = _bucket_index(rep[name][q], bounds)
                assert j - i <= up, (name, q, est, rep[name][q])
                if q == "p50":
                    assert j - i >= -1, (name, q, est, rep[name][q])


def _bucket_index(v: float, bounds: tuple[float, ...]) -> int:
    return next((k for k, b in enumerate(bounds) if v <= b), len(bounds))
