"""Every rendered container of every example starts, as its pod would run it, on a CPU machine.

For each example the test renders the children (``render_children``, what the operator applies),
materialises the ConfigMap's ``config.json`` in a temp dir, and runs one replica of every pod of
the example at once: each container's ``args`` through the real ``easerve`` CLI, with the
container's ``env`` (downward-API fields filled in as the kubelet would). Only what a node gives a
pod differs: the config path, file discovery instead of etcd, a private /dev/shm directory per
pod, and a free host port for each container port (the pod's containers share a network
namespace; here every process shares the host's).

A container with a probe must answer its readiness (/health) and liveness (/live) paths; one
without (the partition controller) must stay alive in its control loop and publish its GPU's
control record. This is the test that catches a container rendered with args it cannot run
(the omni partition controller once exited with status 2 for want of ``--ladder``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from easerve_operator.render import render_children
from easerve_runtime.api import CONFIG_PATH, load_manifest
from easerve_runtime.partition.record import control_path
from easerve_runtime.workers.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
READY_TIMEOUT_S = 120.0
IDLE_S = 3.0
pytestmark = pytest.mark.slow


@dataclass
class Running:
    pod: str
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    probe: dict[str, int] = field(default_factory=dict)  # path -> host port
    control_record: Path | None = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1.0) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, ValueError):
        return 0


def _env(container: dict[str, Any], pod_name: str, namespace: str) -> dict[str, str]:
    """The container's env as the kubelet resolves it (downward API: the pod's name/namespace/uid)."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace, "metadata.uid": f"uid-{pod_name}"}
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = e["value"]
    return out


def _start_pod(dep: dict[str, Any], config: Path, work: Path) -> list[Running]:
    """One replica of ``dep``'s pod: every container with its own free ports, a shared shm dir."""
    pod_name = f"{dep['metadata']['name']}-0"
    namespace = dep["metadata"]["namespace"]
    shm = work / pod_name / "shm"
    shm.mkdir(parents=True)
    out: list[Running] = []
    for c in dep["spec"]["template"]["spec"]["containers"]:
        ports = {p["name"]: (p["containerPort"], free_port()) for p in c.get("ports", [])}
        env = dict(os.environ)
        env.update(_env(c, pod_name, namespace))
        env.update(
            {
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(work / "kv"),
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                "EASERVE_PARTITION_SHM": str(shm),
                "PYTHONUNBUFFERED": "1",
            }
        )
        remap = {str(inside): str(host) for inside, host in ports.values()}
        if "DYN_SYSTEM_PORT" in env:  # each process's system server on its own host port
            env["DYN_SYSTEM_PORT"] = remap.get(env["DYN_SYSTEM_PORT"], str(free_port()))
        args = [str(config) if a == CONFIG_PATH else a for a in c["args"]]
        assert args[0] == "easerve", c["args"]
        cmd = [sys.executable, "-m", "easerve_operator.cli", *args[1:]]
        if "http" in ports:  # the HTTP server's port is a flag, not an env variable
            cmd += ["--port", str(ports["http"][1])]
        record = None
        if args[1] == "partition-controller":
            cmd += ["--shm-dir", str(shm)]
            record = control_path(int(args[args.index("--gpu") + 1]), shm)
        probe: dict[str, int] = {}
        for kind in ("readinessProbe", "livenessProbe"):
            if kind in c:
                get = c[kind]["httpGet"]
                probe[get["path"]] = ports[get["port"]][1]
        log = work / f"{pod_name}-{c['name']}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        out.append(Running(pod_name, c["name"], proc, log, probe, record))
    return out


def _stop(running: list[Running]) -> None:
    for r in running:
        if r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for r in running:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait(5)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_container_starts_as_its_pod_runs_it(path: Path, tmp_path: Path) -> None:
    name, spec = load_manifest(path)
    objs = render_children(name, "serving", "uid-1", spec)
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    config = json.loads(cm["data"]["config.json"])
    config["spec"]["discovery"] = {"backend": "file"}  # no etcd on a CPU test machine
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(config))
    running: list[Running] = []
    try:
        for dep in (o for o in objs if o["kind"] == "Deployment"):
            running += _start_pod(dep, cfg_path, tmp_path)
        assert running
        waiting = [r for r in running if r.probe]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            for r in running:
                rc = r.proc.poll()
                assert rc is None, f"{r.pod}/{r.name} exited with {rc}:\n{r.tail()}"
            waiting = [r for r in waiting if any(_get(port, p) != 200 for p, port in r.probe.items())]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(f"{r.pod}/{r.name}" for r in waiting)
                pytest.fail(f"not healthy after {READY_TIMEOUT_S:.0f}s: {names}\n{waiting[0].tail()}")
            time.sleep(0.3)
        time.sleep(IDLE_S)  # the containers without a probe must still be in their loop
        for r in running:
            rc = r.proc.poll()
            assert rc is None, f"{r.pod}/{r.name} exited with {rc}:\n{r.tail()}"
            if r.probe:
                assert all(_get(port, p) == 200 for p, port in r.probe.items()), f"{r.pod}/{r.name}"
            else:
                assert r.control_record is not None, f"{r.pod}/{r.name}: no probe and no known idle loop"
                assert r.control_record.exists(), f"{r.pod}/{r.name} published no control record\n{r.tail()}"
    finally:
        _stop(running)
