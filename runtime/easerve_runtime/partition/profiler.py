"""The table profiler: encode latency at each SM level and batch, turned into a knee table.

Each point is a CUDA graph of the encoder captured on the level's own green-context stream and
timed with device events (median of ``reps`` replays), so the number is what the encode worker
will see. With ``carveout`` the graph is captured while ``torch._C._set_sm_carveout_experimental``
tells cuBLAS(Lt) how many SMs it does not have (otherwise it sizes kernels for all 132 and a
partitioned GEMM runs in extra waves); the profiler measures both and keeps, per level, the
faster, recording which it chose so the worker captures its graphs the same way.

The GPU parts import torch inside functions; :func:`table_schema_errors` is pure and is what CI
uses to validate a JSON produced on the device.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from easerve_runtime.policies.partition import TABLE_SCHEMA_VERSION, PartitionTable

log = logging.getLogger(__name__)


def table_schema_errors(data: Mapping[str, Any]) -> list[str]:
    """Everything wrong with a profiler JSON, as ``field: problem`` lines (empty when valid)."""
    errs: list[str] = []
    if data.get("schemaVersion") != TABLE_SCHEMA_VERSION:
        errs.append(f"schemaVersion: expected {TABLE_SCHEMA_VERSION}, got {data.get('schemaVersion')!r}")
    for key, typ in (("encoder", str), ("gpu", str), ("backend", str), ("totalSMs", int), ("epsilon", float)):
        if not isinstance(data.get(key), typ) and not (typ is float and isinstance(data.get(key), int)):
            errs.append(f"{key}: expected {typ.__name__}, got {data.get(key)!r}")
    levels = data.get("levels")
    if not isinstance(levels, list) or not levels:
        errs.append("levels: expected a non-empty list")
        return errs
    lat = data.get("latencyMs")
    if not isinstance(lat, dict):
        errs.append("latencyMs: expected an object {sms: {batch: ms}}")
        lat = {}
    for i, lv in enumerate(levels):
        if (
            not isinstance(lv, dict)
            or not isinstance(lv.get("sms"), int)
            or not isinstance(lv.get("maxBatch"), int)
        ):
            errs.append(f"levels[{i}]: expected {{sms: int, maxBatch: int}}, got {lv!r}")
            continue
        row = lat.get(str(lv["sms"]))
        if lat and row is None:
            errs.append(f"latencyMs.{lv['sms']}: missing for level {i}")
        elif isinstance(row, dict):
            for b, ms in row.items():
                if not (isinstance(ms, int | float) and ms > 0):
                    errs.append(f"latencyMs.{lv['sms']}.{b}: expected a positive number, got {ms!r}")
    if not errs:
        try:
            PartitionTable.from_dict(data)
        except ValueError as exc:
            errs.append(str(exc))
    return errs


def set_carveout(torch: Any, sms_left_out: int | None) -> bool:
    """Tell cuBLAS(Lt) to leave ``sms_left_out`` SMs alone (None: reset). False if unsupported."""
    fn = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if fn is None:
        return False
    fn(sms_left_out if sms_left_out else None)
    return True


def time_replays(torch: Any, launch: Callable[[], None], stream: Any, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``launch()`` on ``stream``, timed with device events."""
    for _ in range(warmup):
        launch()
    stream.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(stream)
        launch()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def profile_latency(
    encoder: Any,
    pool: Any,
    levels: Iterable[int],
    batches: Iterable[int],
    carveout: bool,
    reps: int = 15,
    progress: Callable[[str], None] | None = None,
) -> dict[int, dict[int, float]]:
    """``{sms: {batch: seconds}}`` for a ``GraphedEncoder`` over a ``GreenContextPool``'s levels."""
    import torch

    out: dict[int, dict[int, float]] = {}
    total = pool.total_sms
    for sms in sorted(set(levels) | {total}):
        stream = pool.primary(sms)
        row: dict[int, float] = {}
        for b in batches:
            if carveout and sms < total and not set_carveout(torch, total - sms):
                raise RuntimeError("torch._C._set_sm_carveout_experimental is not available")
            try:
                encoder.capture(b, stream)
            finally:
                set_carveout(torch, None)

            def launch(b: int = b, stream: Any = stream) -> None:
                encoder.run(b, stream)

            row[b] = time_replays(torch, launch, stream, reps)
            if progress:
                progress(
                    f"{'carveout' if carveout else 'default '} {sms:4d} SMs  b{b:<3d} {row[b] * 1e3:8.2f} ms"
                )
        out[sms] = row
    return out


def build_table(
    default: Mapping[int, Mapping[int, float]],
    carve: Mapping[int, Mapping[int, float]] | None,
    total_sms: int,
    epsilon: float,
    **meta: str,
) -> tuple[PartitionTable, dict[int, bool]]:
    """Per level keep the faster of default and carveout (by summed latency); build the table."""
    use_carve: dict[int, bool] = {}
    best: dict[int, dict[int, float]] = {}
    for sms, row in default.items():
        c = (carve or {}).get(sms)
        use = bool(c) and sms != total_sms and sum(c.values()) < sum(row.values())  # type: ignore[union-attr]
        use_carve[sms] = use
        best[sms] = dict(c) if use and c else dict(row)
    return PartitionTable.from_latencies(total_sms, best, epsilon=epsilon, **meta), use_carve


def write_table(table: PartitionTable, use_carve: Mapping[int, bool], path: Path) -> dict[str, Any]:
    data = table.to_dict()
    data["carveout"] = {str(k): v for k, v in sorted(use_carve.items())}
    path.write_text(json.dumps(data, indent=1))
    return data


def plot_curves(
    series: Mapping[str, Mapping[int, Mapping[int, float]]], total_sms: int, path: Path, title: str
) -> None:
    """Latency (relative to the full GPU) vs SMs, one line per (series, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, lat in series.items():
        style = "-" if name == "default" else "--"
        batches = sorted(next(iter(lat.values())))
        for b in batches:
            xs = sorted(lat)
            ys = [lat[s][b] * 1e3 for s in xs]
            axes[0].plot(xs, ys, style, marker="o", label=f"{name} b{b}")
            axes[1].plot(
                xs, [y / (lat[total_sms][b] * 1e3) for y in ys], style, marker="o", label=f"{name} b{b}"
            )
    axes[0].set_ylabel("latency (ms)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("latency / full-GPU latency")
    axes[1].axhline(1.1, color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xlabel("SMs")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
