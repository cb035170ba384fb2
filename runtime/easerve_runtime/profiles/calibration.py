"""Derive the scaling constants from the H200 measurements, once, at import.

Nothing here is a free parameter: every constant below is solved from ``data/h200_anchors.json``
(docs/profiles.md walks through each fit), so re-measuring and editing the JSON re-calibrates
every profile. The constants are per-hardware-neutral efficiencies (fractions of peak FLOP/s or
bandwidth), which ``Profile`` then applies to other GPUs' datasheet peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from easerve_runtime.profiles.curves import Curve, cummax
from easerve_runtime.profiles.hardware import Backbone, backbone, gpu, load_json

REF_GPU = "h200"
REF_PREFILL = "llm-34b-class"  # 27–34B backbones are all closer to this than to the 7B one
DECODE_CLASSES = ("llm-7b-class", "llm-34b-class")
LAUNCH_BOUND = 1.2  # eager/graph > this at a batch => the eager time there is the host floor


@dataclass(frozen=True)
class EncoderCalib:
    """H200 encoder curve: GPU work vs batch (seconds) + host costs that do not scale with GPU."""

    compute: Curve  # seconds on the full H200, per batch; linear beyond the last point
    floor_s: float  # eager launch-bound floor (CPU issues ~hundreds of kernels per call)
    overhead_s: float  # eager per-call cost on top of the GPU work at large batch
    max_measured_batch: int


@dataclass(frozen=True)
class Calibration:
    prefill_fraction: Curve  # achieved fraction of peak FLOP/s vs prefill tokens (log2 x)
    floor_per_layer_s: float  # decode: fixed per-layer time per step (small kernels)
    eta_weights: float  # decode: achieved fraction of HBM bandwidth streaming weights
    eta_kv: float  # decode: achieved fraction of HBM bandwidth reading the KV cache
    decode_extra: Curve  # per-step extra vs batch on the 34B/H200 reference (seconds)
    decode_extra_ref_flops: float  # decode FLOPs per token of that reference
    kappa: float  # co-run penalty of a prefill sharing the GPU with an encoder (≤ 1)
    sm_rows: tuple[tuple[float, Curve, float], ...]  # (log2 batch, ratio vs 1/share, min share)
    encoders: dict[str, EncoderCalib]

    def sm_ratio(self, batch: float, share: float) -> float:
        """Encode latency multiplier at ``share`` of the SMs (1.0 at share 1), from the CLIP knee
        table: interpolated in 1/share per measured batch, then in log2(batch) across batches."""
        if share >= 1.0:
            return 1.0
        if not share > 0.0:
            raise ValueError(f"sm_share must be in (0, 1], got {share}")
        lb = math.log2(max(1.0, batch))
        rows = self.sm_rows
        if lb <= rows[0][0]:
            return _row_ratio(rows[0], share)
        if lb >= rows[-1][0]:
            return _row_ratio(rows[-1], share)
        for (x0, c0, m0), (x1, c1, m1) in zip(rows, rows[1:], strict=False):
            if x0 <= lb <= x1:
                w = (lb - x0) / (x1 - x0)
                return (1 - w) * _row_ratio((x0, c0, m0), share) + w * _row_ratio((x1, c1, m1), share)
        return _row_ratio(rows[-1], share)  # pragma: no cover


def _row_ratio(row: tuple[float, Curve, float], share: float) -> float:
    _, curve, smin = row
    if share >= smin:
        return curve(1.0 / share)
    return curve(1.0 / smin) * smin / share  # below the smallest measured partition: ∝ 1/share


def _lsq_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def _ms_table(d: dict[str, float]) -> list[tuple[int, float]]:
    return sorted((int(k), float(v) / 1000.0) for k, v in d.items())


@cache
def calibration() -> Calibration:
    a = load_json("h200_anchors.json")
    ref = gpu(a["gpu"])
    peak, bw = ref.flops_per_s, ref.hbm_bytes_per_s
    bbs = a["backbones"]

    # --- prefill: achieved fraction of peak vs tokens, from the 34B class -------------------
    bb34 = backbone(REF_PREFILL)
    frac_pts = [(t, bb34.prefill_flops(t) / (s * peak)) for t, s in _ms_table(bbs[REF_PREFILL]["prefill_ms"])]
    prefill_fraction = Curve(frac_pts, extrapolate=False, log_x=True)

    # --- decode: KV bandwidth from the context sweeps at batch 32 ---------------------------
    etas = []
    for name in DECODE_CLASSES:
        bb = backbone(name)
        pts = _ms_table(bbs[name]["decode_ms_b32"])
        xs = [32 * bb.kv_bytes(ctx) for ctx, _ in pts]
        slope = _lsq_slope(xs, [s for _, s in pts])  # seconds per byte
        etas.append(1.0 / slope / bw)
    eta_kv = sum(etas) / len(etas)

    # --- decode: per-layer floor and weight-stream efficiency from batch-1 steps -------------
    # t1 = L*f + S/(bw*eta_w) + kv(2048)/(bw*eta_kv) for two backbones -> solve (f, 1/eta_w).
    rows = []
    for name in DECODE_CLASSES:
        bb = backbone(name)
        t1 = float(bbs[name]["decode_ms_ctx2048"]["1"]) / 1000.0
        rows.append((bb.layers, bb.decode_stream_bytes / bw, t1 - bb.kv_bytes(2048) / (bw * eta_kv)))
    (l1, s1, r1), (l2, s2, r2) = rows
    det = l1 * s2 - l2 * s1
    floor_per_layer = (r1 * s2 - r2 * s1) / det
    inv_eta_w = (l1 * r2 - l2 * r1) / det
    eta_w = 1.0 / inv_eta_w

    # --- decode: what batch adds beyond weights + KV (34B reference), made monotone ----------
    base = bb34.layers * floor_per_layer + bb34.decode_stream_bytes / (bw * eta_w)
    ext = []
    for b, s in _ms_table(bbs[REF_PREFILL]["decode_ms_ctx2048"]):
        ext.append((b, max(0.0, s - base - b * bb34.kv_bytes(2048) / (bw * eta_kv))))
    ext[0] = (ext[0][0], 0.0)  # batch 1 is the fit itself
    mono = cummax([e for _, e in ext])
    decode_extra = Curve(list(zip([b for b, _ in ext], mono, strict=True)), extrapolate=True)

    # --- co-location: prefill on a green-context partition next to a running ViT -------------
    co = a["colocation"]
    alone = float(co["prefill_alone_ms"])
    ks = [alone / (float(p["prefill_ms"]) * (p["prefill_sms"] / ref.sms)) for p in co["green_prefill"]]
    kappa = min(1.0, sum(ks) / len(ks))

    # --- SM share curve (CLIP knee table) ---------------------------------------------------
    knee = a["sm_knee"]
    sms_rows = {int(k): v for k, v in knee["sms"].items()}
    full = sms_rows[ref.sms]
    sm_rows = []
    for j, b in enumerate(knee["batches"]):
        knee_pts: list[tuple[float, float]] = [
            (ref.sms / n, sms_rows[n][j] / full[j]) for n in sorted(sms_rows)
        ]
        sm_rows.append((math.log2(b), Curve(knee_pts, extrapolate=False), min(sms_rows) / ref.sms))

    # --- encoders ------------------------------------------------------------------------
    encoders = {name: encoder_calib(tables) for name, tables in a["encoders"].items()}

    return Calibration(
        prefill_fraction=prefill_fraction,
        floor_per_layer_s=floor_per_layer,
        eta_weights=eta_w,
        eta_kv=eta_kv,
        decode_extra=decode_extra,
        decode_extra_ref_flops=bb34.decode_flops_per_token,
        kappa=kappa,
        sm_rows=tuple(sm_rows),
        encoders=encoders,
    )


def encoder_calib(tables: dict[str, dict[str, float]]) -> EncoderCalib:
    """One encoder's H200 curve from its measured tables (``graph_ms`` and/or ``eager_ms``, batch ->
    ms): GPU work vs batch, plus the eager host floor and per-call overhead when both exist. The
    shipped encoders and a profile file's new encoder go through this same function."""
    graph = _ms_table(tables["graph_ms"]) if tables.get("graph_ms") else []
    eager = _ms_table(tables["eager_ms"]) if tables.get("eager_ms") else []
    floor = overhead = 0.0
    if graph and eager:
        g = dict(graph)
        bound = [s for b, s in eager if b in g and s > LAUNCH_BOUND * g[b]]
        floor = sum(bound) / len(bound) if bound else 0.0
        gmax = max(g)
        overhead = max(0.0, dict(eager).get(gmax, g[gmax]) - g[gmax])
        compute = graph + [(b, s - overhead) for b, s in eager if b > gmax]
    else:
        compute = graph or eager
    return EncoderCalib(
        compute=Curve(compute, extrapolate=True),
        floor_s=floor,
        overhead_s=overhead,
        max_measured_batch=max(b for b, _ in compute),
    )


def reference_backbone(name: str) -> Backbone:
    """The measured reference shapes (``llm-7b-class``, ``llm-34b-class``), for cross-checks."""
    return backbone(name)
