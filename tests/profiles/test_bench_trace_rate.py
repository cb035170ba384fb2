"""`easerve bench --trace` reports the trace's offered rate, not the `--rate` default (issue 15)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from easerve_runtime.cli.bench import trace_rate
from easerve_runtime.workload import generate_for, write_trace


def test_trace_rate_is_arrivals_over_span() -> None:
    assert trace_rate([0.0, 0.5, 1.0, 2.0]) == pytest.approx(1.5)
    assert trace_rate([3.0]) is None and trace_rate([1.0, 1.0]) is None


def test_bench_trace_reports_the_traces_rate(tmp_path: Path) -> None:
    reqs = generate_for("image", 40.0, 12, seed=7)
    want = (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)
    trace = tmp_path / "t.jsonl"
    write_trace(str(trace), reqs)
    # nothing listens on port 9: every request fails fast, and the report is still written
    cmd = [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", "http://127.0.0.1:9",
           "--trace", str(trace), "--model", "m", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr  # failed requests
    rep = json.loads(out.stdout)
    assert rep["requests"] == 12 and rep["failed"] == 12
    assert rep["rate"] == pytest.approx(want) and rep["rate"] != 2.0  # 2.0 is the --rate default
    assert rep["arrival"] == "trace" and rep["seed"] is None and rep["trace"] == str(trace)
