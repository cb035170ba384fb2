"""e2e/prom-up.sh and prom-down.sh run Debian's prometheus on loopback with a given config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

E2E = Path(__file__).resolve().parents[2] / "e2e"


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (e2e/setup-host.sh)")
def test_prometheus_up_scrapes_and_down_stops(tmp_path: Path) -> None:
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n- job_name: self-test\n"
        "  static_configs:\n  - targets: ['127.0.0.1:1']\n"
    )
    env = dict(os.environ, PROM_DIR=str(tmp_path / "prom"))
    up = subprocess.run(["bash", str(E2E / "prom-up.sh"), str(cfg)], env=env, capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stderr
        url = up.stdout.strip().splitlines()[-1]
        assert url.startswith("http://127.0.0.1:")
        pid = int((tmp_path / "prom" / "prometheus.pid").read_text())
        targets: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while not targets and time.monotonic() < deadline:  # service discovery syncs after start
            with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=5) as r:
                targets = json.load(r)["data"]["activeTargets"]
            time.sleep(0.2)
        assert [t["labels"]["job"] for t in targets] == ["self-test"]
    finally:
        down = subprocess.run(["bash", str(E2E / "prom-down.sh")], env=env, capture_output=True, text=True)
    assert down.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tmp_path / "prom" / "data").exists()
