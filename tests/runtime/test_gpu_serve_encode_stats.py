"""``gpu_serve.py`` records the encode stage of each point from the encode workers' own
``/metrics`` (micro-batches, their size, engine time against the profile, the batcher's wait):
run 16 found a P99 TTFT the twin missed that the points had no figure to place. Real processes:
``easerve serve`` of the LLaVA example (sim engine) and ``easerve bench`` against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_serve  # noqa: E402
from easerve_runtime.workers.launcher import free_port  # noqa: E402

EASERVE = str(Path(sys.executable).with_name("easerve"))
SPEC = REPO / "examples" / "llava-v1.6-34b.yaml"


def test_a_point_carries_its_encode_batches_from_the_workers_metrics(tmp_path: Path) -> None:
    assert gpu_serve.worker_metrics(tmp_path) == {}  # nothing serves here: no figures, no error
    port = free_port()
    srv = subprocess.Popen([EASERVE, "serve", "-f", str(SPEC), "--port", str(port), "--workdir", str(tmp_path / "wd")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert srv.poll() is None and time.monotonic() < deadline, "easerve serve did not come up"
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        before = gpu_serve.worker_metrics(tmp_path)
        assert before.get("batches") == 0.0  # both encode replicas answered, nothing encoded yet
        r = subprocess.run([EASERVE, "bench", "--url", url, "--rate", "4", "--requests", "12", "--seed", "3",
                            "--spec", str(SPEC), "--json"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        enc = gpu_serve.encode_breakdown(before, gpu_serve.worker_metrics(tmp_path))
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(60)
    # every request was encoded once, in micro-batches of at most the spec's bound (8)
    assert enc["requests"] == 12 and 1 <= enc["batches"] <= 12
    assert 1.0 <= enc["requests_per_batch"] <= 8.0
    assert sum(enc["dispatch"].values()) == enc["batches"]
    assert enc["engine_ms_per_batch"] > 0 and enc["profile_ms_per_batch"] > 0
    assert abs(enc["engine_over_profile"] - enc["engine_ms_per_batch"] / enc["profile_ms_per_batch"]) < 0.01
    assert enc["queue_wait_ms_mean"] >= 0
