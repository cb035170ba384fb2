"""A worker that cannot reach discovery says so and keeps trying; it never hangs silently.

One real worker process (``easerve worker --stage decode``), pointed at an etcd that is not there
yet: it logs the endpoint, answers its probes live-but-not-ready, and once an etcd appears on that
endpoint it registers and becomes ready, without a restart."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .conftest import REPO


def _port() -> int:
    """A free port below 32768 (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit integer)."""
    import random

    while True:
        p = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def test_worker_without_discovery_is_live_not_ready_and_recovers(tmp_path: Path) -> None:
    from easerve_operator.render.stages import runtime_config
    from easerve_runtime.api import load_manifest

    name, spec = load_manifest(str(REPO / "examples" / "llava-v1.6-34b.yaml"))
    cfg = tmp_path / "config.json"
    cfg.write_text(runtime_config(name, "default", spec).to_json())
    etcd_port, peer, sys_port = _port(), _port(), _port()
    endpoint = f"http://127.0.0.1:{etcd_port}"
    log = tmp_path / "worker.log"
    env = {**os.environ, "ETCD_ENDPOINTS": endpoint, "DYN_SYSTEM_PORT": str(sys_port),
           "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_TCP_RPC_HOST": "127.0.0.1", "POD_NAME": "t"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "easerve_operator.cli", "worker", "--stage", "decode", "--config", str(cfg)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    etcd = None
    try:
        health, live = f"http://127.0.0.1:{sys_port}/health", f"http://127.0.0.1:{sys_port}/live"
        _wait(lambda: f"discovery: etcd at {endpoint} is unreachable" in log.read_text(), 60, "the log names the endpoint")
        _wait(lambda: _get(health)[0] == 503, 30, "/health answers 503")
        code, body = _get(health)
        assert json.loads(body)["endpoints"] == [endpoint]
        assert _get(live)[0] == 200  # live: a restart would not help, so the liveness probe passes
        time.sleep(3)
        assert worker.poll() is None and log.read_text().count("is unreachable") >= 2  # still retrying
        etcd = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            _wait(lambda: _get(health)[0] == 200, 90, "ready once etcd is there")
        except AssertionError as e:
            raise AssertionError(f"{e}; {_get(health)}\n" + log.read_text()[-3000:]) from None
        assert worker.poll() is None
        assert "decode worker serving" in log.read_text()
    finally:
        for p in (worker, etcd):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
