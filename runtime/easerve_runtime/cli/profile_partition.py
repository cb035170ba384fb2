"""``easerve profile-partition``: measure encode latency per SM level and batch, write the knee table.

The JSON goes into the ConfigMap named by ``spec.smPartition.tableConfigMap``; the encode worker
loads it with ``PartitionTable.from_dict``. Needs a CUDA GPU with green contexts; without one it
says so and exits 2 instead of writing a table that would describe nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "Profile encode latency vs SM share on this GPU and write the partition table (JSON + PNG)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--encoder", required=True, help="clip-vit-l-336, whisper-large-v3 or qwen2-vl-vision"
    )
    parser.add_argument("--levels", type=int, default=5, help="number of SM levels including the full GPU")
    parser.add_argument("--max-batch", type=int, default=16, help="largest micro-batch to profile")
    parser.add_argument(
        "--epsilon", type=float, default=0.1, help="a level supports a batch within (1+eps) of full GPU"
    )
    parser.add_argument(
        "--carveout", choices=("auto", "on", "off"), default="auto", help="cuBLAS SM carveout per level"
    )
    parser.add_argument("--reps", type=int, default=15, help="timed graph replays per point (median)")
    parser.add_argument("--weights", default=None, help="local weights path (default: random weights)")
    parser.add_argument("--out", type=Path, default=Path("."), help="output directory")


def batches_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n`` (``n`` itself included)."""
    if n < 1:
        raise ValueError(f"--max-batch: must be >= 1, got {n}")
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return [*out, n]


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.engines.torch_encode import ENCODERS

    if args.encoder not in ENCODERS:
        print(f"--encoder: unknown encoder {args.encoder!r}; known: {', '.join(ENCODERS)}", file=sys.stderr)
        return 2
    if args.levels < 2:
        print(
            f"--levels: need at least 2 (one partition plus the full GPU), got {args.levels}", file=sys.stderr
        )
        return 2
    try:
        batches = batches_up_to(args.max_batch)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from easerve_runtime.partition.backends import detect_backend

    info = detect_backend("green-context")
    if info.name != "green-context":
        print(
            f"profile-partition needs a CUDA GPU with green contexts; this machine has none usable "
            f"(backend {info.name}: {info.reason}). Run it on the encode GPU's node.",
            file=sys.stderr,
        )
        return 2
    import torch

    from easerve_runtime.engines.torch_encode import GraphedEncoder, build_encoder
    from easerve_runtime.partition.backends import GreenContextPool
    from easerve_runtime.partition.profiler import build_table, plot_curves, profile_latency, write_table
    from easerve_runtime.policies.partition import default_ladder

    ladder = [s for s in default_ladder(info.total_sms, args.levels) if s < info.total_sms]
    pool = GreenContextPool(ladder)
    enc = build_encoder(args.encoder, weights_path=args.weights)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    default = carve = None
    if args.carveout != "on":
        default = profile_latency(GraphedEncoder(enc), pool, ladder, batches, False, args.reps, say)
    if args.carveout != "off":
        carve = profile_latency(GraphedEncoder(enc), pool, ladder, batches, True, args.reps, say)
    base = default if default is not None else carve
    assert base is not None
    table, use = build_table(
        base,
        carve if default is not None else None,
        info.total_sms,
        args.epsilon,
        encoder=args.encoder,
        gpu=torch.cuda.get_device_properties(0).name,
        backend=info.name,
    )
    if default is None:
        use = {s: s != info.total_sms for s in base}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"partition_table_{args.encoder}.json"
    data = write_table(table, use, path)
    series = {k: v for k, v in (("default", default), ("carveout", carve)) if v}
    plot_curves(series, info.total_sms, args.out / f"partition_curves_{args.encoder}.png", f"{args.encoder}")
    print(json.dumps(data, indent=1))
    return 0
