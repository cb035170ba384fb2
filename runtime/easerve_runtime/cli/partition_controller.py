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
from typing import Any

HELP = "Run the SM-partition controller for one GPU (writes the /dev/shm control record)."
POLICIES = ("encode-batch-split", "bandwidth-throttle", "static", "none")
"""``policies.sm_policy.PolicyKind`` values (kept literal so ``--help`` imports nothing heavy)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help="runtime ConfigMap JSON (what the operator renders): the policy the spec asks for "
        "(policies.sm_policy.partition_policy): spec.smPartition for a disaggregated deployment (without "
        "--table, the dynamic table is built from the engine's latency profile), the omni profile's "
        "bandwidth throttle for an omni-colocated one",
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
    parser.add_argument("--tick-ms", type=float, default=0.5,
                        help="poll period when polling (--poll, or no wake-up socket), and the decision "
                        "period of the bandwidth throttle while a tenant runs")
    parser.add_argument("--poll", action="store_true",
                        help="poll the demand records every tick instead of sleeping until a tenant pokes "
                        "(partition/wake.py)")
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


def _spec_policy(args: argparse.Namespace) -> Any:
    """The deployment's policy from ``--config`` (``policies.sm_policy.partition_policy``, the same
    factory the twin and the omni engine use), with its inputs loaded here: the dynamic table from
    the engine's latency profile unless a measured ``--table`` is given, the omni throttle from the
    omni profile. Explicit flags (``--policy`` other than the spec's, ``--table``, ``--ladder``,
    ``--static-sms``) win; then this returns None after filling what the spec gives."""
    from easerve_runtime.api import DeploymentMode, RuntimeConfig
    from easerve_runtime.policies.sm_policy import PolicyKind, partition_policy, policy_kind

    spec = RuntimeConfig.from_json(args.config.read_text()).spec
    kind = policy_kind(spec)
    if args.policy is None:
        args.policy = str(kind)
    if args.static_sms is None and spec.sm_partition.static_encode_sms is not None:
        args.static_sms = spec.sm_partition.static_encode_sms
    if args.policy != kind or args.table is not None or args.ladder:
        return None
    table = None
    throttle = None
    total = args.total_sms or _total_sms(args.gpu)
    if kind is PolicyKind.ENCODE_BATCH_SPLIT:
        from easerve_runtime.profiles import spec_profile
        from easerve_runtime.profiles.partition import partition_table

        profile = spec_profile(spec)
        table = partition_table(profile, profile.sms, epsilon=spec.sm_partition.epsilon)
        total = total or table.total_sms
    elif kind is PolicyKind.BANDWIDTH_THROTTLE and spec.mode == DeploymentMode.OMNI_COLOCATED:
        from easerve_runtime.omni.profile import load_omni_profile
        from easerve_runtime.profiles.source import profile_path

        omni = load_omni_profile(profile_path(spec))
        throttle = omni.throttle
        total = total or omni.total_sms
    if total is None:
        raise ValueError("--total-sms: required when the GPU's SM count cannot be read from NVML")
    return partition_policy(spec, total, table=table, throttle=throttle)


def _flag_policy(args: argparse.Namespace, total: int) -> Any:
    """The policy the flags describe (no ``--config``, or flags overriding it); errors name the flag."""
    from easerve_runtime.policies.partition import EncodeBatchSplit, PartitionTable
    from easerve_runtime.policies.sm_policy import PolicyKind, SMPolicy, bandwidth_throttle

    kind = PolicyKind(args.policy)
    if kind is PolicyKind.ENCODE_BATCH_SPLIT:
        if args.table is None:
            raise ValueError("--table: required for --policy encode-batch-split")
        try:
            table = PartitionTable.from_dict(json.loads(args.table.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--table: {exc}") from exc
        return SMPolicy(kind, total, split=EncodeBatchSplit(table))
    if kind is PolicyKind.BANDWIDTH_THROTTLE:
        if not args.ladder:
            raise ValueError("--ladder: required for --policy bandwidth-throttle")
        params = {
            "ladder": args.ladder,
            "s_aggr": args.s_aggr or total,
            "b_sat": args.b_sat,
            "gamma": args.gamma,
        }
        try:
            return SMPolicy(kind, total, throttle=bandwidth_throttle(params, total))
        except ValueError as exc:
            raise ValueError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    if kind is PolicyKind.STATIC:
        if args.static_sms is None or not 0 < args.static_sms <= total:
            raise ValueError(f"--static-sms: required, in 1..{total}")
        return SMPolicy(kind, total, static_sms=args.static_sms)
    return SMPolicy(kind, total)


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.partition.controller import ControllerCore, run_loop
    from easerve_runtime.partition.nvml_signal import MemoryActivitySampler, NvmlUnavailable
    from easerve_runtime.partition.record import ControlRecordFile, DemandFile, control_path, demand_path
    from easerve_runtime.partition.wake import WakeListener, WakeSender, tenant_wake_path, wake_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("partition-controller")
    policy = None
    try:
        if args.config is not None:
            policy = _spec_policy(args)
        if args.policy is None:
            raise ValueError("--policy: required (or give --config)")
        if policy is None:
            total = args.total_sms or _total_sms(args.gpu)
            if total is None and args.table is not None and args.policy == "encode-batch-split":
                from easerve_runtime.policies.partition import PartitionTable

                try:
                    total = PartitionTable.from_dict(json.loads(args.table.read_text())).total_sms
                except (OSError, ValueError) as exc:
                    raise ValueError(f"--table: {exc}") from exc
            if total is None:
                raise ValueError("--total-sms: required when the GPU's SM count cannot be read from NVML")
            policy = _flag_policy(args, total)
    except (OSError, ValueError) as exc:
        msg = str(exc)
        print(msg if msg.startswith("--") else f"--config: {msg}", file=sys.stderr)
        return 2
    total = policy.total_sms
    core = ControllerCore(total, split=policy.split, throttle=policy.throttle, static_sms=policy.static_sms)
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
    listener = None if args.poll else WakeListener.bind(wake_path(control.path))
    log.info("policy %s on GPU %d (%d SMs) -> %s (%s)", args.policy, args.gpu, total, control.path,
             f"woken by the tenants at {listener.path}" if listener else f"polling every {args.tick_ms} ms")
    tenants = [WakeSender(tenant_wake_path(control.path, role)) for role in ("primary", "partner")]

    def poke_tenants() -> None:
        for t in tenants:
            t.poke()

    ticks = run_loop(
        core,
        control,
        demands[0],
        demands[1],
        sample,
        tick_s=args.tick_ms / 1e3,
        sample_period_s=args.sample_ms / 1e3,
        stop=lambda: stopping["flag"] or time.monotonic() >= end,
        wake=listener.wait if listener else None,
        idle_wait_s=min(0.1, args.duration) if args.duration > 0 else 0.1,
        published=poke_tenants,
    )
    for t in tenants:
        t.close()
    if listener is not None:
        listener.close()
    log.info("stopped after %d decisions", ticks)
    return 0
