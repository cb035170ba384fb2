"""`easerve sim`: what goodput will this configuration give at this rate? Answered in seconds.

Runs the discrete-event twin on a seeded workload (or a JSONL trace) for one system or all four
(``dynamo``, ``aggregated``, ``easerve-s1``, ``easerve``) and prints throughput, goodput per SLO
tier (keyed by tier name), TTFT/TPOT mean and P99. The baselines get their best configuration
(a sweep over this very workload: an oracle no deployment has); ``easerve`` and ``easerve-s1`` run
the file's configuration as given, untuned. The ``ratios`` of ``--system all`` therefore compare an
untuned spec against oracle-tuned baselines, and the output says so (``ratio_basis``); tune the
spec first (``easerve tune``) for a tuned-against-tuned comparison. Omni specs (``mode: omni-colocated``) are
delegated to ``easerve_runtime.sim.omni.run_cli``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

HELP = "Simulate a deployment (discrete-event twin) against the baselines; prints goodput per SLO tier"
SYSTEM_CHOICES = ("dynamo", "aggregated", "easerve-s1", "easerve", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="EPDDeployment manifest (YAML)")
    parser.add_argument(
        "--rate", type=float, default=None, help="arrival rate, req/s (default: spec.tuning.targetRate or 2)"
    )
    parser.add_argument("--requests", type=int, default=500, help="number of requests (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--system", choices=SYSTEM_CHOICES, default="easerve", help="system to simulate (default easerve)"
    )
    parser.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson", help="arrival process")
    parser.add_argument("--cv", type=float, default=1.0, help="coefficient of variation for gamma arrivals")
    parser.add_argument(
        "--trace", default=None, help="replay this JSONL trace instead of generating a workload"
    )
    parser.add_argument(
        "--write-trace", default=None, help="also write the generated workload to this JSONL file"
    )
    parser.add_argument("--records", action="store_true", help="include per-request records in the JSON")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--policy", default=None, help="omni specs: scheduling policy (passed to sim.omni)")
    parser.add_argument(
        "--long-path-ratio", type=float, default=None, help="omni specs: share of long-path requests"
    )


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: make them null so the output parses everywhere."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _err(msg: str) -> int:
    print(f"easerve sim: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from easerve_runtime.api import DeploymentMode, load_manifest, spec_errors

    try:
        name, spec = load_manifest(args.file)
    except ValidationError as exc:
        return _err(f"{args.file}: invalid spec:\n  " + "\n  ".join(spec_errors(exc)))
    except (OSError, ValueError) as exc:
        return _err(str(exc))

    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        try:
            from easerve_runtime.sim import omni
        except ImportError as exc:
            return _err(f"omni-colocated specs need easerve_runtime.sim.omni, which is not available ({exc})")
        return int(omni.run_cli(name, spec, args))

    from easerve_runtime.profiles import spec_profile
    from easerve_runtime.sim import SYSTEMS, simulate
    from easerve_runtime.workload import generate, read_trace, write_trace

    try:
        profile = spec_profile(spec)  # the one way to a profile; refuses a wrong spec.model.encoder
    except ValueError as exc:
        return _err(f"{args.file}: {exc}")

    rate = args.rate if args.rate is not None else (spec.tuning.target_rate or 2.0)
    if args.requests < 1:
        return _err(f"--requests: must be >= 1, got {args.requests}")
    if not rate > 0:
        return _err(f"--rate: must be > 0, got {rate}")
    try:
        if args.trace:
            reqs = read_trace(args.trace)
            if not reqs:
                return _err(f"--trace: {args.trace} holds no requests")
        else:
            reqs = generate(spec, rate, args.requests, args.seed, arrival=args.arrival, cv=args.cv)
        if args.write_trace:
            write_trace(args.write_trace, reqs)
        systems = list(SYSTEMS) if args.system == "all" else [args.system]
        results = {s: simulate(spec, reqs, s) for s in systems}
    except (OSError, ValueError) as exc:
        return _err(str(exc))

    out: dict[str, Any] = {
        "name": name,
        "profile": profile.name,
        "rate": None if args.trace else rate,
        "requests": len(reqs),
        "seed": args.seed,
        "arrival": "trace" if args.trace else args.arrival,
        "cv": args.cv,
        "objective": spec.slo.objective,
    }
    if len(systems) == 1:
        out.update(results[systems[0]].to_dict(records=args.records))
    else:
        out["systems"] = {s: r.to_dict(records=args.records) for s, r in results.items()}
        out["ratio_basis"] = {s: _basis(r) for s, r in results.items()}
        tier = spec.slo.objective
        ours = results["easerve"].summary["goodput"].get(tier, 0.0)
        out["ratios"] = {
            f"easerve/{s}": (ours / g if g > 0 else None)
            for s in systems
            if s != "easerve"
            for g in [results[s].summary["goodput"].get(tier, 0.0)]
        }
    if args.json:
        print(json.dumps(_clean(out), indent=2, sort_keys=True))
        return 0
    _print_table(out, results, spec.slo.objective)
    return 0


def _basis(result: Any) -> str:
    """How a system's configuration was chosen: an oracle sweep on this workload, or the spec as given."""
    swept = getattr(result, "swept", None) or []
    if len(swept) > 1:
        return f"oracle-tuned: best of {len(swept)} configurations on this very workload"
    return "untuned: the spec's configuration as given"


def _print_table(out: dict[str, Any], results: dict[str, Any], tier: str) -> None:
    tiers = list(next(iter(results.values())).summary["goodput"])
    print(
        f"{out['name']} ({out['profile']}), {out['requests']} requests, rate {out['rate']}, {out['arrival']}"
    )
    head = (
        f"{'system':<12} {'thru':>6} "
        + " ".join(f"{t[:8]:>8}" for t in tiers)
        + f" {'TTFT':>7} {'p99':>7} {'TPOT ms':>8} {'p99':>7}  config"
    )
    print(head)
    for s, r in results.items():
        m = r.summary
        cfg = r.config.get("allocation") or r.config.get("layout")
        print(
            f"{s:<12} {m['throughput']:6.2f} "
            + " ".join(f"{m['goodput'][t]:8.2f}" for t in tiers)
            + f" {m['ttft_mean']:7.2f} {m['ttft_p99']:7.2f} {m['tpot_mean'] * 1e3:8.1f} {m['tpot_p99'] * 1e3:7.1f}  {cfg}"
        )
    if "ratios" in out:
        print(
            f"goodput ratios at {tier}: "
            + ", ".join(f"{k} {v:.2f}x" if v else f"{k} n/a" for k, v in out["ratios"].items())
        )
        for s, basis in out["ratio_basis"].items():
            print(f"  {s}: {basis}")
        print("  (an untuned spec against oracle-tuned baselines; `easerve tune` the spec to compare tuned with tuned)")
