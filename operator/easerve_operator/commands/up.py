"""`easerve up`: the whole system on one machine, with no GPU and no container runtime.

It starts a private local control plane (etcd, kube-apiserver, controller-manager, scheduler),
a test harness that plays kubelet for one fake GPU node, installs the CRD, runs the operator with
its admission webhook, applies an example, and waits until the operator reports it Ready. Then,
unless ``--no-serve``, it serves the same example with the sim engine (``easerve serve``) and
sends it a short multimodal load (``easerve bench``), so you see requests flow end to end.

It needs a source checkout (it drives the scripts in ``e2e/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HELP = "bring up a local control plane + operator, apply an example, wait for Ready, and serve it (sim engine)"
REPO = Path(__file__).resolve().parents[3]
DEFAULT_EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", default=str(DEFAULT_EXAMPLE), help="EPDDeployment to apply (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for Ready")
    parser.add_argument("--no-serve", action="store_true", help="skip the live sim-engine serving run")
    parser.add_argument("--requests", type=int, default=20, help="requests of the serving run")
    parser.add_argument("--rate", type=float, default=1.0, help="arrival rate of the serving run (req/s)")
    parser.add_argument("--keep-running", action="store_true", help="stay up until Ctrl-C (prints a KUBECONFIG)")


def _say(msg: str) -> None:
    print(f"[easerve up] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def run(args: argparse.Namespace) -> int:
    e2e = REPO / "e2e"
    if not (e2e / "local_cluster.py").exists():
        print("error: `easerve up` needs a source checkout (it uses e2e/local_cluster.py)", file=sys.stderr)
        return 2
    import yaml
    from easerve_runtime.api import load_manifest

    name, _spec = load_manifest(args.file)  # fail early, with field names, on a bad file
    sys.path.insert(0, str(e2e))
    from local_cluster import LocalCluster, start_harness

    t0 = time.monotonic()
    _say("starting the local control plane (first run builds Kubernetes from Debian's source: minutes)")
    cluster = LocalCluster.start(set_env=True)
    procs: list[subprocess.Popen[Any]] = []
    work = Path(cluster.run_dir)
    try:
        _say(f"control plane up in {time.monotonic() - t0:.1f}s; KUBECONFIG={cluster.kubeconfig}")
        start_harness(cluster)
        _say("kubelet harness (a test stand-in that marks scheduled pods Ready) registered node easerve-node-0")
        from easerve_operator.commands.crd import apply_crd

        apply_crd(cluster.kubeconfig)
        _say("CRD epddeployments.easerve.io established")
        health = _free_port()
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PYTHONUNBUFFERED": "1"}
        op_log = (work / "operator.log").open("wb")
        op = subprocess.Popen(
            [sys.executable, "-m", "easerve_operator.cli", "operator", "--webhook-port", str(_free_port()),
             "--metrics-port", str(_free_port()), "--health-port", str(health), "--bind", "127.0.0.1"],
            stdout=op_log, stderr=subprocess.STDOUT, env=env)
        procs.append(op)
        _wait_http(f"http://127.0.0.1:{health}/healthz", 60, op)
        _say(f"operator running (log: {work / 'operator.log'})")
        r = cluster.kubectl("apply", "-f", args.file)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        _say(r.stdout.strip())
        last = ""
        deadline = time.monotonic() + args.timeout
        while True:
            obj = json.loads(cluster.kubectl("get", "epd", name, "-o", "json").stdout or "{}")
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
            line = f"phase={st.get('phase')} ready={st.get('readySummary')} {ready.get('reason', '')}"
            if line != last:
                _say(line)
                last = line
            if ready.get("status") == "True" and st.get("observedGeneration") == obj["metadata"]["generation"]:
                break
            if time.monotonic() > deadline:
                _say(f"not Ready after {args.timeout}s")
                print(yaml.safe_dump(st), file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(cluster.kubectl("get", "epd,deployments,services,configmaps", "-l",
                              f"easerve.io/deployment={name}").stdout, flush=True)
        print(cluster.kubectl("get", "epd").stdout, flush=True)
        _say(f"{name} Ready {time.monotonic() - t0:.1f}s after start")
        if not args.no_serve:
            port = _free_port()
            srv = subprocess.Popen([sys.executable, "-m", "easerve_operator.cli", "serve", "-f", args.file,
                                    "--port", str(port)], env=env, start_new_session=True,
                                   stdout=(work / "serve.log").open("wb"), stderr=subprocess.STDOUT)
            procs.append(srv)
            _wait_http(f"http://127.0.0.1:{port}/health", 120, srv)
            _say(f"serving {name} with the sim engine at http://127.0.0.1:{port}/v1/chat/completions")
            bench = subprocess.run(
                [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", f"http://127.0.0.1:{port}",
                 "--rate", str(args.rate), "--requests", str(args.requests), "--seed", "0", "--spec", args.file,
                 "--json"], env=env, capture_output=True, text=True)
            if bench.returncode != 0:
                print(bench.stderr[-2000:], file=sys.stderr)
                return 1
            report = json.loads(bench.stdout)
            _say("load run: " + json.dumps({k: report.get(k) for k in
                                            ("completed", "failed", "throughput", "ttft", "tpot", "goodput")}))
        if args.keep_running:
            _say(f"up; export KUBECONFIG={cluster.kubeconfig}   (Ctrl-C to stop)")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    finally:
        cluster.kubectl("delete", "epd", "--all", "--wait=true", "--timeout=30s")
        for p in reversed(procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if p.pid == os.getpgid(p.pid):  # `easerve serve` leads its own group: stop it all
                        os.killpg(p.pid, signal.SIGTERM)
                    else:
                        p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        cluster.stop()
        _say("stopped")
