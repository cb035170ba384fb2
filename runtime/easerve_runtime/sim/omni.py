"""The omni twin: one omni model on one GPU in virtual time, under HorizonServe or a baseline.

It drives the same objects the runtime path uses: ``policies.omni.OmniScheduler`` (the queue-
view wrapper over FCFS/EDF), ``policies.partition.BandwidthThrottle`` (the SM cap) and the
clock-free ``omni.engine.OmniEngine`` over an ``omni.profile`` model. Only the clock differs.
The system table and the virtual-time loop live in ``omni.systems`` and ``omni.replay`` (shared
with the live server, which must not import this package); this module adds the spec-level run
and the CLI, and re-exports their names.

Systems (``--policy``): the table in ``omni.systems`` (all inside the same engine, so that only
the policy differs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.omni.profile import OmniProfile, load_omni_profile
from easerve_runtime.omni.replay import (
    OmniArrival,
    OmniSimResult,
    class_mix,
    make_workload,
    profile_class,
    simulate,
    slo_table,
    solo_p95,
)
from easerve_runtime.omni.systems import BASELINES, SYSTEMS, make_engine
from easerve_runtime.policies.omni import SLOTable, class_table
from easerve_runtime.profiles import profile_path

__all__ = [
    "BASELINES",
    "SYSTEMS",
    "OmniArrival",
    "OmniSimResult",
    "class_mix",
    "class_table",
    "make_engine",
    "make_workload",
    "profile_class",
    "run",
    "run_cli",
    "simulate",
    "slo_table",
    "solo_p95",
]


def run(
    spec: EPDDeploymentSpec,
    system: str,
    rate: float,
    n: int,
    seed: int,
    long_path_ratio: float | None = None,
    profile: OmniProfile | None = None,
    slo: SLOTable | None = None,
) -> dict[str, Any]:
    if spec.omni is None:
        raise ValueError("spec.omni: required for the omni twin (spec.mode: omni-colocated)")
    prof = profile or load_omni_profile(profile_path(spec))
    table = slo or slo_table(prof, spec.omni)
    wl = make_workload(prof, class_table(spec.omni.classes), rate, n, seed, long_path_ratio)
    out = simulate(prof, spec.omni, table, system, wl).summary()
    out.update({"profile": prof.name, "rate": rate, "long_path_ratio": long_path_ratio, "seed": seed})
    return out


def run_cli(name: str, spec: EPDDeploymentSpec, args: argparse.Namespace) -> int:
    """``easerve sim`` delegates here when ``spec.mode`` is omni-colocated.

    Reads ``args.policy`` (horizon|vanilla|edf|mps|edf-mps, plus the two ablations),
    ``args.rate``, ``args.long_path_ratio``, ``args.requests``, ``args.seed``, ``args.json``.
    """
    policy = getattr(args, "policy", None) or "horizon"
    rate = float(getattr(args, "rate", None) or 1.0)
    n = int(getattr(args, "requests", None) or 500)
    seed = int(getattr(args, "seed", None) or 0)
    lpr = getattr(args, "long_path_ratio", None)
    try:
        out = run(spec, policy, rate, n, seed, None if lpr is None else float(lpr))
    except ValueError as exc:
        print(f"easerve sim: {exc}", file=sys.stderr)
        return 2
    out["name"] = name
    if getattr(args, "json", False):
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(
            f"{name} [{out['profile']}] policy={policy} rate={rate} req/s: SLO attainment {out['slo_attainment']:.3f}"
        )
        for cls, d in out["per_class"].items():
            print(
                f"  {cls:>10}: attainment {d['attainment']:.3f}  p95 {d['p95_s']:.3f}s  (SLO {d['slo_s']:.3f}s)"
            )
    return 0


def _main(argv: list[str] | None = None) -> int:
    from easerve_runtime.api import load_manifest

    p = argparse.ArgumentParser(prog="python -m easerve_runtime.sim.omni")
    p.add_argument("-f", "--file", required=True)
    p.add_argument("--policy", default="horizon", choices=sorted(SYSTEMS))
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--long-path-ratio", type=float, default=None)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    name, spec = load_manifest(args.file)
    return run_cli(name, spec, args)


if __name__ == "__main__":
    raise SystemExit(_main())
