"""Measure the local control plane with the kubelet harness: start-up, and how fast N pods get Ready.

    ~/.cache/easerve/venv/bin/python e2e/bench_harness.py [--pods 300]

Prints JSON: seconds to start the control plane, to register the harness, and from creating one
Deployment of N replicas (no GPU requests) until all N pods are Ready (scheduler + controller-manager
+ harness together), plus the harness's own count. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_cluster import LocalCluster, start_harness  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=300)
    p.add_argument("--etcd-ram", action="store_true")
    args = p.parse_args()
    t0 = time.monotonic()
    cluster = LocalCluster.start(etcd_ram=args.etcd_ram)
    t_up = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        h = start_harness(cluster)
        t_harness = time.monotonic() - t1
        from kubernetes import client, config

        apps = client.AppsV1Api(config.new_client_from_config(config_file=cluster.kubeconfig))
        ns = cluster.namespace("bench")
        body: dict[str, Any] = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "many"},
            "spec": {
                "replicas": args.pods,
                "selector": {"matchLabels": {"app": "many"}},
                "template": {
                    "metadata": {"labels": {"app": "many"}},
                    "spec": {"containers": [{"name": "c", "image": "none:0"}]},
                },
            },
        }
        t2 = time.monotonic()
        apps.create_namespaced_deployment(ns, body)  # type: ignore[arg-type]  # the client accepts dicts
        last = -1
        while True:
            status = apps.read_namespaced_deployment("many", ns).status
            ready = (status.ready_replicas if status else 0) or 0
            if ready != last:
                print(f"  {ready}/{args.pods} ready after {time.monotonic() - t2:.1f}s", file=sys.stderr)
                last = ready
            if ready >= args.pods:
                break
            time.sleep(0.25)
        t_ready = time.monotonic() - t2
        print(
            json.dumps(
                {
                    "pods": args.pods,
                    "control_plane_up_s": round(t_up, 2),
                    "harness_start_s": round(t_harness, 2),
                    "all_pods_ready_s": round(t_ready, 2),
                    "pods_per_s": round(args.pods / t_ready, 1),
                    "harness_readied": h.readied,
                }
            )
        )
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
