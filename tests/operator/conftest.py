"""Fixtures for the operator's integration tests: the real `easerve operator` as a process.

The operator runs exactly as users run it (`easerve operator ...`), against the session's local
control plane, with the validating webhook on a free loopback port. It is stopped with SIGTERM
after the tests' own objects are gone, so kopf removes its webhook configuration cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.workers.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
EASERVE = [sys.executable, "-m", "easerve_operator.cli"]
START_TIMEOUT_S = float(os.environ.get("EASERVE_OPERATOR_START_TIMEOUT", "240"))


class OperatorProcess:
    def __init__(self, kubeconfig: str, log_dir: Path, webhook: bool = True) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.webhook = webhook
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        args = [
            *EASERVE,
            "operator",
            "--metrics-port",
            str(self.metrics_port),
            "--health-port",
            str(self.health_port),
            "--bind",
            "127.0.0.1",
        ]
        if self.webhook:
            args += ["--webhook-port", str(free_port())]
        self.starts += 1
        self.log = self.log_dir / f"operator-{self.starts}.log"
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            args, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        # generous: on a machine shared by many jobs, importing kopf and the kubernetes client alone
        # has taken over a minute
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"operator exited early:\n{self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"operator not healthy after {START_TIMEOUT_S}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample from the operator's /metrics (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


@pytest.fixture(scope="module")
def operator(k8s: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    r = subprocess.run(
        [*EASERVE, "crd", "apply"],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": k8s.kubeconfig},
    )
    assert r.returncode == 0, r.stderr
    op = OperatorProcess(k8s.kubeconfig, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        # remove our objects while the operator still runs, then stop it cleanly (webhooks removed)
        k8s.kubectl("delete", "epd", "--all-namespaces", "--all", "--wait=true", "--timeout=60s")
        op.stop()
