"""End to end on the CPU: serve the omni example (sim engine), mixed traffic, per-class metrics,
then calibrate the SLO table against the running server and reload it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from easerve_runtime.policies.omni import SLOTable
from serve_process import serve_process

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "qwen2.5-omni.yaml"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:  # type: ignore[type-arg]
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _start(*extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "easerve_runtime.workers.omni",
        "-f",
        str(EXAMPLE),
        "--host",
        "127.0.0.1",
        "--time-scale",
        "0.25",
        *extra,
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server; not a pipe that can fill)
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(log.read().decode(errors="replace"))
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("omni server did not become healthy")


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    proc, url = _start()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not exported")


def test_serve_mixed_traffic_reports_per_class_metrics(server: str) -> None:
    bodies = [{"messages": [{"role": "user", "content": "hello"}], "priority": 0, "max_tokens": 8}] * 8
    bodies += [
        {
            "messages": [{"role": "user", "content": "say it"}],
            "modalities": ["text", "audio"],
            "easerve": {"output_tokens": 10, "total_steps": 45},
        }
    ] * 4
    with ThreadPoolExecutor(12) as ex:
        replies = list(ex.map(lambda b: _post(server, b), bodies))
    classes = [r["easerve"]["class"] for r in replies]
    assert classes.count("text") == 8 and classes.count("audio") == 4
    for r in replies:
        assert r["easerve"]["first_response_s"] > 0 and r["easerve"]["slo_s"] > 0
    # audio's first output needs the thinker hand-off plus 40 talker steps: slower than text
    t_lat = max(r["easerve"]["first_response_s"] for r in replies if r["easerve"]["class"] == "text")
    a_lat = min(r["easerve"]["first_response_s"] for r in replies if r["easerve"]["class"] == "audio")
    assert a_lat > t_lat
    m = urllib.request.urlopen(server + "/metrics", timeout=5).read().decode()
    assert _metric(m, "easerve_omni_first_response_seconds_count", cls="text") == 8
    assert _metric(m, "easerve_omni_first_response_seconds_count", cls="audio") == 4
    for cls in ("text", "audio"):
        assert 0.0 <= _metric(m, "easerve_omni_slo_attainment", cls=cls) <= 1.0
    assert _metric(m, "easerve_omni_sm_cap") in (40, 56, 72, 132)
    assert 2 <= _metric(m, "easerve_omni_rotation_n") <= 8
    assert _metric(m, "easerve_omni_hidden_per_step_count") > 0
    assert "easerve_omni_bandwidth_ewma" in m
    # bad input is rejected, naming the field
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(server, {"priority": 5})
    assert "priority" in json.loads(err.value.read())["error"]["message"]


def test_calibrate_slo_writes_table_the_server_loads(server: str, tmp_path: Path) -> None:
    out = tmp_path / "slo.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "easerve_operator.cli",
            "calibrate-slo",
            "--url",
            server,
            "-f",
            str(EXAMPLE),
            "--requests",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "invalid choice" in r.stderr:
        pytest.skip("calibrate-slo not registered in this installation")
    assert r.returncode == 0, r.stderr
    table = SLOTable.from_json(out.read_text())
    assert set(table.solo_p95_s) == {"text", "audio"}
    assert table.solo_p95_s["audio"] > table.solo_p95_s["text"] > 0
    assert table.seconds("audio") == pytest.approx(5 * table.solo_p95_s["audio"])
    proc, url = _start("--slo-table", str(out))
    try:
        served = json.loads(urllib.request.urlopen(url + "/v1/omni/slo", timeout=5).read())
        assert served["sloSeconds"] == pytest.approx(table.as_dict())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_easerve_serve_command_runs_the_omni_example(tmp_path: Path) -> None:
    """The real `easerve serve -f examples/qwen2.5-omni.yaml` path (real time, no time scaling)."""
    with serve_process(EXAMPLE.read_text(), tmp_path, {"PYTHONUNBUFFERED": "1"}, timeout_s=60) as (port, _wd):
        url = f"http://127.0.0.1:{port}"
        bodies = [{"messages": "hi", "priority": 0, "max_tokens": 4}] * 3
        bodies += [{"messages": "hi", "priority": 10, "easerve": {"output_tokens": 4, "total_steps": 40}}] * 2
        with ThreadPoolExecutor(5) as ex:
            replies = list(ex.map(lambda b: _post(url, b), bodies))
        assert sorted(r["easerve"]["class"] for r in replies) == ["audio", "audio", "text", "text", "text"]
        m = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        assert _metric(m, "easerve_omni_first_response_seconds_count", cls="text") == 3
        assert _metric(m, "easerve_omni_first_response_seconds_count", cls="audio") == 2
        for cls in ("text", "audio"):
            assert 0.0 <= _metric(m, "easerve_omni_slo_attainment", cls=cls) <= 1.0
