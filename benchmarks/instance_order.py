"""Why the pools list instances in id order: what Dynamo's client gives, and what it costs the twin.

Two parts:

- **measured (CPU, real Dynamo):** ``--servers`` processes serve one endpoint (file discovery, TCP
  request plane), then ``--clients`` processes each print ``client.instance_ids()``. The order
  differs between processes: it is a hash map's. A pool that used it as given (``Pool.instances``
  before it sorted) gave every process its own ranking of the same instances.
- **predicted (twin):** every encode worker picks its remote prefill worker by the fewest of its
  own requests in flight, its ties rotating from one start (``PostEncodeRouter``). With a common
  order the encoders pick in step; with per-process orders they may pick out of step. The twin
  runs each candidate both ways (out of step: encode worker i starts its rotation at i) on the
  search's seeded workload at ``--rate``, and reads P99 TTFT.

    python benchmarks/instance_order.py                       # ~25 s: 4 servers, 3 clients, seeds 0-4
    python benchmarks/instance_order.py --plot docs/img/instance_order.png

Prints one JSON object. Writes the plot: P99 TTFT per seed, in step against out of step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"

SERVER = r"""
import asyncio, os, signal
from dynamo.runtime import DistributedRuntime
async def main():
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp")
    ep = rt.endpoint("order.prefill.generate")
    async def echo(req, context=None):
        yield {"ok": True}
    loop.add_signal_handler(signal.SIGTERM, rt.shutdown)
    rt.set_health_status(True)
    await ep.serve_endpoint(echo)
asyncio.run(main())
"""

CLIENT = r"""
import asyncio, json, os, sys
from dynamo.runtime import DistributedRuntime
async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    c = await rt.endpoint("order.prefill.generate").client()
    await c.wait_for_instances()
    ids = []
    for _ in range(100):
        ids = [int(i) for i in c.instance_ids()]
        if len(ids) >= int(sys.argv[1]):
            break
        await asyncio.sleep(0.1)
    print(json.dumps(ids), flush=True)
    os._exit(0)
asyncio.run(main())
"""


def log(msg: str) -> None:
    print(f"[instance_order {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dynamo_orders(servers: int, clients: int) -> list[list[int]]:
    """Each client process's ``instance_ids()`` of the same ``servers`` instances."""
    with tempfile.TemporaryDirectory(prefix="instance-order-") as tmp:
        env = {**os.environ, "DYN_FILE_KV": str(Path(tmp) / "kv")}
        procs = [subprocess.Popen([sys.executable, "-c", SERVER], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _ in range(servers)]
        try:
            orders = []
            for i in range(clients):
                out = subprocess.run([sys.executable, "-c", CLIENT, str(servers)], env=env, capture_output=True,
                                     text=True, timeout=60)
                orders.append(json.loads(out.stdout.strip().splitlines()[-1]))
                log(f"client {i + 1}/{clients}: {orders[-1]}")
            return orders
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)


def twin_p99(label: str, rate: float, requests: int, seed: int, out_of_step: bool) -> dict[str, float]:
    """The twin's figures for ``label`` (as ``tuning.agreement`` predicts a cluster trial), its encode
    workers' remote-prefill rotations started together (in step) or at their own index (out of step)."""
    import easerve_runtime.policies.post_encode as post_encode
    from easerve_operator.tuning.agreement import twin_prediction
    from easerve_operator.tuning.space import apply_candidate
    from easerve_runtime.api import load_manifest
    from easerve_runtime.policies.router import LeastOutstanding
    from trial_local import candidate

    spec = apply_candidate(load_manifest(str(EXAMPLE))[1], candidate(label))
    original = post_encode.PostEncodeRouter.__init__
    index = itertools.count()

    def staggered(self: Any, ratio: float, has_local: bool) -> None:
        original(self, ratio, has_local)
        self._picker = LeastOutstanding(next(index))

    if out_of_step:
        post_encode.PostEncodeRouter.__init__ = staggered  # type: ignore[method-assign]
    try:
        p = twin_prediction(spec, rate, requests, seed, draws=1)  # the frontends' even spread, as when measured
    finally:
        post_encode.PostEncodeRouter.__init__ = original  # type: ignore[method-assign]
    return {"ttft_mean": round(p["ttftMean"], 4), "ttft_p99": round(p["ttftP99Observed"], 4)}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["twin"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
    for ax, (label, by_seed) in zip(axes[0], rows.items(), strict=True):
        seeds = sorted(by_seed, key=int)
        xs = range(len(seeds))
        for shift, key, name in ((-0.2, "in_step", "in step (id order)"), (0.2, "out_of_step", "out of step")):
            ax.bar([x + shift for x in xs], [by_seed[s][key]["ttft_p99"] for s in seeds], 0.4, label=name)
        ax.set_xticks(list(xs), [f"seed {s}" for s in seeds])
        ax.set(ylabel="P99 TTFT (s, twin)", title=label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(f"remote-prefill picks in step or not\nΛ = {out['rate']:g}, predicted (twin)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--candidates", nargs="+", default=["2E-2P(tp2)-1D(tp2) B=2 s=0.7"])
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--plot", default=str(REPO / "benchmarks" / "out" / "instance_order.png"))
    args = ap.parse_args()
    orders = dynamo_orders(args.servers, args.clients)
    out: dict[str, Any] = {
        "bench": "instance_order",
        "dynamo": {"measured": "cpu (this host): real Dynamo runtime, file discovery", "orders": orders,
                   "distinct_orders": len({tuple(o) for o in orders}),
                   "sorted": [o == sorted(o) for o in orders]},
        "rate": args.rate, "requests": args.requests, "twin": {},
    }
    for label in args.candidates:
        rows = out["twin"][label] = {}
        for seed in range(args.seeds):
            rows[str(seed)] = {"in_step": twin_p99(label, args.rate, args.requests, seed, False),
                               "out_of_step": twin_p99(label, args.rate, args.requests, seed, True)}
            log(f"{label} seed {seed}: {rows[str(seed)]}")
    print(json.dumps(out, indent=1))
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(out, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
