"""Placeholder for a torch engine covering prefill and decode.

The real GPU encoder lives in ``engines/torch_encode.py`` (the SM-partitioning work) and
implements :class:`easerve_runtime.engines.base.EncodeEngine`. Prefill and decode on GPU are
out of scope for now: the sim engine models them from measured profiles.
"""

from __future__ import annotations

from easerve_runtime.api import EPDDeploymentSpec


def make_torch_engine(spec: EPDDeploymentSpec) -> object:
    """Fail loudly: a torch prefill/decode engine is not built yet."""
    raise NotImplementedError(
        "spec.engine.backend=torch: only the encoder has a torch implementation "
        "(easerve_runtime.engines.torch_encode); prefill/decode need backend 'sim' for now"
    )
