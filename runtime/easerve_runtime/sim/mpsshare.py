"""Pods that share one GPU under MPS with per-stage SM caps; the twin charges that at dispatch.

Why: ``easerve serve --mps-share`` (``EASERVE_MPS_SHARES``) runs the processes of pods that share
a GPU concurrently under MPS, each named stage capped at a share of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), decode uncapped. On one H200 that served 1.5-2.4x the
moderate-tier goodput of time-slicing (run 14, docs/benchmarks.md), and ``sim.timeslice``'s rule
(each process at 1/k of its pace while k have work) predicts nothing of it.

The model, charged when work is dispatched (as ``sim.timeslice``; work in flight is not re-timed):

- **A capped pod** (cap ``c``) runs at the SM share ``c``, or ``c / C`` when the caps of the capped
  pods with work in flight (its own included) sum to ``C > 1``: its duration is the profile's at
  that share (``StageModel.encode_s`` / ``prefill_s`` with an SM share, the same curves the SM
  partition uses) over the profile's at the whole GPU.
- **An uncapped pod** (decode) gets what the capped pods in flight leave, ``f = 1 - sum of their
  caps`` (at least ``MIN_FREE``: the hardware interleaves blocks as they finish), and runs at full
  pace while ``f >= decode_saturation`` (a memory-bound step reaches the GPU's bandwidth on a
  fraction of the SMs), else ``decode_saturation / f`` times slower; ``k`` other uncapped pods in
  flight (two decode pods on one GPU) split the bandwidth with it, ``1 + k`` times slower.
- **Decode beside capped work:** a decode step dispatched while a capped pod has work in flight
  pays ``1 + decode_corun`` as well, whatever the caps. On the H200 (runs 14-15) the served decode
  step at 10-22 rows took 1.3-1.5x the profile's in every capped system, at 50, 70 and 85 %
  alike (12.9 ms at 11 rows under a 50 % cap, 12.8 ms at 10 rows under 85 %), and the one-process
  aggregated engine took the profile's own: the step is bound by memory bandwidth, which the
  encoder's and the prefill's kernels take from it whichever SMs they hold.
- **Decode's rows beside capped pods:** an uncapped decode step on a GPU that capped pods share
  pays ``decode_row_ms`` per running sequence on top, whether or not they have work in flight
  (``decode_rows_s``). On the H100 (runs 18-26, five hosts) the served step minus the profile's
  grew 0.36-0.38 ms a row (8-24 rows) in every capped layout, at 4.5-7 req/s, on every host alike,
  while the intercept stayed the profile's; the one-process aggregated engine paid none of it.
  The step's weight reads hide under its launch floor; its attention's K/V reads, which scale
  with the rows, run on what the capped kernels leave. The H200's fit has none (0). Each capped
  pod beyond the first that runs prefill on the GPU (a local prefill in an encode pod, a remote
  prefill pod: ``prefill_pods``) adds ``decode_row_extra_ms`` a row: over runs 18-28 the excess
  read 0.37 ms a row where one capped pod prefills and 0.40 where two do (E2 P0 D1, E1 P1 D1 at
  s 0.5), the layouts the twin had predicted well above what they served.
- **Bandwidth:** any work dispatched while another pod has work in flight also pays ``1 +
  contention`` (decode: ``1 + decode_contention``, the same unless a card's fit says otherwise;
  the H100's per-row fit leaves the step's intercept at the profile's, so it sets 0): the two
  compete for memory bandwidth and caches whatever the SM split.
- **The encoder beside other work:** an encoder micro-batch dispatched while another pod has work
  in flight pays ``1 + encode_corun`` as well. On the H100 (runs 21-23) the served encoder took
  1.3-1.8x what the twin charged from its SM curve and the contention alone, in every capped
  system (``twin_agreement.py --encode-check``, milliseconds per batch); the H200's fit has none.
- **An encoder's host part** (``StageModel.encode_host_s``: CPU preprocessing, a profile's
  ``engine.encode_host``) is neither charged a factor nor in flight: the encoder dispatches it
  first and its GPU work is in flight only after it (``stages.Busy.timesliced``).

``contention``, ``decode_contention``, ``decode_corun``, ``decode_row_ms``, ``decode_saturation`` and
``encode_corun`` belong to the card. The module's
(``CONTENTION``, ``DECODE_CORUN``, ``DECODE_SATURATION``) are the H200's: fitted to runs 14-15's
points at 5.5 and 7 req/s and checked on their points at 8.5 (``benchmarks/twin_agreement.py
--mps-fit``). A profile fitted on another card carries its own (``engine.mps``, written by
``--mps-fit --write-profile``; the H100's differ: docs/benchmarks.md, "The H100's MPS constants
in its profile"), and those win over the module's; a caller's arguments to ``MPSSharing`` win
over both. Two hosts of one card model can differ as much as the constants' effect (run 21), so
a fit describes the host its runs came from.
The unit is the pod replica, as in ``sim.timeslice``: an encode pod's encode worker and its local
prefill share the pod's one cap (one process, or one cap for both processes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.timeslice import pod_key, pod_stage

if TYPE_CHECKING:
    from easerve_runtime.api import EPDDeploymentSpec


def prefill_pods(spec: EPDDeploymentSpec) -> frozenset[str]:
    """The pod replicas (``pod_key``) that run prefill: each encode pod when it has a local prefill
    worker (s < 1) and each remote prefill pod when prefills go remote (s > 0)."""
    alloc, s = spec.allocation, float(spec.offload.ratio)
    pods = [pod_key("encode", r) for r in range(alloc.encode.replicas)] if spec.has_local_prefill else []
    if s > 0:
        pods += [pod_key("prefill", r) for r in range(alloc.prefill.replicas)]
    return frozenset(pods)

CONTENTION = 0.20
DECODE_CORUN = 0.70
MIN_FREE = 0.05
DECODE_SATURATION = MIN_FREE
"""Fitted on runs 14-15 (``twin_agreement.py --mps-fit``). The fit sets ``DECODE_SATURATION`` to
``MIN_FREE``, which turns the saturation rule off: on the GPU two 85 % caps in flight together did
not starve decode (Dynamo-style ``+mps85`` stepped 17.1 ms at 22 rows, EAServe's one 85 % pod 16.8
ms at 22), and a wider cap did not slow it (12.9 ms at 11 rows under 50 %, 12.8 at 10 under 85 %).
The rule stays for hardware where a profile's fit says otherwise."""
ENCODE_CORUN = 0.0
"""No encoder co-run term on the H200 (its fit had none); a card's profile may carry its own
(``engine.mps.encode_corun``: the H100's, run 23)."""
DECODE_ROW_MS = 0.0
"""No per-row charge on the H200 (its fit charges decode by the co-run factor instead); a card's
profile may carry its own (``engine.mps.decode_row_ms``: the H100's, runs 18-26)."""
DECODE_ROW_EXTRA_MS = 0.0
"""No per-row charge per further prefilling pod on the H200; the H100's profile carries its own."""
DEFAULTS: dict[str, float] = {"contention": CONTENTION, "decode_corun": DECODE_CORUN,
                              "decode_saturation": DECODE_SATURATION, "encode_corun": ENCODE_CORUN,
                              "decode_row_ms": DECODE_ROW_MS, "decode_row_extra_ms": DECODE_ROW_EXTRA_MS}
"""The module's constants by the names a profile's ``engine.mps`` uses: what a card without its own
fit gets. ``decode_contention`` is not here: unset, it is the card's ``contention``."""
REF_ITEMS = 4
REF_TOKENS = 2048
"""The encode batch and prefill length at which a cap's slowdown is read off the profile."""


class MPSSharing:
    """Which pod replicas have work in flight on which host GPUs, under MPS with per-stage caps."""

    def __init__(self, loop: EventLoop, devices: dict[str, frozenset[int]], caps: Mapping[str, float],
                 model: StageModel, contention: float | None = None,
                 decode_saturation: float | None = None, decode_corun: float | None = None,
                 encode_corun: float | None = None, decode_contention: float | None = None,
                 decode_row_ms: float | None = None, prefill_pods: frozenset[str] = frozenset(),
                 decode_row_extra_ms: float | None = None) -> None:
        """``caps``: stage name (``encode``, ``local-prefill``, ``prefill``, ``decode``) -> SM
        fraction in (0, 1]; a stage not named is uncapped. A pod replica's cap is its stage's (an
        encode pod's: ``encode``'s, else ``local-prefill``'s). ``prefill_pods``: the pod replicas
        that run prefill (``prefill_pods(spec)``), for ``decode_row_extra_ms``."""
        self.loop = loop
        self.devices = devices
        self.model = model
        # an argument wins, then the card's own fit in the profile (engine.mps; a calibration's grid
        # point rides on a copy of the stage model, twin_agreement --mps-fit), then the module's
        card = {**DEFAULTS, **(getattr(model, "mps_constants", None) or {})}
        self.contention = card["contention"] if contention is None else contention
        self.decode_saturation = card["decode_saturation"] if decode_saturation is None else decode_saturation
        self.decode_corun = card["decode_corun"] if decode_corun is None else decode_corun
        self.encode_corun = card["encode_corun"] if encode_corun is None else encode_corun
        own = card.get("decode_contention", self.contention)
        self.decode_contention = own if decode_contention is None else decode_contention
        self.decode_row_ms = card["decode_row_ms"] if decode_row_ms is None else decode_row_ms
        self.decode_row_extra_ms = card["decode_row_extra_ms"] if decode_row_extra_ms is None else decode_row_extra_ms
        self.prefill_pods = prefill_pods
        self._row_ms: dict[str, float] = {}
        self.caps = {k: min(1.0, max(0.0, float(v))) for k, v in caps.items()}
        self.busy_until: dict[str, float] = {}
        self._factor: dict[tuple[str, float], float] = {}
        self.charged = 0  # dispatches that paid a factor > 1 (for reports)
        self.dispatches = 0

    def cap(self, proc: str) -> float | None:
        """Pod replica ``proc``'s SM cap (None: uncapped)."""
        stage = pod_stage(proc)
        if stage == "encode":
            return self.caps.get("encode", self.caps.get("local-prefill"))
        return self.caps.get(stage)

    def share_factor(self, work: str, share: float) -> float:
        """How much longer ``work`` (``encode`` or ``prefill``) takes at SM share ``share`` than on the
        whole GPU, from the profile's own SM curves."""
        key = (work, round(share, 4))
        v = self._factor.get(key)
        if v is None:
            if work == "encode":
                v = self.model.encode_s(REF_ITEMS, share) / self.model.encode_s(REF_ITEMS, 1.0)
            else:
                v = self.model.prefill_s(REF_TOKENS, 1, share) / self.model.prefill_s(REF_TOKENS, 1, 1.0)
            v = self._factor[key] = max(1.0, v)
        return v

    def dilation(self, proc: str, work: str = "") -> float:
        """The factor on ``work`` (``encode``, ``prefill`` or ``decode``) that pod replica ``proc``
        dispatches now."""
        mine = self.devices.get(proc)
        if not mine:
            return 1.0
        now = self.loop.now
        others = [p for p, until in self.busy_until.items()
                  if p != proc and until > now and self.devices.get(p, frozenset()) & mine]
        other_caps = [c for p in others if (c := self.cap(p)) is not None]
        cap = self.cap(proc)
        if cap is None:
            free = max(MIN_FREE, 1.0 - sum(other_caps))
            factor = max(1.0, self.decode_saturation / free)
            # other uncapped (memory-bound) pods in flight split the bandwidth with it
            factor *= 1 + sum(1 for p in others if self.cap(p) is None)
            if other_caps:  # capped work in flight takes memory bandwidth whatever SMs it holds
                factor *= 1.0 + self.decode_corun
        else:
            total = cap + sum(other_caps)
            share = cap / total if total > 1.0 else cap
            factor = self.share_factor("encode" if work == "encode" else "prefill", share)
            if work == "encode" and others:
                factor *= 1.0 + self.encode_corun
        if others:
            factor *= 1.0 + (self.decode_contention if cap is None else self.contention)
        self.dispatches += 1
        if factor > 1.0:
            self.charged += 1
        return factor

    def decode_rows_s(self, proc: str, rows: int) -> float:
        """Seconds an uncapped decode step of ``rows`` sequences pays on top of its dilated time, on
        a GPU that capped pods share (in flight or not): ``decode_row_ms`` a row, plus
        ``decode_row_extra_ms`` a row for each capped pod beyond the first that prefills there."""
        if rows <= 0:
            return 0.0
        row_ms = self._row_ms.get(proc)
        if row_ms is None:
            mine = self.devices.get(proc, frozenset())
            capped = [p for p in self.devices
                      if p != proc and self.devices[p] & mine and self.cap(p) is not None] if mine else []
            row_ms = 0.0
            if capped and self.cap(proc) is None:
                prefilling = sum(1 for p in capped if p in self.prefill_pods)
                row_ms = self.decode_row_ms + self.decode_row_extra_ms * max(0, prefilling - 1)
            self._row_ms[proc] = row_ms
        return row_ms * rows / 1e3

    def occupy(self, proc: str, until: float) -> None:
        """Pod replica ``proc`` has work in flight until ``until``."""
        if proc in self.devices:
            self.busy_until[proc] = max(until, self.busy_until.get(proc, until))
