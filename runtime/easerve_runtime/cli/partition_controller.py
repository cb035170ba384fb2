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
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--policy", choices=POLICIES, required=True)
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


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.partition.controller import ControllerCore, run_loop
    from easerve_runtime.partition.nvml_signal import MemoryActivitySampler, NvmlUnavailable
    from easerve_runtime.partition.record import ControlRecordFile, DemandFile, control_path, demand_path
    from easerve_runtime.policies.partition import BandwidthThrottle, EncodeBatchSplit, PartitionTable

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("partition-controller")
    total = args.total_sms or _total_sms(args.gpu)
    table = None
    if args.policy == "encode-batch-split":
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
