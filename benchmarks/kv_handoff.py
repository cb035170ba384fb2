"""One request's KV handoff between two processes on one GPU: the host path against CUDA IPC.

Why: on one H100 shared by the pods, the host path (the prefill's device-to-host copy into a
same-host blob, then decode's pinned host-to-device copy) took 101-146 ms on the prefill side
and 31-64 ms on the decode side for a 330 MB cache (GPU run 27). ``engines.kv_ipc`` lets decode
map the prefill's tensor and copy it device to device instead. This measures both paths side by
side in one run, with the engine's own pieces: ``hf.deferred_pack`` and ``HostBlobs`` then
``hf.host_kv_to_device`` (the decode engine's staging copy) for the host path;
``kv_ipc.deferred_share`` and ``kv_ipc.open_shared`` into a staging buffer for IPC. Each time is
from the producer's start (the cache ready on its device) to the consumer's copy done on its
device (``time.perf_counter``: one clock for both processes on Linux).

    python benchmarks/kv_handoff.py --out DIR            # 330 MB (LLaVA-NeXT 7B, 2,560 tokens), 10 reps
    python benchmarks/kv_handoff.py --tokens 1024 --reps 5

Needs CUDA (prints ``{"skipped": ...}`` without); prints one JSON object, writes
OUT/kv_handoff.json and OUT/kv_handoff.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Mistral-7B's cache (LLaVA-NeXT 7B): 128 KiB a token in bf16


def _producer(conn: Any, tokens: int, reps: int, blob_dir: str) -> None:
    import torch
    from easerve_runtime.engines import kv_ipc
    from easerve_runtime.engines.hf import deferred_pack, kv_meta
    from easerve_runtime.workers.blobs import HostBlobs

    blobs = HostBlobs(blob_dir)
    base = torch.randn(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM, device="cuda").to(torch.bfloat16)
    conn.send(kv_meta(base))
    for path in ("host", "ipc") * reps:
        kv = base.clone()
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        t0 = time.perf_counter()
        held = [kv]
        del kv
        if path == "host":
            name = blobs.put_sync(deferred_pack(None, ready, held)())
            conn.send({"path": path, "t0": t0, "blob": name, "sent": time.perf_counter()})
            conn.recv()
        else:
            desc, answered = kv_ipc.deferred_share(held, ready)()
            conn.send({"path": path, "t0": t0, "desc": desc, "sent": time.perf_counter()})
            answered(conn.recv() == "taken")
    conn.send(None)


def _consume(msg: dict[str, Any], meta: dict[str, Any], blobs: Any, buf: Any, stream: Any) -> None:
    import threading

    import torch
    from easerve_runtime.engines import kv_ipc
    from easerve_runtime.engines.hf import host_kv_to_device

    if msg["path"] == "host":  # the decode engine's own staging: mapped take, pinned copy, side-stream load
        host_kv_to_device(blobs.take_sync(msg["blob"], mapped=True), meta, dtype=torch.bfloat16, device="cuda",
                          stream=stream, lock=threading.Lock(), dst=buf)
    else:
        kv_ipc.open_shared(msg["desc"], "cuda", dst=buf)


def run(tokens: int, reps: int) -> dict[str, Any]:
    import torch
    from easerve_runtime.workers.blobs import HostBlobs

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        proc = ctx.Process(target=_producer, args=(there, tokens, reps, d))
        proc.start()
        meta = here.recv()
        blobs = HostBlobs(d)
        n = 1
        for x in meta["shape"]:
            n *= int(x)
        buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        times: dict[str, list[float]] = {"host": [], "ipc": []}
        sides: dict[str, list[float]] = {"host": [], "ipc": []}
        while (msg := here.recv()) is not None:
            _consume(msg, meta, blobs, buf, stream)
            done = time.perf_counter()
            times[msg["path"]].append(1e3 * (done - msg["t0"]))
            sides[msg["path"]].append(1e3 * (msg["sent"] - msg["t0"]))
            here.send("taken")
            print(f"  {msg['path']}: {times[msg['path']][-1]:.1f} ms", file=sys.stderr, flush=True)
        proc.join(30)
    mb = n * 2 / 1e6
    out: dict[str, Any] = {"measured": "GPU", "gpu": torch.cuda.get_device_name(), "tokens": tokens,
                           "cache_mb": round(mb, 1), "reps": reps}
    for path in ("host", "ipc"):
        t = times[path][1:] or times[path]  # the first of each path warms allocators and mappings
        out[path] = {"ms_median": round(statistics.median(t), 2), "ms_min": round(min(t), 2),
                     "ms_max": round(max(t), 2), "producer_ms_median": round(statistics.median(sides[path][1:] or
                                                                                                  sides[path]), 2)}
    out["host_over_ipc"] = round(out["host"]["ms_median"] / max(1e-9, out["ipc"]["ms_median"]), 1)
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["host path", "CUDA IPC"]
    vals = [res["host"]["ms_median"], res["ipc"]["ms_median"]]
    ax.bar(names, vals, color=["#999999", "#2a7ab0"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f} ms", ha="center", va="bottom")
    ax.set_ylabel("handoff, ms (median)")
    ax.set_title(f"KV handoff of {res['cache_mb']:.0f} MB on one {res['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2560)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the two paths are GPU paths"}))
        return 0
    res = run(args.tokens, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_handoff.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, args.out / "kv_handoff.png")
    except ImportError:
        res["plot"] = "matplotlib missing"
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
