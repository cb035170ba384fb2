"""The omni systems by name: which base scheduler, whether the rotation wraps it, how the GPU is shared.

The live omni server (``workers.omni``) and the omni twin (``sim.omni``) both build their engine
here, so a system name means the same engine on both sides; neither imports the other.

============== ============== ================== ===========================================
name           base scheduler queue-view wrapper GPU sharing of the two stage processes
============== ============== ================== ===========================================
vanilla        FCFS           off                time-slicing (two contexts, no MPS)
edf            EDF            off                time-slicing
mps            FCFS           off                MPS (concurrent, no SM control)
edf-mps        EDF            off                MPS
horizon        FCFS           rotation + cap     green split from BandwidthThrottle
horizon-norot  FCFS           off (annotate)     green split from BandwidthThrottle
horizon-nothr  FCFS           rotation + cap     MPS (no throttle)
============== ============== ================== ===========================================
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import OmniSpec
from easerve_runtime.omni.engine import OmniEngine, make_throttle
from easerve_runtime.omni.profile import OmniProfile, Sharing
from easerve_runtime.policies.omni import EDFScheduler, FCFSScheduler, OmniScheduler, SLOTable, class_table

SYSTEMS: dict[str, tuple[str, bool, Sharing]] = {
    "vanilla": ("fcfs", False, Sharing.TIMESLICE),
    "edf": ("edf", False, Sharing.TIMESLICE),
    "mps": ("fcfs", False, Sharing.MPS),
    "edf-mps": ("edf", False, Sharing.MPS),
    "horizon": ("fcfs", True, Sharing.GREEN),
    "horizon-norot": ("fcfs", False, Sharing.GREEN),
    "horizon-nothr": ("fcfs", True, Sharing.MPS),
}
BASELINES = ("vanilla", "edf", "mps", "edf-mps")



def make_engine(
    profile: OmniProfile, omni: OmniSpec, slo: SLOTable, system: str, on_first: Any = None
) -> OmniEngine:
    if system not in SYSTEMS:
        raise ValueError(f"policy: must be one of {sorted(SYSTEMS)}, got {system!r}")
    base_name, rotation, sharing = SYSTEMS[system]
    base = EDFScheduler() if base_name == "edf" else FCFSScheduler()
    sched = OmniScheduler.from_spec(omni, base, rotation=rotation)
    throttle = make_throttle(profile) if sharing is Sharing.GREEN else None
    return OmniEngine(profile, sched, slo, class_table(omni.classes), sharing, throttle, on_first)
