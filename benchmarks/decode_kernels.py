"""Where a decode step's GPU time goes, kernel by kernel: our graph-replayed step against the library's.

Why: on the H200 our graph-replayed decode step (``HFDecodeEngine``, LLaVA-NeXT 7B backbone,
context 2048) costs 9.15 / 11.7 / 21.9 ms at batch 1 / 32 / 128 against 6.95 / 9.66 / 16.0 ms
for HF transformers with a static cache and CUDA graphs; ``gpu_engine.py`` showed the gap lies
inside the replayed graph. This benchmark profiles both graphs with ``torch.profiler`` and lists,
per batch, the kernels (and kernel categories) on which ours spends more than the reference.

Per batch ``b`` (``--batches``), on random weights from ``easerve model init --size 7b``:

- **ours**: ``HFDecodeEngine`` slots filled at context ``C`` (``gpu_engine.fill_slots``), one
  engine step run so the graph for (bucket b, K/V length bucket) is captured; then the replay
  alone is timed (CUDA events, median of ``--steps``) and ``--profile-steps`` replays profiled.
  Variants, timed only (``--no-variants`` skips them): ``slot_masked_sdpa`` (our folded
  attention through SDPA under the per-row mask: the decode kernel before the split-KV one),
  ``stock_sdpa`` (the library's own SDPA
  attention with our 4-D mask: ``repeat_kv`` + a masked kernel) and ``gqa_nomask`` (the
  library's SDPA with the mask dropped, so it takes ``enable_gqa`` and the flash kernel; the
  rows attend the whole K/V bucket: a timing what-if, not a correct step for mixed lengths).
- **ref**: the same language model class and weights shape (``load_stage(dir, "lm")``), one
  token per sequence over transformers' ``StaticCache`` (``max_cache_len`` = ``--ref-cache-len``,
  default C + 16) filled to C with random K/V, captured in a CUDA graph with static input and
  position ids, the library's default ``sdpa`` attention. In transformers 5.17 a static cache
  decoding one token always gets a materialized mask, so that attention runs ``repeat_kv`` and a
  masked kernel; ``ref_gqa`` is the same graph with the mask dropped (``enable_gqa``, flash),
  which is what a static-cache decode without a mask costs. Both are reported; ``diff`` is
  against ``ref``, ``diff_vs_ref_gqa`` against ``ref_gqa``. Before each replay the cache's
  length counters (one tensor for all layers here) are reset to C with one fill kernel, which
  the ref profiles count.

Ours is measured first and freed (weights, 128 slots of K/V, graphs) before the reference is
built. Output (``--out``, default ``$OUT`` or ``benchmarks/out``): ``decode_kernels.json``,
rewritten after every measurement so a run cut short keeps what it measured, and
``decode_kernels.png`` (per batch, GPU ms per step by kernel category, ours beside the refs).
The JSON is printed at the end.

    PYTHONPATH=runtime python3 benchmarks/decode_kernels.py --out $OUT          # H200: ~2 min
    PYTHONPATH=runtime python3 benchmarks/decode_kernels.py --smoke --out /tmp/dk   # CPU, tiny model

Memory on the GPU at the default batches (1 32 128): 7B bf16 weights ~14.5 GB, ours' slots
128 x 2,304 tokens x 128 KiB = 36 GiB (freed before the reference), the reference's static cache
at b128 128 x 2,064 x 128 KiB = 32 GiB, plus transient ``repeat_kv`` copies (~2.3 GB per K and V
at b128); peak ~55 GB. With ``--smoke`` everything runs eagerly on the CPU (no graphs, CPU op
times instead of kernels): it exercises the code, it measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import gpu_engine as ge  # noqa: E402  (benchmarks/ is no package: its helpers are imported by path)

CATEGORIES = ("gemm/matmul", "attention", "elementwise/copy/index", "norm", "rotary", "softmax/sampling", "other")
NOMASK_ATTENTION = "bench_sdpa_gqa_nomask"
T_START = time.perf_counter()
TOP = 15
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|attn")),
    ("gemm/matmul", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|aten::(mm|bmm|addmm|matmul|linear|baddbmm)\b")),
    ("softmax/sampling", re.compile(r"softmax|argmax|topk|sort|multinomial|cumsum")),
    ("norm", re.compile(r"rsqrt|pow_tensor|meanops|mean_kernel|norm|aten::(pow|mean|rsqrt)\b")),
    ("rotary", re.compile(r"\bcos_|sin_kernel|\bneg_|neg_kernel|catarray|rotary|rope|aten::(cos|sin|neg|cat)\b")),
    ("elementwise/copy/index", re.compile(r"elementwise|index|copy|memcpy|memset|fill|scatter|gather|where|masked|"
                                          r"reduce|compare|silu|mul|add|aten::")),
)


def category(name: str) -> str:
    """The kernel (or, on the CPU, aten op) category of ``name``, by the first rule that matches."""
    n = name.lower()
    for cat, rx in _RULES:
        if rx.search(n):
            return cat
    return "other"


def short(name: str, width: int = 160) -> str:
    """A kernel name short enough to read: template noise out, the op's own name kept near the front."""
    s = name.removeprefix("void ")
    for noise in ("at::native::", "(anonymous namespace)::", "at::detail::", "c10::", "std::"):
        s = s.replace(noise, "")
    return s if len(s) <= width else s[: width - 3] + "..."


def cuda() -> bool:
    return ge.DEVICE.startswith("cuda")


class Saver:
    """The JSON, rewritten after every measurement (a run cut short keeps what it measured)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"env": {}, "config": {}, "batches": {}}

    def batch(self, b: int) -> dict[str, Any]:
        return self.data["batches"].setdefault(f"b{b}", {})

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "decode_kernels.json").write_text(json.dumps(self.data, indent=1, default=str))


# ------------------------------------------------------------------------------ measuring
def time_ms(fn: Callable[[], Any], n: int, pre: Callable[[], Any] | None = None) -> float:
    """Median ms of ``fn`` over ``n`` runs (3 warm-up): CUDA events around ``fn`` alone on a GPU
    (``pre`` runs outside them), wall time on the CPU."""
    import torch

    if not cuda():
        lat = []
        for _ in range(n + 3):
            if pre:
                pre()
            t0 = time.perf_counter()
            fn()
            lat.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(lat[3:])
    evs = []
    for _ in range(n + 3):
        if pre:
            pre()
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        evs.append((a, z))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(z) for a, z in evs[3:])


def capture(fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
    """``fn`` as a CUDA graph (two warm-up runs on a side stream first, as ``HFDecodeEngine._capture``):
    (replay, graph); on the CPU (fn, None)."""
    import torch

    if not cuda():
        fn()
        return fn, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay, g


def _attr(e: Any, *names: str) -> float:
    for n in names:
        v = getattr(e, n, None)
        if v is not None:
            return float(v)
    return 0.0


def device_table(events: Any, steps: int) -> dict[str, tuple[float, float]]:
    """Per GPU kernel / memcpy / memset name among profiler ``events``: (ms per step, calls per step)."""
    from torch.autograd import DeviceType

    sums: dict[str, list[float]] = {}
    for e in events:
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            acc = sums.setdefault(e.name, [0.0, 0.0])
            acc[0] += float(e.time_range.elapsed_us())
            acc[1] += 1
    return {n: (us / 1e3 / steps, calls / steps) for n, (us, calls) in sums.items()}


def profile(fn: Callable[[], Any], steps: int, pre: Callable[[], Any] | None = None) -> dict[str, tuple[float, float]]:
    """Per kernel name (on the CPU: per aten op, self time): (ms per step, calls per step) over ``steps`` runs."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    ge.sync()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            if pre:
                pre()
            fn()
        ge.sync()
    table = device_table(prof.events(), steps)
    if sum(ms for ms, _ in table.values()) > 0:
        return table
    table = {}  # the CPU (or no device event seen): aten ops' self time
    for a in prof.key_averages():
        if a.key.startswith("aten::") and _attr(a, "self_cpu_time_total") > 0:
            table[a.key] = (_attr(a, "self_cpu_time_total") / 1e3 / steps, a.count / steps)
    return table


def summarize(table: dict[str, tuple[float, float]]) -> dict[str, Any]:
    cats: dict[str, dict[str, float]] = {c: {"ms": 0.0, "calls": 0.0} for c in CATEGORIES}
    for name, (ms, calls) in table.items():
        c = cats[category(name)]
        c["ms"] += ms
        c["calls"] += calls
    top = sorted(table.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {
        "kernel_ms_per_step": round(sum(ms for ms, _ in table.values()), 3),
        "kernel_calls_per_step": round(sum(c for _, c in table.values()), 1),
        "categories": {c: {"ms": round(v["ms"], 3), "calls": round(v["calls"], 1)} for c, v in cats.items()},
        "top": [{"name": short(n), "cat": category(n), "ms": round(ms, 4), "calls": round(c, 2)}
                for n, (ms, c) in top],
    }


def diff(ours: dict[str, tuple[float, float]], ref: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Categories and kernels on which ours spends more than ``ref`` (ms and extra calls per step)."""
    def by_cat(t: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        out = {c: (0.0, 0.0) for c in CATEGORIES}
        for n, (ms, calls) in t.items():
            c = category(n)
            out[c] = (out[c][0] + ms, out[c][1] + calls)
        return out

    co, cr = by_cat(ours), by_cat(ref)
    cats: list[dict[str, Any]] = [{"category": c, "extra_ms": round(co[c][0] - cr[c][0], 3), "ours_ms": round(co[c][0], 3),
             "ref_ms": round(cr[c][0], 3), "extra_calls": round(co[c][1] - cr[c][1], 1)}
            for c in CATEGORIES if co[c][0] - cr[c][0] > 0.001]
    kernels: list[dict[str, Any]] = []
    for n in set(ours) | set(ref):
        (mo, no), (mr, nr) = ours.get(n, (0.0, 0.0)), ref.get(n, (0.0, 0.0))
        if mo - mr > 0.002:
            kernels.append({"name": short(n), "cat": category(n), "extra_ms": round(mo - mr, 4), "ours_ms": round(mo, 4),
                            "ref_ms": round(mr, 4), "extra_calls": round(no - nr, 2)})
    fewer = [{"name": short(n), "cat": category(n), "ms": round(mr, 4), "calls": round(nr, 2)}
             for n, (mr, nr) in sorted(ref.items(), key=lambda kv: -kv[1][0]) if n not in ours][:10]
    return {"categories": sorted(cats, key=lambda x: -x["extra_ms"]),
            "kernels": sorted(kernels, key=lambda x: -x["extra_ms"])[:25],
            "ref_only_kernels": fewer,
            "total_extra_ms": round(sum(m for m, _ in ours.values()) - sum(m for m, _ in ref.values()), 3)}


def measure(name: str, fn: Callable[[], Any], args: argparse.Namespace, pre: Callable[[], Any] | None = None,
            eager: Callable[[], Any] | None = None) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    """Time ``fn`` (a replay), profile it; if the profile of the replay caught too little GPU time
    (a profiler that does not see inside graphs), profile ``eager`` (the same step un-captured) instead."""
    ms = time_ms(fn, args.steps, pre)
    res: dict[str, Any] = {"step_ms": round(ms, 3), "profile_mode": "graph" if cuda() else "cpu-eager"}
    table: dict[str, tuple[float, float]] = {}
    try:
        table = profile(fn, args.profile_steps, pre)
    except Exception as exc:  # noqa: BLE001 - keep the timing; try the eager profile
        res["profile_error"] = repr(exc)[:300]
    if cuda() and eager is not None and sum(m for m, _ in table.values()) < 0.5 * ms:
        res["profile_mode"] = f"eager (the replay's profile caught {sum(m for m, _ in table.values()):.2f} ms)"
        table = profile(eager, args.profile_steps, pre)
    res.update(summarize(table))
    res["profiled_share_of_step"] = round(res["kernel_ms_per_step"] / ms, 3) if ms else None
    ge.log(f"{name}: step {ms:.3f} ms, kernels {res['kernel_ms_per_step']} ms / {res['kernel_calls_per_step']} calls "
           f"per step ({res['profile_mode']})")
    return res, table


def _nomask_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """The library's SDPA attention with the mask dropped: it then takes ``enable_gqa`` (flash on a GPU)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def register_nomask() -> None:
    """Registered as an attention function only (no mask function): the mask builder then returns None."""
    from transformers import AttentionInterface

    AttentionInterface.register(NOMASK_ATTENTION, _nomask_attention)


# ------------------------------------------------------------------------------ ours
def run_ours(args: argparse.Namespace, d: Path, r: Saver, tables: dict[tuple[str, int], Any]) -> None:
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    eng = HFDecodeEngine(d, device=ge.DEVICE, random_weights=True, max_len=args.max_len, max_slots=max(args.batches),
                         memory_fraction=0.9, stage_buffers=0)
    kv_len = hf.kv_bucket(args.context + 1, eng.max_len)
    r.data["config"].update(ours_slots=eng.slots, ours_max_len=eng.max_len, ours_kv_len=kv_len,
                            ours_attention=hf.SLOT_ATTENTION, ours_decode_kernel=hf._decode_kernel)
    ge.log(f"ours: engine built, {eng.slots} slots x {eng.max_len} tokens, K/V bucket {kv_len}")
    for b in args.batches:
        try:
            _ours_batch(args, eng, kv_len, b, r, tables)
        except Exception as exc:  # noqa: BLE001 - keep the other batches
            traceback.print_exc()
            r.batch(b)["ours_error"] = repr(exc)[:500]
        eng._graphs.clear()
        r.save()
    eng.K = eng.V = None  # the slots go with this frame: the reference needs the memory
    eng.k.clear()
    eng.v.clear()


def _ours_batch(args: argparse.Namespace, eng: Any, kv_len: int, b: int, r: Saver,
                tables: dict[tuple[str, int], Any]) -> None:
    import torch
    from easerve_runtime.engines import hf

    ctx, row = args.context, r.batch(b)
    lm_cfg = eng.model.model.language_model.config
    seqs = ge.fill_slots(eng, b, ctx)
    eng.cuda_graphs = cuda()
    eng._graphs.clear()
    engine_ms = ge._steps(eng, seqs, min(args.steps, 10), ctx)  # on a GPU: captures (bucket b, kv_len)
    ids = torch.tensor([s.generated[-1] for s in seqs], device=ge.DEVICE)
    pos = torch.full((b,), ctx, dtype=torch.long, device=ge.DEVICE)

    def eager() -> Any:
        with torch.inference_mode():
            return eng._forward(ids, pos, b, kv_len)

    def replay() -> Callable[[], Any]:
        """The captured step's replay at (ids, pos), or the eager step on the CPU."""
        if not cuda():
            return eager
        if (eng._bucket(b), kv_len) not in eng._graphs:
            raise RuntimeError(f"no graph captured for b{b} (engine graphs: {eng.cuda_graphs})")
        g, st = eng._graphs[(eng._bucket(b), kv_len)]
        with torch.inference_mode():  # the engine made its static buffers under inference mode
            st["ids"][:b] = ids
            st["pos"][:b] = pos
            if "rope" in st:
                st["rope"][:b] = pos
        return g.replay

    res, table = measure(f"ours b{b}", replay(), args, eager=eager)
    res["engine_step_ms"] = round(engine_ms, 3)  # _step_sync: host work + replay + sampling
    if cuda():
        res["replay_wall_ms"] = round(ge._replay_ms(eng, b, kv_len, args.steps), 3)
    row["ours"] = res
    tables[("ours", b)] = table
    r.save()
    if args.no_variants:
        return
    if time.perf_counter() - T_START > args.variants_until_s:
        ge.log(f"ours b{b}: variants skipped ({args.variants_until_s:.0f} s gone: the reference goes first)")
        row["ours_variants"] = {"skipped": f"past {args.variants_until_s:.0f} s of the run"}
        return
    var: dict[str, Any] = {}
    kernel = hf._decode_kernel
    for vname, impl, kern in (("slot_masked_sdpa", hf.SLOT_ATTENTION, "sdpa"), ("stock_sdpa", "sdpa", kernel),
                              ("gqa_nomask", NOMASK_ATTENTION, kernel)):
        try:
            lm_cfg._attn_implementation = impl
            hf.set_decode_attention_kernel(kern)
            eng._graphs.clear()
            eng.cuda_graphs = cuda()
            ge._steps(eng, ge.fill_slots(eng, b, ctx), 1, ctx)  # captures the variant's graph
            var[vname] = round(time_ms(replay(), args.steps), 3)
        except Exception as exc:  # noqa: BLE001 - one variant failing keeps the rest
            traceback.print_exc()
            var[vname] = {"error": repr(exc)[:300]}
        finally:
            lm_cfg._attn_implementation = hf.SLOT_ATTENTION
            hf.set_decode_attention_kernel(kernel)
            eng._graphs.clear()
        ge.log(f"ours b{b} variant {vname}: {var[vname]} ms")
    var["note"] = ("replay ms with the decode attention swapped: slot_masked_sdpa = our folded GQA attention "
                   "through SDPA under the per-row mask (the kernel before split-KV); stock_sdpa = the library's SDPA with our 4-D mask "
                   "(repeat_kv + masked kernel); gqa_nomask = the library's SDPA without a mask (enable_gqa, flash; "
                   "attends the whole bucket: timing only)")
    row["ours_variants"] = var
    r.save()


# ------------------------------------------------------------------------------ reference
def run_ref(args: argparse.Namespace, d: Path, r: Saver, tables: dict[tuple[str, int], Any]) -> None:
    from easerve_runtime.models.loading import load_stage

    loaded = load_stage(d, "lm", device=ge.DEVICE, random_weights=True)
    impl = loaded.model.model.language_model.config._attn_implementation
    r.data["config"].update(ref_cache_len=args.ref_cache_len, ref_attention=impl)
    ge.log(f"ref: model built ({impl}), static cache of {args.ref_cache_len} tokens")
    for b in args.batches:
        try:
            _ref_batch(args, loaded, b, r, tables)
        except Exception as exc:  # noqa: BLE001 - keep the other batches
            traceback.print_exc()
            r.batch(b)["ref_error"] = repr(exc)[:500]
        gc.collect()  # the batch's static cache and graphs
        ge.empty_cache()
        compare(r, tables, b)


def _ref_batch(args: argparse.Namespace, loaded: Any, b: int, r: Saver, tables: dict[tuple[str, int], Any]) -> None:
    import torch
    from transformers import StaticCache

    ctx, row = args.context, r.batch(b)
    lm, head = loaded.model.model.language_model, loaded.model.lm_head
    cfg = loaded.text_config
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    cache = StaticCache(config=cfg, max_cache_len=args.ref_cache_len)
    cache.early_initialization(b, kv_heads, head_dim, loaded.dtype, torch.device(ge.DEVICE))
    lengths = torch.full((len(cache.layers),), ctx, dtype=torch.long, device=ge.DEVICE)
    layer: Any
    for i, layer in enumerate(cache.layers):  # one tensor holds every layer's length: reset in one kernel
        layer.cumulative_length = lengths[i]
        layer.keys[:, :, :ctx].normal_()
        layer.values[:, :, :ctx].normal_()
    ids = torch.full((b, 1), 5, dtype=torch.long, device=ge.DEVICE)
    pos = torch.full((b, 1), ctx, dtype=torch.long, device=ge.DEVICE)

    def reset() -> None:
        lengths.fill_(ctx)

    def eager() -> Any:
        with torch.inference_mode():
            h = lm(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
            return head(h[:, -1])

    default_impl = lm.config._attn_implementation
    for side, impl in (("ref", default_impl), ("ref_gqa", NOMASK_ATTENTION)):
        if side == "ref_gqa" and args.no_variants:
            continue
        try:
            lm.config._attn_implementation = impl
            reset()
            fn, g = capture(eager)
            res, table = measure(f"{side} b{b}", fn, args, pre=reset, eager=eager)
            res["graph"] = g is not None
            row[side] = res
            tables[(side, b)] = table
            del fn, g
        except Exception as exc:  # noqa: BLE001 - keep the other side
            traceback.print_exc()
            row[f"{side}_error"] = repr(exc)[:500]
        finally:
            lm.config._attn_implementation = default_impl
        r.save()


def compare(r: Saver, tables: dict[tuple[str, int], Any], b: int) -> None:
    row = r.batch(b)
    ours = row.get("ours", {}).get("step_ms")
    step: dict[str, Any] = {"ours": ours}
    for side, key in (("ref", "ratio"), ("ref_gqa", "ratio_vs_ref_gqa")):
        ms = row.get(side, {}).get("step_ms")
        step[side] = ms
        step[key] = round(ours / ms, 3) if ours and ms else None
    anchors = cast("dict[int, float]", ge.REF["decode_ms"])
    step["anchor_ref_ms"] = anchors.get(b)
    step["ratio_vs_anchor"] = round(ours / step["anchor_ref_ms"], 3) if ours and step["anchor_ref_ms"] else None
    row["step_ms"] = step
    for side, key in (("ref", "diff"), ("ref_gqa", "diff_vs_ref_gqa")):
        if ("ours", b) in tables and (side, b) in tables:
            row[key] = diff(tables[("ours", b)], tables[(side, b)])
    r.save()
    ge.log(f"b{b}: {step}")


# ------------------------------------------------------------------------------ plot
def plot(r: Saver) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in r.data["batches"].items() if any(s in v for s in ("ours", "ref", "ref_gqa"))]
    if not rows:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4.6), squeeze=False)
    colors = plt.get_cmap("tab10")
    unit = "ms / step" if r.data["env"].get("device", "").startswith("cuda") else "CPU op ms / step (smoke)"
    for ax, (bname, row) in zip(axes[0], rows, strict=True):
        sides = [s for s in ("ours", "ref", "ref_gqa") if s in row]
        for i, side in enumerate(sides):
            bottom = 0.0
            for j, c in enumerate(CATEGORIES):
                v = row[side]["categories"][c]["ms"]
                ax.bar(i, v, 0.6, bottom=bottom, color=colors(j), label=c if i == 0 else None)
                bottom += v
            ax.plot([i - 0.3, i + 0.3], [row[side]["step_ms"]] * 2, "k--", lw=1)
        ax.set_xticks(range(len(sides)), sides)
        ax.set_title(f"{bname} (dashed: timed step)")
        ax.set_ylabel(unit)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"decode step by kernel category, context {r.data['config'].get('context')}")
    fig.tight_layout()
    fig.savefig(r.out / "decode_kernels.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager: exercise the code, measure nothing")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 32 128 (smoke: 1 4)")
    ap.add_argument("--context", type=int, default=None, help="tokens in every slot (default 2048; smoke 64)")
    ap.add_argument("--max-len", type=int, default=None, help="our slot length (default context + 256, as gpu_engine)")
    ap.add_argument("--ref-cache-len", type=int, default=None, help="the StaticCache length (default context + 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed replays, median (default 20; smoke 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled replays (default 5; smoke 2)")
    ap.add_argument("--no-variants", action="store_true", help="skip ours' attention variants and ref_gqa")
    ap.add_argument("--variants-until-s", type=float, default=120.0,
                    help="ours' attention variants run only this long into the run (the reference must fit the call)")
    ap.add_argument("--model", default=None, help="a model directory (default: gpu_engine.model_dir, 7b or tiny)")
    args = ap.parse_args(argv)
    if args.smoke:
        ge.DEVICE = "cpu"
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 32, 128])
    args.context = args.context or (64 if args.smoke else 2048)
    args.max_len = args.max_len or args.context + 256
    args.ref_cache_len = args.ref_cache_len or args.context + 16
    args.steps = args.steps or (3 if args.smoke else 20)
    args.profile_steps = args.profile_steps or (2 if args.smoke else 5)
    import torch
    import transformers

    global T_START
    T_START = t_start = time.perf_counter()
    r = Saver(Path(args.out))
    r.data["env"] = {"torch": torch.__version__, "transformers": transformers.__version__, "device": ge.DEVICE,
                     "argv": sys.argv[1:] if argv is None else argv}
    if cuda():
        r.data["env"]["gpu"] = torch.cuda.get_device_name(0)
    r.data["config"] = {"context": args.context, "batches": args.batches, "steps": args.steps,
                        "profile_steps": args.profile_steps, "anchor_ref_ms": ge.REF["decode_ms"]}
    r.data["note"] = ("ms are GPU kernel ms per step from torch.profiler (CPU: aten self time), calls are per step; "
                      "categories come from kernel names (benchmarks/decode_kernels.py: category); step_ms are "
                      "CUDA-event medians of the replay alone. ratio = ours / ref (library default sdpa over a "
                      "StaticCache), ratio_vs_ref_gqa = ours / the same without a mask (enable_gqa), "
                      "ratio_vs_anchor = ours / the reference figures in docs (gpu_engine.REF).")
    ge.log(f"env: {r.data['env']} config: {r.data['config']}")
    d = Path(args.model) if args.model else ge.model_dir(Path(args.out))
    r.data["config"]["model"] = str(d)
    register_nomask()
    tables: dict[tuple[str, int], Any] = {}
    for side, run in (("ours", run_ours), ("ref", run_ref)):
        t0 = time.perf_counter()
        try:
            run(args, d, r, tables)
        except Exception as exc:  # noqa: BLE001 - keep the other side
            traceback.print_exc()
            r.data[f"{side}_error"] = repr(exc)[:500]
        gc.collect()
        ge.empty_cache()
        r.data["config"][f"{side}_s"] = round(time.perf_counter() - t0, 1)
        if cuda():
            r.data["config"][f"after_{side}_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            r.data["config"][f"{side}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        r.save()
        ge.log(f"{side} done in {r.data['config'][f'{side}_s']} s")
    r.data["config"]["total_s"] = round(time.perf_counter() - t_start, 1)
    r.save()
    try:
        plot(r)
    except Exception:  # noqa: BLE001 - the JSON is what matters
        traceback.print_exc()
    print(json.dumps(r.data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
