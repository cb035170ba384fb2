"""How a process confines its kernels to an SM share: green contexts, MPS, or nothing.

Detection happens once at start-up and its answer (``BackendInfo``) is logged and exported as
a metric label, so an operator can see *why* a GPU runs unpartitioned. Every failure path falls
back to ``none`` with a reason instead of raising: a worker without a partition still serves,
it only loses the latency protection.

- ``green-context``: every ladder level's partition is created once at start-up (creation costs
  ~1.8 ms, so never per batch). Each level is one ``cuDevSmResourceSplitByCount`` of the device
  into a primary group of ``sms`` SMs and the *disjoint* remainder, so the primary stream of a
  level and the partner stream of the same level never share an SM. Kernels (and CUDA graphs
  captured on these streams) run only on their group's SMs; on Hopper groups come in 8s.
- ``mps``: one static ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per process, set before CUDA starts;
  for GPUs or drivers without green contexts. Cannot change per micro-batch.
- ``none``: plain streams.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.policies.partition import HOPPER_SM_STEP

log = logging.getLogger(__name__)

BACKENDS = ("green-context", "mps", "none")


@dataclass(frozen=True)
class BackendInfo:
    """What start-up found: the backend in use, why, and the device's SM count (0 without a GPU)."""

    name: str
    reason: str
    total_sms: int = 0
    device_name: str = ""


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken driver reports through is_available on some builds
        return None


def mps_available() -> bool:
    """An MPS control daemon is reachable (its pipe directory exists) or can be started."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return (
        os.path.exists(os.path.join(pipe, "control")) or shutil.which("nvidia-cuda-mps-control") is not None
    )


def green_context_available(torch: Any) -> tuple[bool, str]:
    try:
        import cuda.bindings.driver as drv  # noqa: F401
    except ImportError:
        drv = None
    if drv is not None and hasattr(drv, "cuGreenCtxCreate"):
        major, _ = torch.cuda.get_device_capability()
        if major < 9:
            return False, f"compute capability {major}.x: green contexts need Hopper (9.0) or newer here"
        return True, "cuda.bindings green-context API present"
    if getattr(getattr(torch.cuda, "green_contexts", None), "SUPPORTED", False):
        return True, "torch.cuda.green_contexts supported (partitions may overlap: no disjoint split)"
    return False, "neither cuda.bindings nor torch exposes green contexts"


def detect_backend(preferred: str = "green-context") -> BackendInfo:
    """Pick the backend: ``preferred`` if it works here, else the next in line, else ``none``."""
    if preferred not in BACKENDS:
        raise ValueError(f"spec.smPartition.backend: must be one of {BACKENDS}, got {preferred!r}")
    torch = _torch_cuda()
    if torch is None:
        info = BackendInfo(
            "none", "no CUDA GPU visible (torch missing or torch.cuda.is_available() is False)"
        )
        log.warning("SM partition backend: %s (%s)", info.name, info.reason)
        return info
    props = torch.cuda.get_device_properties(0)
    sms, dev = int(props.multi_processor_count), str(props.name)
    order = {"green-context": ["green-context", "mps"], "mps": ["mps"], "none": []}[preferred]
    reasons = []
    for name in order:
        if name == "green-context":
            ok, why = green_context_available(torch)
        else:
            ok = mps_available() or "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in os.environ
            why = "MPS control daemon found" if ok else "no MPS control daemon"
        if ok:
            info = BackendInfo(name, why, sms, dev)
            log.info("SM partition backend: %s (%s), %d SMs on %s", name, why, sms, dev)
            return info
        reasons.append(f"{name}: {why}")
    info = BackendInfo("none", "; ".join(reasons) or "requested none", sms, dev)
    log.warning("SM partition backend: none (%s)", info.reason)
    return info


def mps_env(sms: int, total_sms: int) -> dict[str, str]:
    """The environment a process needs to get ~``sms`` SMs under MPS (set before CUDA starts)."""
    pct = max(1, min(100, round(100 * sms / total_sms)))
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}


def _check(result: Any) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@dataclass
class GreenLevel:
    """One ladder level: a primary stream on ``sms`` SMs and a partner stream on the rest."""

    sms: int
    partner_sms: int
    primary: Any
    partner: Any
    handles: list[Any] = field(default_factory=list)


class GreenContextPool:
    """All ladder levels' green contexts and streams, created once; pick one per micro-batch.

    ``levels`` are primary SM counts; the full GPU (``total_sms``) maps to plain streams (no
    partition). Uses ``cuda.bindings`` for disjoint primary/partner groups, falling back to
    ``torch.cuda.green_contexts`` (independent, possibly overlapping partitions) when absent.
    """

    def __init__(self, levels: Iterable[int], device: int = 0, priority: int = 0) -> None:
        import torch

        self.torch = torch
        self.device = device
        props = torch.cuda.get_device_properties(device)
        self.total_sms = int(props.multi_processor_count)
        self.full_primary = torch.cuda.Stream(device=device, priority=priority)
        self.full_partner = torch.cuda.Stream(device=device)
        self.high_priority = torch.cuda.Stream(device=device, priority=-5)  # clamped to the highest
        self.levels: dict[int, GreenLevel] = {}
        self.disjoint = True
        self.mode = "cuda.bindings"
        for sms in sorted(set(levels)):
            if sms >= self.total_sms:
                continue
            try:
                self.levels[sms] = self._create_disjoint(sms)
            except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
                log.warning(
                    "disjoint green split of %d SMs failed (%s); using torch green contexts", sms, exc
                )
                self.levels[sms] = self._create_torch(sms)
                self.disjoint = False
                self.mode = "torch.cuda.green_contexts"

    def _create_disjoint(self, sms: int) -> GreenLevel:
        import cuda.bindings.driver as drv

        torch = self.torch
        torch.cuda.init()
        dev = _check(drv.cuDeviceGet(self.device))
        res = _check(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        groups, _, remaining = _check(drv.cuDevSmResourceSplitByCount(1, res, 0, sms))
        streams, handles, counts = [], [], []
        for part in (groups[0], remaining):
            desc = _check(drv.cuDevResourceGenerateDesc([part], 1))
            ctx = _check(
                drv.cuGreenCtxCreate(desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
            )
            raw = _check(drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
            streams.append(torch.cuda.get_stream_from_external(int(raw), self.device))
            handles += [ctx, raw]
            counts.append(int(part.sm.smCount))
        return GreenLevel(counts[0], counts[1], streams[0], streams[1], handles)

    def _create_torch(self, sms: int) -> GreenLevel:
        gc = self.torch.cuda.green_contexts.GreenContext
        a = gc.create(sms, self.device)
        b = gc.create(max(HOPPER_SM_STEP, self.total_sms - sms), self.device)
        return GreenLevel(sms, self.total_sms - sms, a.Stream(), b.Stream(), [a, b])

    def primary(self, sms: int) -> Any:
        """The primary tenant's stream for a level (plain stream at the full GPU)."""
        return self.full_primary if sms >= self.total_sms else self.levels[sms].primary

    def partner(self, primary_sms: int) -> Any:
        """The partner's stream complementing ``primary_sms`` (plain stream when primary is idle)."""
        if primary_sms <= 0:
            return self.full_partner
        return self.levels[primary_sms].partner if primary_sms in self.levels else None

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "disjoint": self.disjoint,
            "totalSMs": self.total_sms,
            "levels": {str(k): {"primary": v.sms, "partner": v.partner_sms} for k, v in self.levels.items()},
        }
