"""``easerve partition-controller``: the pod's partition container; writes the GPU's control record.

It reads the tenants' demand records (``/dev/shm/easerve-partition-gpuN.primary`` / ``.partner``),
samples NVML off the hot path, asks the pure policy for a split and publishes it in
``/dev/shm/easerve-partition-gpuN``. Without a GPU it still runs (the policies are pure): the
signal is then absent and ``--total-sms`` must be given.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

HELP = "Run the SM-partition controller for one GPU (writes the /dev/shm control record)."
POLICIES = ("encode-batch-split", "bandwidth-throttle", "static", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help="runtime ConfigMap JSON (what the operator renders): policy, static SMs and epsilon come from "
        "spec.smPartition; without --table, the dynamic table is built from the engine's latency profile",
    )
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--policy", choices=POLICIES, default=None, help="required unless --config gives it")
    parser.add_argument("--table", type=Path, help="partition table JSON (encode-batch-split)")
    parser.add_argument(
        "--ladder", type=int, nargs="+", help="co-running SM ladder S_min..S_cap (bandwidth-throttle)"
    )
    parser.add_argument(
        "--s-aggr", type=int, help="no-downstream SM cap (bandwidth-throttle; default: all SMs)"
    )
    parser.add_argument(
        "--b-sat", type=float, default=60.0, help="memory activity (%%) at which the cap reaches S_cap"
    )
    parser.add_argument("--gamma", type=float, default=0.4, help="EWMA weight of the NVML signal")
    parser.add_argument("--static-sms", type=int, help="primary SMs (static)")
    parser.add_argument("--total-sms", type=int, help="SM count (default: from the GPU)")
    parser.add_argument("--tick-ms", type=float, default=0.5)
    parser.add_argument("--sample-ms", type=float, default=20.0, help="NVML sampling period")
    parser.add_argument("--no-gpm", action="store_true", help="use utilization.memory even where GPM works")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument(
        "--duration", type=float, default=0.0, help="stop after this many seconds (0: run forever)"
    )


def _total_sms(gpu: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        cores = pynvml.nvmlDeviceGetNumGpuCores(h)  # CUDA cores; 128 per SM on Hopper/Ada/Ampere GA10x
        per_sm = 128 if (major, minor) != (8, 0) else 64
        return int(cores // per_sm)
    except Exception:
        return None


def _apply_config(args: argparse.Namespace) -> object | None:
    """Fill unset flags from the deployment's spec; return a table built from the latency profile
    for ``dynamic`` mode when no measured ``--table`` is given (the sim engine's ground truth, and
    a sane start on real GPUs until `easerve profile-partition` has run)."""
    from easerve_runtime.api import RuntimeConfig

    cfg = RuntimeConfig.from_json(args.config.read_text())
    part = cfg.spec.sm_partition
    mode = str(part.mode)
    if args.policy is None:
        args.policy = {"dynamic": "encode-batch-split", "static": "static"}.get(mode, "none")
    if args.static_sms is None and part.static_encode_sms is not None:
        args.static_sms = part.static_encode_sms
    if args.policy == "bandwidth-throttle" and str(cfg.spec.mode) == "omni-colocated":
        # the omni profile carries the throttle's ladder, S_aggr, b_sat and the GPU's SM count: without
        # them (no NVML, no flags) the controller could not start (it exited 2 in the omni pod)
        from easerve_runtime.omni.profile import load_omni_profile

        op = load_omni_profile(cfg.spec.engine.profile)
        t = op.throttle
        args.ladder = args.ladder or [int(x) for x in t["ladder"]]
        args.s_aggr = args.s_aggr or int(t["s_aggr"])
        args.total_sms = args.total_sms or _total_sms(args.gpu) or op.total_sms
        if "b_sat" in t and args.b_sat == 60.0:
            args.b_sat = float(t["b_sat"])
    if args.policy != "encode-batch-split" or args.table is not None:
        return None
    from easerve_runtime.profiles import load_profile
    from easerve_runtime.profiles.partition import partition_table

    profile = load_profile(cfg.spec.engine.profile)
    return partition_table(profile, profile.sms, epsilon=part.epsilon)


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.partition.controller import ControllerCore, run_loop
    from easerve_runtime.partition.nvml_signal import MemoryActivitySampler, NvmlUnavailable
    from easerve_runtime.partition.record import ControlRecordFile, DemandFile, control_path, demand_path
    from easerve_runtime.policies.partition import BandwidthThrottle, EncodeBatchSplit, PartitionTable

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("partition-controller")
    profile_table = None
    if args.config is not None:
        try:
            profile_table = _apply_config(args)
        except (OSError, ValueError) as exc:
            print(f"--config: {exc}", file=sys.stderr)
            return 2
    if args.policy is None:
        print("--policy: required (or give --config)", file=sys.stderr)
        return 2
    total = args.total_sms or _total_sms(args.gpu)
    table = profile_table if args.table is None else None
    if table is not None:
        total = total or table.total_sms
    if args.policy == "encode-batch-split" and table is None:
        if args.table is None:
            print("--table: required for --policy encode-batch-split", file=sys.stderr)
            return 2
        try:
            table = PartitionTable.from_dict(json.loads(args.table.read_text()))
        except (OSError, ValueError) as exc:
            print(f"--table: {exc}", file=sys.stderr)
            return 2
        total = total or table.total_sms
    if total is None:
        print("--total-sms: required when the GPU's SM count cannot be read from NVML", file=sys.stderr)
        return 2
    try:
        if args.policy == "encode-batch-split":
            assert table is not None
            core = ControllerCore(total, split=EncodeBatchSplit(table))
        elif args.policy == "bandwidth-throttle":
            if not args.ladder:
                print("--ladder: required for --policy bandwidth-throttle", file=sys.stderr)
                return 2
            th = BandwidthThrottle(args.ladder, args.s_aggr or total, total, args.b_sat, gamma=args.gamma)
            core = ControllerCore(total, throttle=th)
        elif args.policy == "static":
            if args.static_sms is None or not 0 < args.static_sms <= total:
                print(f"--static-sms: required, in 1..{total}", file=sys.stderr)
                return 2
            core = ControllerCore(total, static_sms=args.static_sms)
        else:
            core = ControllerCore(total)
    except ValueError as exc:
        print(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}", file=sys.stderr)
        return 2
    sample = None
    try:
        sampler = MemoryActivitySampler(args.gpu, use_gpm=not args.no_gpm)
        sample = sampler.sample
        log.info("bandwidth signal: %s", sampler.source)
    except NvmlUnavailable as exc:
        log.warning("no bandwidth signal (%s); EWMA stays 0", exc)
    args.shm_dir.mkdir(parents=True, exist_ok=True)
    control = ControlRecordFile(control_path(args.gpu, args.shm_dir), writer=True)
    demands = []
    for role in ("primary", "partner"):
        p = demand_path(args.gpu, role, args.shm_dir)
        DemandFile(p, writer=True).close() if not p.exists() else None
        demands.append(DemandFile(p))
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    end = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    log.info("policy %s on GPU %d (%d SMs) -> %s", args.policy, args.gpu, total, control.path)
    ticks = run_loop(
        core,
        control,
        demands[0],
        demands[1],
        sample,
        tick_s=args.tick_ms / 1e3,
        sample_period_s=args.sample_ms / 1e3,
        stop=lambda: stopping["flag"] or time.monotonic() >= end,
    )
    log.info("stopped after %d ticks", ticks)
    return 0
