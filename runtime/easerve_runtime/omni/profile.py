"""Stage-latency model of one omni model on one GPU: shared stage, downstream stage, contention.

Why a separate model from ``easerve_runtime.profiles``: an omni deployment is two stages that
*co-run on one GPU*, and what HorizonServe controls is exactly how they interfere (§3.3). So
besides per-stage step times the model answers "how much slower is each stage when the other
runs too, under this sharing mode and SM split?" Data is JSON under ``omni/data/`` (one file per
``<model>@<gpu>``); docs/omni.md lists every assumption and its anchor.

Contention model (each stage ``i`` in {shared, downstream}; ``a_i`` = SM fraction granted):

- compute speed ``v_i = min(1, c_i / s_sat_i) ** beta`` where ``c_i`` is the *effective*
  compute share (green context: ``a_i``; MPS with both active: 1/2 each; alone: ``a_i``);
  decode and codec stages saturate well below the full GPU (§3.3: 64–80 of 142 SMs);
- memory-bandwidth demand ``d_i = bw_i * v_i * (1 + over_i * max(0, a_i - s_sat_i)/(1 - s_sat_i))``:
  granting a stage SMs beyond its saturation point adds traffic without progress (the paper
  measures the shared stage at 120 SMs *worse* than at 80 SMs under co-running, Fig. 4b); MPS
  grants each process the whole GPU (``a_i = 1``), a green-context split grants ``a_i``;
- when the demands sum past 1 the memory system is oversubscribed and both stages slow by
  ``D * (1 + thrash * (D - 1))``;
- MPS: each process is granted every SM (``a_i = 1``, so the over-allocation term applies) and
  its effective compute share shrinks by half the other stage's busy fraction;
- time-slicing (no MPS, no partition: two processes on one GPU, the vanilla setup): kernels never
  overlap, so each stage is stretched by the fraction of time the other keeps the GPU busy
  (its bandwidth demand is the busy-fraction proxy) plus a context-switch overhead.

The NVML-like memory-activity signal the throttle sees is ``100 * min(1, D)`` percent.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).with_name("data")


class Sharing(StrEnum):
    """How the two stage processes share the GPU."""

    TIMESLICE = "timeslice"  # two CUDA contexts, no MPS: kernels never overlap
    MPS = "mps"  # concurrent kernels, every process may use every SM
    GREEN = "green"  # complementary green-context split chosen by the throttle


@dataclass(frozen=True, slots=True)
class Dist:
    """A positive integer quantity drawn lognormal with this mean and coefficient of variation."""

    mean: float
    cv: float = 0.0

    def sample(self, rng: random.Random, lo: int = 1, hi: int = 1 << 20) -> int:
        if self.cv <= 0:
            return max(lo, min(hi, int(round(self.mean))))
        sigma2 = math.log(1.0 + self.cv**2)
        mu = math.log(self.mean) - sigma2 / 2
        return max(lo, min(hi, int(round(rng.lognormvariate(mu, math.sqrt(sigma2))))))

    @classmethod
    def parse(cls, v: Any, where: str) -> Dist:
        if isinstance(v, int | float):
            return cls(float(v))
        if isinstance(v, dict) and "mean" in v:
            return cls(float(v["mean"]), float(v.get("cv", 0.0)))
        raise ValueError(f"{where}: expected a number or {{mean, cv}}, got {v!r}")


@dataclass(frozen=True, slots=True)
class StageShape:
    """How a stage scales with SMs and how much memory bandwidth it wants."""

    sm_saturation: float
    bandwidth_demand: float
    overalloc_bandwidth: float


@dataclass(frozen=True, slots=True)
class ClassProfile:
    name: str
    output: str
    prompt_tokens: Dist
    output_tokens: Dist  # short path: tokens streamed; long path: thinker tokens before hand-off
    first_output_steps: int = 0  # downstream steps until the first audio chunk / the image
    total_steps: Dist = Dist(0.0)

    @property
    def long(self) -> bool:
        return self.output != "text"


@dataclass(frozen=True)
class OmniProfile:
    name: str
    total_sms: int
    prefill_fixed_s: float
    prefill_per_token_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    down_fixed_s: float
    down_per_item_s: float
    down_max_batch: int
    shared: StageShape
    down: StageShape
    thrash: float
    timeslice_overhead: float
    beta: float
    throttle: dict[str, Any]
    classes: dict[str, ClassProfile]
    mix: dict[str, float]

    # -- step times on the whole GPU, alone ------------------------------------------------

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens if tokens > 0 else 0.0

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return (
            self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context_tokens
        )

    def shared_step_s(self, prefill_tokens: int, decodes: int, context_tokens: int) -> float:
        return self.prefill_s(prefill_tokens) + self.decode_step_s(decodes, context_tokens)

    def down_step_s(self, batch: int) -> float:
        return self.down_fixed_s + self.down_per_item_s * batch if batch > 0 else 0.0

    # -- remaining-time estimate (r_hat) ---------------------------------------------------

    def remaining_s(
        self, cls: str, prompt_tokens: int, prefilled: bool, tokens_left: int, steps_left: int
    ) -> float:
        """Coarse remaining time to first response (profile minus progress), one request alone."""
        c = self.classes[cls]
        r = 0.0 if prefilled else self.prefill_s(prompt_tokens)
        if c.long:
            r += tokens_left * self.decode_step_s(1, prompt_tokens) + steps_left * self.down_step_s(1)
        return r

    # -- contention ----------------------------------------------------------------------

    def _speed(self, shape: StageShape, c: float) -> float:
        return min(1.0, max(c, 1e-3) / shape.sm_saturation) ** self.beta

    def _demand(self, shape: StageShape, v: float, a: float) -> float:
        over = max(0.0, a - shape.sm_saturation) / max(1e-9, 1.0 - shape.sm_saturation)
        return shape.bandwidth_demand * v * (1.0 + shape.overalloc_bandwidth * over)

    def slowdown(
        self, sharing: Sharing, shared_sms: int, shared_active: bool, down_active: bool
    ) -> tuple[float, float, float]:
        """(shared-stage step multiplier, downstream step multiplier, memory activity %).

        ``shared_sms`` is the shared stage's green-context cap (ignored for MPS/time-slicing);
        the downstream gets the complement. Multipliers are relative to running alone on the
        whole GPU.
        """
        both = shared_active and down_active
        if sharing is Sharing.GREEN:
            a_sh = min(1.0, shared_sms / self.total_sms)
            # The downstream context holds the complement; one green step (8 SMs) at least.
            a_dn = max(1.0 - a_sh, 8 / self.total_sms) if both else 1.0
            c_sh, c_dn = a_sh, a_dn
        elif sharing is Sharing.MPS:
            # Each process may use every SM; when both run, each loses the SMs the other keeps busy.
            a_sh = a_dn = 1.0
            c_sh = 1.0 - 0.5 * self.down.bandwidth_demand if both else 1.0
            c_dn = 1.0 - 0.5 * self.shared.bandwidth_demand if both else 1.0
        else:
            a_sh = a_dn = c_sh = c_dn = 1.0
        v_sh = self._speed(self.shared, c_sh)
        v_dn = self._speed(self.down, c_dn)
        d_sh = self._demand(self.shared, v_sh, a_sh) if shared_active else 0.0
        d_dn = self._demand(self.down, v_dn, a_dn) if down_active else 0.0
        if sharing is Sharing.TIMESLICE:
            if both:  # each waits out the other's slices: as long as the other keeps the GPU busy
                o = 1.0 + self.timeslice_overhead
                f_sh = 1.0 + self.down.bandwidth_demand * o
                f_dn = 1.0 + self.shared.bandwidth_demand * o
                return f_sh, f_dn, 100.0 * min(1.0, max(d_sh, d_dn))
            return 1.0, 1.0, 100.0 * min(1.0, d_sh + d_dn)
        total = d_sh + d_dn
        f_bw = total * (1.0 + self.thrash * (total - 1.0)) if total > 1.0 else 1.0
        return f_bw / v_sh, f_bw / v_dn, 100.0 * min(1.0, total)


def _parse(d: dict[str, Any], source: str) -> OmniProfile:
    try:
        sh, dn, con = d["shared"], d["downstream"], d["contention"]
        classes: dict[str, ClassProfile] = {}
        for name, c in d["classes"].items():
            where = f"{source}: classes.{name}"
            classes[name] = ClassProfile(
                name=name,
                output=c["output"],
                prompt_tokens=Dist.parse(c["prompt_tokens"], where + ".prompt_tokens"),
                output_tokens=Dist.parse(c["output_tokens"], where + ".output_tokens"),
                first_output_steps=int(c.get("first_output_steps", 0)),
                total_steps=Dist.parse(c.get("total_steps", 0), where + ".total_steps"),
            )
            if classes[name].long and classes[name].first_output_steps < 1:
                raise ValueError(
                    f"{where}.first_output_steps: a long-path class needs at least one downstream step"
                )
        prof = OmniProfile(
            name=d["name"],
            total_sms=int(d["gpu"]["sms"]),
            prefill_fixed_s=sh["prefill"]["fixed_s"],
            prefill_per_token_s=sh["prefill"]["per_token_s"],
            decode_fixed_s=sh["decode"]["fixed_s"],
            decode_per_seq_s=sh["decode"]["per_seq_s"],
            decode_per_ctx_token_s=sh["decode"]["per_ctx_token_s"],
            down_fixed_s=dn["step"]["fixed_s"],
            down_per_item_s=dn["step"]["per_item_s"],
            down_max_batch=int(dn.get("max_batch", 32)),
            shared=StageShape(sh["sm_saturation"], sh["bandwidth_demand"], sh["overalloc_bandwidth"]),
            down=StageShape(dn["sm_saturation"], dn["bandwidth_demand"], dn["overalloc_bandwidth"]),
            thrash=con["thrash"],
            timeslice_overhead=con["timeslice_overhead"],
            beta=con["compute_exponent"],
            throttle=dict(d["throttle"]),
            classes=classes,
            mix={k: float(v) for k, v in d["mix"].items()},
        )
    except KeyError as exc:
        raise ValueError(f"{source}: missing field {exc.args[0]!r}") from None
    for k in prof.mix:
        if k not in prof.classes:
            raise ValueError(f"{source}: mix.{k} is not a class")
    return prof


def available() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


@cache
def load_omni_profile(name: str) -> OmniProfile:
    """Load ``omni/data/<name>.json``; a ``<model>@<gpu>`` profile name or a path to a JSON file."""
    path = Path(name)
    if path.suffix != ".json":
        path = DATA_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"spec.engine.profile: unknown omni profile {name!r}; available: {available()}")
    return _parse(json.loads(path.read_text()), str(path))
