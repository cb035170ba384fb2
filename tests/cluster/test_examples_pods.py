"""Every other example runs as the operator renders it: all containers start as processes, become
Ready from their own probes, and serve through the frontend Service (LLaVA has its own module)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from .conftest import REPO, SIM_SPEEDUP, PodsCluster, harness_processes, send_load


def _gone(c: PodsCluster, ns: str, name: str) -> None:
    r = c.kubectl("delete", "epd", name, "-n", ns, "--wait=true", "--timeout=120s")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (c.pods(ns) or c.runner.pids(ns)):
        time.sleep(0.5)
    assert not c.runner.pids(ns) and not harness_processes(c.runner.ips.octet, ns)


def _all_running(c: PodsCluster, ns: str, name: str) -> None:
    pods = c.pods(ns, name)
    pids = c.runner.pids(ns)
    assert len(pids) == sum(len(p["spec"]["containers"]) for p in pods)
    for p in pods:
        assert all(cs["ready"] and cs["restartCount"] == 0 for cs in p["status"]["containerStatuses"]), p["status"]


@pytest.mark.parametrize("example", ["qwen2.5-vl-32b", "ultravox-v0.6-27b"])
def test_disaggregated_example_runs_and_serves(pods_cluster: PodsCluster, example: str) -> None:
    c = pods_cluster
    path = REPO / "examples" / f"{example}.yaml"
    ns = c.namespace()
    name = c.apply_example(path, ns, EASERVE_SIM_SPEEDUP=SIM_SPEEDUP)
    c.wait_ready(ns, name)
    _all_running(c, ns, name)
    out = send_load(c.frontend_url(ns, name), path, n=6, rate=1.0, seed=7)
    errors = [o.record.error for o in out if not o.record.ok]
    assert not errors, Counter(e[:120] for e in errors)
    assert all(o.record.output_tokens == o.expected_tokens for o in out)
    _gone(c, ns, name)


def test_omni_example_runs_and_serves(pods_cluster: PodsCluster) -> None:
    from easerve_runtime.api import Stage

    STAGE = str(Stage.OMNI)  # the omni pod's stage label and Service suffix (topology)

    c = pods_cluster
    path = REPO / "examples" / "qwen2.5-omni.yaml"
    ns = c.namespace()
    name = c.apply_example(path, ns, EASERVE_SIM_SPEEDUP=SIM_SPEEDUP)
    c.wait_ready(ns, name)
    _all_running(c, ns, name)  # omni-shared, omni-downstream and the partition controller (it used to exit 2)
    url = c.frontend_url(ns, name, stage=STAGE)  # once the Service routes to the Ready pod

    def post(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return dict(json.loads(r.read()))

    bodies: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": "hi"}], "priority": 0, "max_tokens": 8}] * 4
    bodies += [{"messages": [{"role": "user", "content": "say it"}], "modalities": ["text", "audio"],
                "easerve": {"output_tokens": 10, "total_steps": 45}}] * 2
    with ThreadPoolExecutor(6) as ex:
        replies = list(ex.map(post, bodies))
    assert Counter(r["easerve"]["class"] for r in replies) == {"text": 4, "audio": 2}
    assert all(r["choices"][0]["finish_reason"] == "stop" for r in replies)
    _gone(c, ns, name)
