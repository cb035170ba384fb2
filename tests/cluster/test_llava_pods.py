"""The LLaVA example as the operator renders it, every container a process: the must-hold path.

One deployment for the whole module (starting ~11 processes costs ~20 s of CPU on 2 cores), driven
through its frontend Service; the tests run in file order and each leaves it Ready for the next.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, SIM_SPEEDUP, PodsCluster, send_load

EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


@pytest.fixture(scope="module")
def llava(pods_cluster: PodsCluster) -> tuple[str, str]:
    ns = pods_cluster.namespace("llava")
    name = pods_cluster.apply_example(EXAMPLE, ns, EASERVE_SIM_SPEEDUP=SIM_SPEEDUP)
    pods_cluster.wait_ready(ns, name)
    return ns, name


def _ok(outcomes: list[Any]) -> list[Any]:
    return [o for o in outcomes if o.record.ok]


def test_apply_runs_every_container_as_a_process_and_serves_through_the_service(
    pods_cluster: PodsCluster, llava: tuple[str, str]
) -> None:
    ns, name = llava
    pods = pods_cluster.pods(ns, name)
    containers = sum(len(p["spec"]["containers"]) for p in pods)
    pids = pods_cluster.runner.pids(ns)
    assert len(pids) == containers  # every container of every pod is a live process
    for p in pods:
        st = p["status"]
        assert st["phase"] == "Running"
        assert st["podIP"].startswith("127.")
        assert all(cs["ready"] and "running" in cs["state"] for cs in st["containerStatuses"])
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == len(pods)  # one loopback address per pod
    url = pods_cluster.frontend_url(ns, name)
    out = send_load(url, EXAMPLE, n=100, rate=8.0)
    bad = [o.record.error for o in out if not o.record.ok]
    assert not bad, bad[:5]
    assert all(o.record.output_tokens == o.expected_tokens for o in out)
