"""Where envelopes and micro-batching pay, on the twin: goodput against the embedding path's
per-transfer setup cost, for EAServe and the Dynamo-style baseline.

The paper's Dynamo 0.9 paid a per-request NIXL registration and metadata cost of the order of
0.1-1 s on its embedding path (ai-dynamo/dynamo PRs #4994, #6098, #6651). EAServe sends one
envelope per destination per micro-batch, so it pays that setup once per batch; pass-through
encode (B = 1) pays it per request. This sweep sets the cost the way a user would for their fabric:
a profile file (``spec.engine.profileFile``) whose link entry sets ``embedding_setup_ms``
(docs/profiles.md). The KV path keeps the link's own setup.

At every cost and rate, each system gets its best configuration for that cost and rate, chosen
on a tuning workload (another seed) exactly as ``benchmarks/goodput.py`` does (grid tuner:
Dynamo-style = best allocation at B = 1, s = 1; EAServe = best of the top allocations x B x s).
Aggregated serving has no embedding transfer and is shown as the flat reference.

Everything here is a **twin prediction**, not a measurement.

    python benchmarks/transfer_setup.py            # costs 0.1 ms .. 1 s x rates 1..5, 300 requests
    python benchmarks/transfer_setup.py --quick    # costs 0.1, 10, 1000 ms x rate 3, 150 requests

Prints one JSON object and writes OUT/transfer_setup.json and OUT/transfer_setup.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from easerve_runtime.api import load_manifest, parse_spec
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.workload import generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import evaluate, tune  # noqa: E402 - the sibling benchmark's tuner, not a copy of it

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("dynamo", "aggregated", "easerve-s1", "easerve")
COSTS_MS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fabric_file(directory: Path, profile: str, embedding_ms: float) -> Path:
    """A profile file: the shipped ``profile`` whose GPU link sets ``embedding_setup_ms``."""
    data = resources.files("easerve_runtime.profiles").joinpath("data")
    gpus = json.loads(data.joinpath("gpus.json").read_text())
    links = json.loads(data.joinpath("links.json").read_text())
    link = gpus[profile.split("@")[1]]["link"]
    path = directory / f"fabric-{embedding_ms:g}ms.json"
    path.write_text(json.dumps({"profile": profile,
                                "links": {link: {**links[link], "embedding_setup_ms": embedding_ms}}}))
    return path


def sweep(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    _, base = load_manifest(ROOT / "examples" / f"{args.example}.yaml")
    profile = base.engine.profile
    assert profile, "the example must name a shipped profile"
    tier = "moderate" if "moderate" in [t.name for t in base.slo.tiers] else base.slo.objective
    out: dict[str, Any] = {"example": args.example, "profile": profile, "tier": tier, "rates": args.rates,
                           "requests": args.requests, "source": "twin", "costs": {}}
    total = len(args.costs) * len(args.rates)
    done = 0
    t_all = time.perf_counter()
    for cost in args.costs:
        wire = base.wire()
        wire["engine"] = {**{k: v for k, v in wire["engine"].items() if k != "profile"},
                          "profileFile": str(fabric_file(workdir, profile, cost))}
        spec = parse_spec(wire)
        model = cached_model(spec)
        per_rate: dict[str, Any] = {}
        for rate in args.rates:
            t0 = time.perf_counter()
            tuned = tune(spec, generate(spec, rate, args.requests, args.seed + 1000), model, rate=rate, tuner="grid")
            res = evaluate(spec, tuned, generate(spec, rate, args.requests, args.seed), model)
            per_rate[str(rate)] = {
                s: {"goodput": res[s]["goodput"][tier], "throughput": res[s]["throughput"],
                    "ttft_p99": res[s]["ttft_p99"], "config": res[s].get("config")}
                for s in SYSTEMS
            }
            done += 1
            progress(f"[{done}/{total}] embedding setup {cost:g} ms, rate {rate}: "
                     + "  ".join(f"{s}={per_rate[str(rate)][s]['goodput']:.2f}" for s in SYSTEMS)
                     + f"  ({time.perf_counter() - t0:.0f} s)")
        best = {s: max(per_rate[r][s]["goodput"] for r in per_rate) for s in SYSTEMS}
        out["costs"][f"{cost:g}"] = {
            "embedding_setup_ms": cost, "rates": per_rate, "best_goodput": best,
            "easerve_vs_dynamo": best["easerve"] / best["dynamo"] if best["dynamo"] > 0 else None,
            "easerve_s1_vs_dynamo": best["easerve-s1"] / best["dynamo"] if best["dynamo"] > 0 else None,
        }
    out["wall_s"] = time.perf_counter() - t_all
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = [c["embedding_setup_ms"] for c in out["costs"].values()]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"dynamo": "#d62728", "aggregated": "#ff7f0e", "easerve-s1": "#2ca02c", "easerve": "#1f77b4"}
    labels = {"dynamo": "Dynamo-style (B=1, s=1)", "aggregated": "aggregated (no embedding transfer)",
              "easerve-s1": "EAServe, s=1 (envelopes + micro-batches only)",
              "easerve": "EAServe (+ local prefill, SM split)"}
    for s in SYSTEMS:
        ax.plot(costs, [c["best_goodput"][s] for c in out["costs"].values()], "o--" if s == "aggregated" else "o-",
                color=colors[s], label=labels[s])
    ax.set_xscale("log")
    ax.set_xlabel("embedding transfer setup (ms per transfer)")
    ax.set_ylabel(f"goodput @ {out['tier']}, best over rates (req/s)")
    ax.legend(fontsize=8)
    ax.set_title(f"{out['example']} (twin prediction)")
    for key, s, label in (("easerve_vs_dynamo", "easerve", "EAServe"), ("easerve_s1_vs_dynamo", "easerve-s1", "EAServe, s=1")):
        ax2.plot(costs, [c[key] or 0.0 for c in out["costs"].values()], "o-", color=colors[s], label=label)
    ax2.legend(fontsize=8)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_xlabel("embedding transfer setup (ms per transfer)")
    ax2.set_ylabel("EAServe / Dynamo-style goodput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--example", default="llava-v1.6-34b")
    ap.add_argument("--costs", nargs="+", type=float, default=list(COSTS_MS), help="embedding setup, ms")
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 3.0, 4.0, 5.0])
    ap.add_argument("--requests", type=int, default=300, help="per tuning and per evaluation run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="costs 0.1, 10, 1000 ms, rate 3, 150 requests")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.costs, args.rates, args.requests = [0.1, 10.0, 1000.0], [3.0], 150
    if any(c < 0 for c in args.costs) or args.requests < 1 or not args.rates:
        ap.error("--costs must be >= 0, --requests >= 1, and at least one rate")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="easerve-fabric-") as d:
        out = sweep(args, Path(d))
    (outdir / "transfer_setup.json").write_text(json.dumps(out, indent=1, default=str))
    plot(out, outdir / "transfer_setup.png")
    print(json.dumps({k: v for k, v in out.items() if k != "costs"}
                     | {"best_goodput": {c: v["best_goodput"] for c, v in out["costs"].items()},
                        "easerve_vs_dynamo": {c: v["easerve_vs_dynamo"] for c, v in out["costs"].items()},
                        "easerve_s1_vs_dynamo": {c: v["easerve_s1_vs_dynamo"] for c, v in out["costs"].items()}},
                     indent=1))
    progress(f"wrote {outdir / 'transfer_setup.json'} and {outdir / 'transfer_setup.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
