"""Operator scale: create N EPDDeployments at once and time how long until every one has its
7 children and a written status; report the operator's peak RSS.

Two operators run in the same benchmark, one after the other, on fresh private control planes:

* ``easerve``: the real `easerve operator` (indexes, server-side apply, status, drift repair),
  with its default (no worker limit); ``easerve-limited`` runs it with ``--worker-limit 48``;
* ``bare-kopf``: a minimal kopf operator that creates the same 7 rendered children per object
  with plain creates and writes one status field — the floor a kopf operator can reach here;
* ``bare-kopf+ssa``, ``+status``, ``+watch`` (combinable): the floor plus one thing easerve does
  (server-side apply, a separate status patch, watching the children with an index and an event
  handler), to attribute the gap.

What is timed is what the operator writes itself (children + status). By default only etcd and
the API server run beside the operator (no controller-manager, no scheduler), so the figure is
the operator's own; ``--with-kcm`` adds the controller-manager, whose ReplicaSets and Pods then
compete for the same 2 cores (its objects are not waited for). Output: JSON on stdout, a PNG of completions over time.

    python benchmarks/operator_scale.py [--count 200] [--repeat 3] [--operators easerve,bare-kopf]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOG_DIR: Path | None = None
sys.path.insert(0, str(REPO / "e2e"))

BARE_OPERATOR = '''
import kopf, json, os, sys
sys.path.insert(0, os.environ["REPO"] + "/operator"); sys.path.insert(0, os.environ["REPO"] + "/runtime")
from kubernetes import client, config
from easerve_runtime.api import parse_spec
from easerve_operator.render import render_children
config.load_kube_config()
api = client.ApiClient()
core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
custom = client.CustomObjectsApi(api)
ADD = set(filter(None, os.environ.get("BARE_ADD", "").split(",")))  # attribution variants

@kopf.on.startup()
def cfg(settings, **_):
    settings.posting.level = 40
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage()
    settings.persistence.progress_storage = kopf.StatusProgressStorage()

KINDS = {"Deployment": apps.patch_namespaced_deployment, "Service": core.patch_namespaced_service,
         "ConfigMap": core.patch_namespaced_config_map}

@kopf.on.create("easerve.io", "v1alpha1", "epddeployments")
def create(spec, name, namespace, uid, patch, **_):
    for o in render_children(name, namespace, uid, parse_spec(dict(spec))):
        if "ssa" in ADD:  # server-side apply instead of create
            KINDS[o["kind"]](o["metadata"]["name"], namespace, o, field_manager="bare", force=True,
                             _content_type="application/apply-patch+yaml", _preload_content=False)
        elif o["kind"] == "Deployment":
            apps.create_namespaced_deployment(namespace, o, _preload_content=False)
        elif o["kind"] == "Service":
            core.create_namespaced_service(namespace, o, _preload_content=False)
        else:
            core.create_namespaced_config_map(namespace, o, _preload_content=False)
    if "status" in ADD:  # a separate status patch, as large as easerve's
        st = {"observedGeneration": 1, "phase": "Progressing", "readySummary": "0/2,0/1,0/2",
              "conditions": [{"type": t, "status": "False", "reason": "PodsNotReady", "message": "x" * 60,
                              "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"}
                             for t in ("Ready", "Progressing", "Degraded", "Reconciling", "Stalled")]}
        custom.patch_namespaced_custom_object_status("easerve.io", "v1alpha1", namespace, "epddeployments", name,
                                                     {"status": st}, _content_type="application/merge-patch+json")
    else:
        patch.status["observedGeneration"] = 1

if "watch" in ADD:  # watch the children like easerve does: an index and an event handler per kind
    MANAGED = {"app.kubernetes.io/managed-by": "easerve-operator"}
    for g, v, p in (("", "v1", "configmaps"), ("", "v1", "services"), ("apps", "v1", "deployments")):
        kopf.index(g, v, p, labels=MANAGED, id="idx_" + p)(
            lambda name, namespace, labels, **_: {(namespace, labels.get("easerve.io/deployment")): name})
        kopf.on.event(g, v, p, labels=MANAGED, id="ev_" + p)(lambda **_: None)
'''

def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_one(kind: str, count: int, timeout: float, with_kcm: bool) -> dict[str, Any]:
    from local_cluster import LocalCluster

    env_cp = {"WITH_SCHEDULER": "0", "WITH_KCM": "1" if with_kcm else "0"}
    cluster = LocalCluster.start(etcd_ram=True, set_env=True, extra_env=env_cp)
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PYTHONUNBUFFERED": "1", "REPO": str(REPO)}
    log = Path(cluster.run_dir) / f"{kind}.log"
    op: subprocess.Popen[bytes] | None = None
    if "+arena2" in kind:  # glibc malloc arenas capped at 2 (threads otherwise each grow their own)
        env["MALLOC_ARENA_MAX"] = "2"
        kind_base = kind.replace("+arena2", "")
    else:
        kind_base = kind
    try:
        subprocess.run([sys.executable, "-m", "easerve_operator.cli", "crd", "apply"], env=env, check=True,
                       capture_output=True)
        if kind_base.startswith("easerve"):
            cmd = [sys.executable, "-m", "easerve_operator.cli", "operator", "--metrics-port", "0", "--health-port", "0"]
            if kind_base == "easerve-limited":
                cmd += ["--worker-limit", "48"]
        else:  # bare-kopf, or bare-kopf+ssa+status+watch: the floor plus what easerve adds, one by one
            script = Path(cluster.run_dir) / "bare_operator.py"
            script.write_text(BARE_OPERATOR)
            env["BARE_ADD"] = ",".join(kind_base.split("+")[1:])
            cmd = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces", str(script)]
        op = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        time.sleep(4.0)  # let kopf start its watches before the burst
        import yaml
        from kubernetes import client, config

        config.load_kube_config(config_file=cluster.kubeconfig)
        cfg = client.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = 8
        api = client.ApiClient(cfg)
        custom, core, apps = client.CustomObjectsApi(api), client.CoreV1Api(api), client.AppsV1Api(api)
        base = yaml.safe_load((REPO / "examples" / "llava-v1.6-34b.yaml").read_text())
        ns = "scale"
        core.create_namespace({"metadata": {"name": ns}})
        t0 = time.monotonic()

        def create(i: int) -> None:
            body = {**base, "metadata": {"name": f"epd-{i:04d}", "namespace": ns}}
            custom.create_namespaced_custom_object("easerve.io", "v1alpha1", ns, "epddeployments", body,
                                                   _preload_content=False)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(create, range(count)))
        created_s = time.monotonic() - t0
        timeline: list[tuple[float, int]] = []
        done = 0
        while time.monotonic() - t0 < timeout:
            sel = "app.kubernetes.io/managed-by=easerve-operator"
            deps = apps.list_namespaced_deployment(ns, label_selector=sel, _preload_content=False)
            svcs = core.list_namespaced_service(ns, label_selector=sel, _preload_content=False)
            cms = core.list_namespaced_config_map(ns, label_selector=sel, _preload_content=False)
            per: dict[str, int] = {}
            for resp in (deps, svcs, cms):
                for item in json.loads(resp.data)["items"]:
                    owner = item["metadata"]["labels"]["easerve.io/deployment"]
                    per[owner] = per.get(owner, 0) + 1
            objs = json.loads(custom.list_namespaced_custom_object("easerve.io", "v1alpha1", ns, "epddeployments",
                                                                   _preload_content=False).data)["items"]
            done = sum(1 for o in objs if per.get(o["metadata"]["name"]) == 7
                       and (o.get("status") or {}).get("observedGeneration") == 1)
            timeline.append((time.monotonic() - t0, done))
            print(f"\r[{kind}] {done}/{count} complete after {timeline[-1][0]:.1f}s", end="", file=sys.stderr,
                  flush=True)
            if done == count:
                break
            time.sleep(0.5)
        print(file=sys.stderr)
        return {
            "operator": kind,
            "objects": count,
            "complete": done,
            "seconds_to_complete": timeline[-1][0] if done == count else None,
            "seconds_to_create": round(created_s, 2),
            "peak_rss_mb": round(peak_rss_mb(op.pid), 1),
            "timeline": timeline,
        }
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(timeout=30)
            except subprocess.TimeoutExpired:
                op.kill()
        if log.exists() and LOG_DIR is not None:  # the operator's log outlives the private cluster
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, LOG_DIR / f"{kind}-{int(time.time())}.log")
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    ap.add_argument("--operators", default="easerve,bare-kopf",
                    help="comma-separated: easerve, easerve-limited, bare-kopf, and attribution variants "
                    "bare-kopf+ssa, +status, +watch (combinable, e.g. bare-kopf+ssa+status+watch)")
    ap.add_argument("--only", default=None, help="one operator (same as --operators X)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; each round runs every operator once, in rotated order (a shared machine "
                    "drifts in load: ratios are taken within a round, and their spread is reported)")
    ap.add_argument("--with-kcm", action="store_true",
                    help="also run kube-controller-manager (ReplicaSets, Pods and GC compete for the 2 cores)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global LOG_DIR
    LOG_DIR = out / "logs"
    kinds = [args.only] if args.only else [k.strip() for k in args.operators.split(",") if k.strip()]
    rounds: list[list[dict[str, Any]]] = []
    for r in range(args.repeat):
        order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
        rounds.append([run_one(k, args.count, args.timeout, args.with_kcm) for k in order])
    results = [res for rnd in rounds for res in rnd]
    report: dict[str, Any] = {"count": args.count, "cpus": os.cpu_count(), "controller_manager": args.with_kcm,
                              "rounds": args.repeat,
                              "results": [{k: v for k, v in r.items() if k != "timeline"} for r in results]}
    ratios: dict[str, dict[str, list[float]]] = {}
    for rnd in rounds:
        bare = next((r for r in rnd if r["operator"] == "bare-kopf" and r["seconds_to_complete"]), None)
        for r in rnd:
            if bare is not None and r is not bare and r["seconds_to_complete"]:
                d = ratios.setdefault(r["operator"], {"time": [], "rss": []})
                d["time"].append(round(r["seconds_to_complete"] / bare["seconds_to_complete"], 3))
                d["rss"].append(round(r["peak_rss_mb"] / bare["peak_rss_mb"], 3))
    for op, d in ratios.items():
        report[f"ratio_{op}_over_bare"] = {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v} for k, v in d.items()
        }
    print(json.dumps(report, indent=2))
    (out / "operator_scale.json").write_text(json.dumps({**report, "timelines": {f"{r['operator']}#{i}": r["timeline"]
                                                                                  for i, r in enumerate(results)}},
                                                        indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rounds[-1]:
        xs, ys = zip(*r["timeline"], strict=True) if r["timeline"] else ((), ())
        ax.plot(xs, ys, label=f"{r['operator']} (peak RSS {r['peak_rss_mb']} MB)")
    ax.set_xlabel("seconds since the first create")
    ax.set_ylabel("EPDDeployments with 7 children + status")
    ax.set_title(f"Operator scale: {args.count} objects, {os.cpu_count()} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "operator_scale.png", dpi=120)
    print(f"wrote {out / 'operator_scale.json'} and {out / 'operator_scale.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
