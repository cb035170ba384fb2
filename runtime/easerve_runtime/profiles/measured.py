"""Stage times measured on an engine, laid over the analytic profile as ratio curves.

``easerve profile --engine torch`` measures one engine on one whole GPU at a few batch sizes,
prompt lengths and decode batches, and writes those points into a profile file (``engine``).
The twin asks for more than was measured: SM shares (the local prefill), TP degrees, batches
and contexts in between. So the measured points do not replace the analytic model; they correct
it: at each measured point the ratio measured / model is taken, the ratios form a curve over
log2 of the batch (or prompt length), flat beyond the ends, and each stage's time is the
model's times that curve. At a measured point the twin then reproduces the measurement exactly;
between points it follows the model's shape; the share, TP and context dependence stay the
model's (docs/profiles.md, "Profiles measured on an engine").

Pure arithmetic on the profile it is given: no I/O, no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from easerve_runtime.profiles.curves import Curve

if TYPE_CHECKING:
    from easerve_runtime.profiles.profile import Profile


MPS_CONSTANTS = ("contention", "decode_corun", "decode_saturation", "encode_corun", "decode_contention", "decode_row_ms",
                 "decode_row_extra_ms")
"""The MPS twin's constants a profile may carry (``schema.MPSSharingDoc``, ``sim.mpsshare``)."""
AGGREGATED_RATIOS = ("encode_over_profile", "prefill_over_profile")
"""The aggregated loop's ratios a profile may carry (``schema.AggregatedLoopDoc``, ``sim.aggregated``)."""


@dataclass(frozen=True)
class StageCorrections:
    """measured / model per stage, as curves over log2(x); None: that stage was not measured."""

    encode: Curve | None = None  # x: encoder items per micro-batch
    prefill: Curve | None = None  # x: prompt tokens
    decode: Curve | None = None  # x: sequences per step
    source: str = ""  # "<engine> on <device>", for reports
    request_path_s: float = 0.0  # the serving path's own latency per request (no GPU busy for it)
    decode_overhead_s: float = 0.0  # the served decode loop's cost per iteration beyond the step
    decode_row_overhead_s: float = 0.0  # ... and per running sequence per iteration on top (the host's)
    mixed_iteration: str = "fused"  # how the engine's aggregated loop runs prefill beside decode
    mps: Mapping[str, float] | None = None  # the MPS twin's constants fitted on this card (sim.mpsshare)
    aggregated: Mapping[str, float] | None = None  # the aggregated loop's encode/prefill over the twin's
    encode_host: Curve | None = None  # x: encoder items; y: the share of the encode time spent on the host

    def summary(self) -> dict[str, Any]:
        """The ratios at the measured points (what a report prints)."""
        out: dict[str, Any] = {"source": self.source}
        if self.request_path_s:
            out["request_path_ms"] = round(self.request_path_s * 1e3, 3)
        if self.decode_overhead_s:
            out["decode_loop_overhead_ms"] = round(self.decode_overhead_s * 1e3, 3)
        if self.decode_row_overhead_s:
            out["decode_loop_row_ms"] = round(self.decode_row_overhead_s * 1e3, 4)
        if self.mixed_iteration != "fused":
            out["mixed_iteration"] = self.mixed_iteration
        if self.mps is not None:
            out["mps"] = dict(self.mps)
        if self.aggregated is not None:
            out["aggregated"] = dict(self.aggregated)
        for name in ("encode", "prefill", "decode", "encode_host"):
            c = getattr(self, name)
            if c is not None:
                out[name] = {str(round(2 ** x)): round(y, 4) for x, y in zip(c.xs, c.ys, strict=True)}
        return out


def ratio_curve(points: Iterable[tuple[float, float]]) -> Curve | None:
    """One curve through (x, ratio) points; repeated x take the median of their ratios."""
    by_x: dict[float, list[float]] = {}
    for x, r in points:
        by_x.setdefault(float(x), []).append(float(r))
    if not by_x:
        return None
    return Curve(((x, statistics.median(rs)) for x, rs in by_x.items()), log_x=True)


def _points(doc: Mapping[str, Any], key: str) -> Sequence[Mapping[str, Any]]:
    return list(doc.get(key) or ())


def corrections(profile: Profile, doc: Mapping[str, Any]) -> StageCorrections:
    """The corrections of a profile file's ``engine`` section (validated by ``schema.EngineDoc``),
    against ``profile``'s analytic times (a profile without corrections)."""
    if profile.corrections is not None:
        raise ValueError("corrections are taken against the analytic profile, not a corrected one")
    enc = ratio_curve((p["items"], p["ms"] / 1e3 / profile.encode_s(int(p["items"]))) for p in _points(doc, "encode"))
    pre = ratio_curve((p["tokens"], p["ms"] / 1e3 / profile.prefill_s(int(p["tokens"]))) for p in _points(doc, "prefill"))
    dec = ratio_curve(
        (p["batch"], p["ms"] / 1e3 / profile.decode_step_s(int(p["batch"]), float(p["context_tokens"])))
        for p in _points(doc, "decode")
    )
    # the host's share of each encode_host point's encode time (the encode curve's at those items)
    host = ratio_curve(
        (p["items"], min(1.0, p["ms"] / 1e3 / (profile.encode_s(int(p["items"])) * (enc(p["items"]) if enc else 1.0))))
        for p in _points(doc, "encode_host")
    )
    path_ms = doc.get("request_path_ms")
    mps = doc.get("mps")
    agg = doc.get("aggregated")
    return StageCorrections(enc, pre, dec, f"{doc.get('engine', '?')} on {doc.get('device', '?')}",
                            float(path_ms or 0.0) / 1e3, float(doc.get("decode_loop_overhead_ms") or 0.0) / 1e3,
                            float(doc.get("decode_loop_row_ms") or 0.0) / 1e3,
                            str(doc.get("mixed_iteration") or "fused"),
                            {k: float(mps[k]) for k in MPS_CONSTANTS if mps.get(k) is not None} if mps else None,
                            {k: float(agg[k]) for k in AGGREGATED_RATIOS} if agg else None,
                            encode_host=host)
