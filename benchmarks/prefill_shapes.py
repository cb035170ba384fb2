"""Why a prefill at a new prompt length costs twice a repeat: the first call of each shape, per
attention backend and for the MLP's matmul (issue 17; the engine profile of run 11 measured the
7B prefill at 125 ms on the first call of each length against 65 ms repeated).

Served prompts seldom repeat a length (the image workload's prompts are 1,480-2,560 tokens), so
whatever a new shape costs once is paid on nearly every request. This times, on the device, for
``--lengths`` distinct lengths in a LLaVA-NeXT 7B backbone's shapes (32 query heads over 8 KV
heads of 128, hidden 4096, MLP 14336, bf16):

- causal ``scaled_dot_product_attention`` with torch's own choice and with each backend forced
  (flash, cuDNN, memory-efficient): the first call at each length, then a repeat;
- the MLP's up-projection (``L x 4096 @ 4096 x 14336``): first call and repeat.

Prints one JSON object (medians over the lengths, ms) and writes it to ``--out``. ``--plot JSON``
(anywhere) draws first-call against repeat per variant.

    python3 benchmarks/prefill_shapes.py --out $OUT/prefill_shapes.json      # GPU machine
    python benchmarks/prefill_shapes.py --plot benchmarks/results/prefill_shapes_h200_run11.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 32, 8, 128, 4096, 14336


def _timed(fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(lengths: list[int]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    backends: dict[str, list[Any] | None] = {
        "default": None, "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    }
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "lengths": lengths,
                           "variants": {}}
    warm = torch.randn(1, HEADS, 64, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    for name, allowed in backends.items():
        first, again, err = [], [], None
        # a length of its own per variant, so no variant inherits another's first call
        offset = 1 + list(backends).index(name)
        try:
            for n in lengths:
                n += offset
                q = torch.randn(1, HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)

                def call(q: Any = q, k: Any = k, v: Any = v, allowed: Any = allowed) -> None:
                    if allowed is None:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        with sdpa_kernel(allowed):
                            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                if not first:  # the variant's own warm-up, at a length no timed call uses
                    w = warm[:, :KV_HEADS]
                    with sdpa_kernel(allowed) if allowed else _null():
                        F.scaled_dot_product_attention(warm, w, w, is_causal=True, enable_gqa=True)
                first.append(_timed(call))
                again.append(_timed(call))
        except RuntimeError as exc:  # a backend that does not take these shapes on this device
            err = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["variants"][f"sdpa:{name}"] = _summary(first, again, err)
    w_up = torch.randn(HIDDEN, FFN, device=dev, dtype=torch.bfloat16)
    first, again = [], []
    for n in lengths:
        x = torch.randn(n + 7, HIDDEN, device=dev, dtype=torch.bfloat16)
        first.append(_timed(lambda x=x: x @ w_up))
        again.append(_timed(lambda x=x: x @ w_up))
    out["variants"]["matmul:up"] = _summary(first, again, None)
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _summary(first: list[float], again: list[float], err: str | None) -> dict[str, Any]:
    if not first:
        return {"error": err}
    return {"first_ms_median": round(statistics.median(first), 3), "repeat_ms_median": round(statistics.median(again), 3),
            "first_over_repeat": round(statistics.median(a / b for a, b in zip(first, again, strict=False)), 2),
            "first_ms": [round(x, 3) for x in first], "repeat_ms": [round(x, 3) for x in again],
            **({"error": err} if err else {})}


def plot(path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    names = [k for k, v in d["variants"].items() if "first_ms_median" in v]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [d["variants"][n]["first_ms_median"] for n in names], 0.4, label="first call at a length")
    ax.bar([x + 0.2 for x in xs], [d["variants"][n]["repeat_ms_median"] for n in names], 0.4, label="repeat")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("ms (median over lengths)")
    ax.set_title(f"7B prefill shapes, first call vs repeat ({d['device']}, measured)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--lengths", type=int, default=12, help="distinct prompt lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, metavar="JSON", help="draw a measured JSON (no GPU)")
    ap.add_argument("--png", default="docs/img/prefill_shapes.png")
    args = ap.parse_args(argv)
    if args.plot:
        plot(Path(args.plot), Path(args.png))
        print(f"wrote {args.png}", file=sys.stderr)
        return 0
    rng = random.Random(args.seed)
    lengths = sorted(rng.sample(range(1400, 2600, 10), args.lengths))
    res = measure(lengths)
    text = json.dumps(res)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
