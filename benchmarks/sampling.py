"""GPU time of one decode step's sampling: the one-kernel Gumbel argmax against the torch form.

Why: served decode steps on the H200 spent 2.0–2.7 ms of GPU time sampling (``gpu_serve`` run 8,
``decode_loop.sample_gpu_ms``) beside ~11 ms of forward. Both forms draw the same token
(``tests/engines/test_gumbel_argmax.py``); this measures, side by side in one run, what each costs
a step: ``hf.sample_rows_tensor`` between two CUDA events (host launches included, as in the
engine), median of ``--steps``, per number of rows and sampling setting, on logits of the 7B
LLaVA-NeXT vocabulary (32,064).

    PYTHONPATH=runtime python3 benchmarks/sampling.py --out $OUT/sampling      # H200: ~20 s
    PYTHONPATH=runtime python3 benchmarks/sampling.py --smoke --out /tmp/smp   # CPU: exercises the code

Prints one JSON object and writes ``sampling.json`` and ``sampling.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

SETTINGS = {"temperature 1": (1.0, 1.0), "temperature 0.7, top-p 0.9": (0.7, 0.9), "greedy": (0.0, 1.0)}


def time_ms(fn: Any, steps: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        fn()
    out = []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="default 1 8 32 128 (smoke: 1 4)")
    ap.add_argument("--vocab", type=int, default=32064)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU under Triton's interpreter: exercises, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.base import Sampling
    from easerve_runtime.engines.gumbel_argmax import gumbel_argmax

    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    rows_list = args.rows or ([1, 4] if args.smoke else [1, 8, 32, 128])
    vocab = 512 if args.smoke else args.vocab
    steps = 2 if args.smoke else args.steps
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "vocab": vocab,
                           "unit": "ms per step (CUDA events around sample_rows_tensor, median)", "points": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (temp, top_p) in SETTINGS.items():
        for rows in rows_list:
            logits = torch.randn(rows, vocab, device=dev)
            ss = [Sampling(temperature=temp, top_p=top_p, seed=i) for i in range(rows)]
            pos = list(range(rows))
            point: dict[str, Any] = {"setting": name, "rows": rows}
            for form, env in (("torch", "0"), ("fused", "1")):
                os.environ["EASERVE_FUSED_SAMPLING"] = env
                if form == "fused" and not cuda and temp > 0:  # the engine draws fused on CUDA only: call it
                    keys = hf.gumbel_keys([s.seed for s in ss], pos, dev)
                    point[form] = round(time_ms(lambda lg=logits, k=keys: gumbel_argmax(lg, k), steps, cuda), 4)
                else:
                    point[form] = round(time_ms(lambda lg=logits, s=ss, p=pos: hf.sample_rows_tensor(lg, s, p), steps, cuda), 4)
            os.environ["EASERVE_FUSED_SAMPLING"] = "1"
            point["torch_over_fused"] = round(point["torch"] / point["fused"], 2) if point["fused"] else None
            res["points"].append(point)
            print(json.dumps(point), flush=True)
            (out / "sampling.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "sampling.png")
    print(json.dumps(res))
    return 0


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(p["setting"] for p in res["points"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
    for ax, name in zip(axes[0], settings, strict=True):
        pts = [p for p in res["points"] if p["setting"] == name]
        xs = [p["rows"] for p in pts]
        for form in ("torch", "fused"):
            ax.plot(xs, [p[form] for p in pts], marker="o", label=form)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("rows sampled in the step")
        ax.set_ylabel(res["unit"].split(" (")[0])
        ax.legend()
    fig.suptitle(f"sampling one decode step, {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
