"""`easerve up`: the whole system on one machine, with no GPU and no container runtime.

It starts a private local control plane (etcd, kube-apiserver, controller-manager, scheduler) and
the etcd that Dynamo's discovery uses, a test harness that plays kubelet for one fake GPU node and
runs every container of every pod as a local process (e2e/process_runner.py), a companion that
plays kube-proxy (e2e/kube_proxy.py: each Service reachable on a loopback address), installs the
CRD, runs the operator with its admission webhook, applies an example, and waits until the operator
reports it Ready and every pod's processes answer their readiness probes. Then, unless
``--no-serve``, it sends a short multimodal load (``easerve bench``) through the frontend Service of
the deployment the operator created, so you see requests flow end to end through the real pods.

With ``--json`` the last line printed is one JSON object: ``ready_s`` (seconds from start to
Ready), ``service_url`` (the frontend Service as reached through the kube-proxy stand-in), ``load``
(the ``easerve bench`` report: completed, failed, goodput per tier, ...), ``processes`` and the
resource use of the pods' processes during the load (``pods_cpu_s``, ``pods_rss_mb``).

With ``--tune`` the operator chooses the configuration itself, on the cluster (HAS, issue 13): a real
Prometheus (Debian's) scrapes the pods as the chart's PodMonitor does, the example is applied with
its searched fields left out (allocation, ``encode.batchBound``, ``offload.ratio``,
``smPartition.mode``) and ``spec.tuning: {enabled, trials: cluster}``, and the operator profiles each
stage in a Job, rolls out each trial, drives it with a load Job and scores it from Prometheus, then
deploys the best. Progress (phase, current trial, ETA) is printed as it moves; the JSON line gains
``tuning`` (state, nTrials, best, the time of each phase, and per trial where its metrics came from,
the load Job's own figures beside them, and the twin's prediction for it). The sim engine runs
``--sim-speedup`` times faster (2 by default with ``--tune``) with 1 % of the embedding bytes
materialised; every figure is mapped back to the model's time.

It needs a source checkout (it drives the scripts in ``e2e/``).
"""

from __future__ import annotations

import argparse
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

HELP = "bring up a local control plane + operator, apply an example, run its pods as processes, load it through its Service"
REPO = Path(__file__).resolve().parents[3]
DEFAULT_EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", default=str(DEFAULT_EXAMPLE), help="EPDDeployment to apply (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for Ready")
    parser.add_argument("--no-serve", action="store_true", help="skip the load run through the frontend Service")
    parser.add_argument("--requests", type=int, default=20, help="requests of the load run")
    parser.add_argument("--rate", type=float, default=1.0, help="arrival rate of the load run (req/s)")
    parser.add_argument("--sim-speedup", type=float, default=None,
                        help="divide the sim engine's latencies by this in the pods (spec.pod.env EASERVE_SIM_SPEEDUP)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line: ready_s, service_url, load, ...")
    parser.add_argument("--tune", action="store_true",
                        help="leave allocation, B, s and the SM split to HAS, run on this cluster (Prometheus-scored)")
    parser.add_argument("--tune-budget", type=int, default=6, help="with --tune: Stage-2 trials (default 6)")
    parser.add_argument("--tune-requests", type=int, default=100, help="with --tune: requests per trial (default 100)")
    parser.add_argument("--tune-rate", type=float, default=None,
                        help="with --tune: the target rate (default: the example's spec.tuning.targetRate, else 2)")
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


def _with_pod_env(path: str, env: dict[str, str]) -> str:
    """The manifest with ``spec.pod.env`` entries added (the sim speed-up reaches the pods this way)."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    if env:
        pod = doc["spec"].setdefault("pod", {})
        pod["env"] = [*(pod.get("env") or []), *({"name": k, "value": v} for k, v in env.items())]
    return str(yaml.safe_dump(doc))


SEARCHED = (("allocation",), ("encode", "batchBound"), ("offload",), ("smPartition", "mode"))


def _tuned_manifest(text: str, budget: int, requests: int, prometheus: str, rate: float | None = None) -> str:
    """The manifest with the fields HAS chooses left out and its search on the cluster."""
    import yaml

    doc = yaml.safe_load(text)
    sp = doc["spec"]
    for path in SEARCHED:
        parent = sp
        for key in path[:-1]:
            parent = parent.get(key) or {}
        parent.pop(path[-1], None)
    tuning = sp.setdefault("tuning", {})
    tuning.update({"enabled": True, "trials": "cluster", "trialBudget": budget, "requestsPerTrial": requests})
    tuning["targetRate"] = rate if rate is not None else tuning.get("targetRate") or 2.0
    sp.setdefault("observability", {})["prometheusUrl"] = prometheus
    return str(yaml.safe_dump(doc))


def _tuning_summary(tu: dict[str, Any], spec: Any, requests: int) -> dict[str, Any]:
    """``tuning`` of the JSON line: the result, and per trial its figures with the twin's beside them."""
    from easerve_operator.tuning.agreement import trial_agreement

    rate = float(tu.get("rate") or 2.0)
    trials = []
    for d in tu.get("trialsDetail") or []:
        t = {k: d.get(k) for k in ("trial", "candidate", "state", "metricsSource", "metrics", "cluster", "resumed")}
        if d.get("metricsSource") == "prometheus":
            a = trial_agreement(spec, d, rate, requests)
            t["twin"] = a["twin"]
            t["agreement"] = a["ratios"]
            t["engineOverProfile"] = (d.get("prometheusWholeRun") or {}).get("engineOverProfile")
        trials.append({k: v for k, v in t.items() if v is not None})
    best = tu.get("best") or {}
    return {
        "state": tu.get("state"),
        "phase": tu.get("phase"),
        "nTrials": tu.get("nTrials"),
        "stopReason": tu.get("stopReason"),
        "stage1Sources": tu.get("stage1Sources"),
        "prometheusUrl": tu.get("prometheusUrl"),
        "best": {k: best.get(k) for k in ("allocation", "batchBound", "offloadRatio", "trial", "value", "metrics")},
        "trials": trials,
    }


def _proc_usage(pids: list[int]) -> tuple[float, float]:
    """CPU seconds (user+system) and resident memory (MB) of these processes, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = rss = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) / 1024
        except (OSError, IndexError, ValueError):
            continue
    return cpu, rss


def run(args: argparse.Namespace) -> int:
    e2e = REPO / "e2e"
    if not (e2e / "local_cluster.py").exists():
        print("error: `easerve up` needs a source checkout (it uses e2e/local_cluster.py)", file=sys.stderr)
        return 2
    import yaml
    from easerve_runtime.api import load_manifest

    name, _spec = load_manifest(args.file)  # fail early, with field names, on a bad file
    speedup = args.sim_speedup if args.sim_speedup is not None else (2.0 if args.tune else 1.0)
    timeout = args.timeout + (1500.0 if args.tune else 0.0)
    sys.path.insert(0, str(e2e))
    from local_cluster import LocalCluster, start_harness

    from easerve_operator.render.stages import stage_name

    result: dict[str, Any] = {"example": args.file, "name": name}
    # SIGTERM (a `kill`, a CI step's timeout) must run the clean-up below like Ctrl-C does: by
    # default it ends the process at once, leaving the operator and the pods' processes running
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(128 + signal.SIGTERM))
    t0 = time.monotonic()
    _say("starting the local control plane (first run builds Kubernetes from Debian's source: minutes)")
    cluster = LocalCluster.start(set_env=True, discovery_etcd=True)
    procs: list[subprocess.Popen[Any]] = []
    work = Path(cluster.run_dir)
    try:
        _say(f"control plane up in {time.monotonic() - t0:.1f}s; KUBECONFIG={cluster.kubeconfig}")
        _say(f"discovery etcd for Dynamo at {cluster.discovery_etcd_url}")
        start_harness(cluster, processes=True, root=str(work / "pods"), readiness_period_s=1.0)
        _say("kubelet harness (a test stand-in for kubelet: runs each container as a local process) "
             f"registered node easerve-node-0; pod logs under {work / 'pods'}")
        _say("kube-proxy stand-in up (each Service on a loopback address, forwarding to ready pods)")
        from easerve_operator.commands.crd import apply_crd

        apply_crd(cluster.kubeconfig)
        _say("CRD epddeployments.easerve.io established")
        health = _free_port()
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PYTHONUNBUFFERED": "1",
               "EASERVE_STATE_DIR": str(work / "operator-state")}
        prometheus = None
        if args.tune:
            prometheus = cluster.start_prometheus()
            _say(f"Prometheus (Debian's) at {prometheus}, scraping the pods as the chart's PodMonitor does")
        op_log = (work / "operator.log").open("wb")
        op = subprocess.Popen(
            [sys.executable, "-m", "easerve_operator.cli", "operator", "--webhook-port", str(_free_port()),
             "--metrics-port", str(_free_port()), "--health-port", str(health), "--bind", "127.0.0.1",
             "--discovery-etcd-endpoints", str(cluster.discovery_etcd_url),
             *(["--prometheus-url", prometheus] if prometheus else [])],
            stdout=op_log, stderr=subprocess.STDOUT, env=env)
        procs.append(op)
        _wait_http(f"http://127.0.0.1:{health}/healthz", 60, op)
        _say(f"operator and admission webhook running (log: {work / 'operator.log'})")
        pod_env = {"EASERVE_SIM_SPEEDUP": str(speedup)} if speedup != 1.0 else {}
        if args.tune:
            pod_env["EASERVE_SIM_BYTES_SCALE"] = "0.01"  # 1 % of the embedding bytes: trials on 2 cores
        manifest = _with_pod_env(args.file, pod_env)
        if args.tune:
            assert prometheus is not None
            manifest = _tuned_manifest(manifest, args.tune_budget, args.tune_requests, prometheus, args.tune_rate)
            _say(f"HAS on the cluster: {args.tune_budget} trials of {args.tune_requests} requests, sim engine x{speedup:g}")
        r = cluster.kubectl("apply", "-f", "-", input=manifest)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        _say(r.stdout.strip())
        last = ""
        deadline = time.monotonic() + timeout
        phase_t: dict[str, float] = {}
        while True:
            obj = json.loads(cluster.kubectl("get", "epd", name, "-o", "json").stdout or "{}")
            st = obj.get("status") or {}
            tu = st.get("tuning") or {}
            if args.tune and tu.get("phase") and tu["phase"] not in phase_t:
                phase_t[tu["phase"]] = time.monotonic() - t0
            if args.tune and tu.get("state") == "Failed":
                _say(f"the search failed: {tu.get('message')}")
                return 1
            ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
            pods = json.loads(cluster.kubectl("get", "pods", "-l", f"easerve.io/deployment={name}", "-o",
                                              "json").stdout or '{"items": []}')["items"]
            n_ready = sum(any(c["type"] == "Ready" and c["status"] == "True"
                              for c in (p.get("status") or {}).get("conditions") or []) for p in pods)
            line = (f"phase={st.get('phase')} ready={st.get('readySummary')} {ready.get('reason', '')} "
                    f"pods ready {n_ready}/{len(pods)}, processes {len(cluster.harness.runner.pids())}")
            if args.tune:
                eta = tu.get("etaSeconds")
                line += (f" | HAS {tu.get('phase')} trials {tu.get('trials')}/{tu.get('budget')}"
                         + (f", now {tu['currentTrial']}" if tu.get("currentTrial") else "")
                         + (f", ETA <= {eta:.0f}s" if eta is not None else ""))
            if line != last:
                _say(line)
                last = line
            if (ready.get("status") == "True" and st.get("observedGeneration") == obj["metadata"]["generation"]
                    and pods and n_ready == len(pods) and (not args.tune or tu.get("phase") == "Ready")):
                break
            if time.monotonic() > deadline:
                _say(f"not Ready after {timeout:g}s")
                print(yaml.safe_dump(st), file=sys.stderr)
                return 1
            time.sleep(0.5)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        if args.tune:
            result["tuning"] = _tuning_summary(tu, load_manifest(args.file)[1], args.tune_requests)
            result["tuning"]["phase_started_s"] = {k: round(v, 1) for k, v in phase_t.items()}
            result["tuning"]["sim_speedup"] = speedup
            b = result["tuning"]["best"]
            _say(f"HAS chose {b['allocation']} B={b['batchBound']} s={b['offloadRatio']} "
                 f"in {tu.get('nTrials')} cluster trials (scored from Prometheus); deployed and Ready")
        print(cluster.kubectl("get", "epd,deployments,services,configmaps", "-l",
                              f"easerve.io/deployment={name}").stdout, flush=True)
        print(cluster.kubectl("get", "pods", "-o", "wide").stdout, flush=True)
        pids = cluster.harness.runner.pids()
        result["processes"] = len(pids)
        _say(f"{name} Ready {result['ready_s']}s after start: {len(pids)} container processes running")
        url = cluster.proxy.url("default", stage_name(name, "encode"), 8000)
        result["service_url"] = url
        if not args.no_serve:
            _say(f"sending {args.requests} requests at {args.rate}/s through the frontend Service {url}")
            cpu0, _ = _proc_usage(list(pids.values()))
            t_load = time.monotonic()
            bench = subprocess.run(
                [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", url,
                 "--rate", str(args.rate), "--requests", str(args.requests), "--seed", "0", "--spec", args.file,
                 "--json"], env=env, capture_output=True, text=True)
            wall = time.monotonic() - t_load
            cpu1, rss = _proc_usage(list(cluster.harness.runner.pids().values()))
            if bench.returncode != 0:
                print(bench.stderr[-2000:], file=sys.stderr)
                return 1
            report = json.loads(bench.stdout)
            result["load"] = report
            result["pods_cpu_s"] = round(cpu1 - cpu0, 1)
            result["pods_cpu_cores"] = round((cpu1 - cpu0) / wall, 2) if wall > 0 else None
            result["pods_rss_mb"] = round(rss, 1)
            _say("load run: " + json.dumps({k: report.get(k) for k in
                                            ("completed", "failed", "throughput", "ttft", "tpot", "goodput")}))
            _say(f"pods' processes during the load: {result['pods_cpu_s']} CPU-s "
                 f"({result['pods_cpu_cores']} cores), {result['pods_rss_mb']} MB resident")
        if args.keep_running:
            _say(f"up; export KUBECONFIG={cluster.kubeconfig}; frontend Service at {url}   (Ctrl-C to stop)")
            while True:  # SIGINT raises KeyboardInterrupt, SIGTERM SystemExit (below): cleaned up either way
                signal.pause()
        return 0
    finally:
        cluster.kubectl("delete", "epd", "--all", "--wait=true", "--timeout=60s")
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        cluster.stop()
        _say("stopped")
        if args.json:
            print(json.dumps(result), flush=True)
