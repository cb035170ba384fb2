"""``engine.backend: torch``: the engine of one stage, built from ``spec.model``.

Encode gets :class:`~easerve_runtime.engines.hf.HFEncodeEngine` (tower + projector + processor),
prefill and local prefill :class:`~easerve_runtime.engines.hf.HFPrefillEngine`, decode
:class:`~easerve_runtime.engines.hf.HFDecodeEngine` (language model + KV slots). The device is
CUDA when torch sees one (``EASERVE_DEVICE`` overrides, e.g. ``cpu`` or ``cuda:1``).

The random-weight GPU encoders used by the partition profiler stay in ``engines/torch_encode.py``.
"""

from __future__ import annotations

import os
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec

DEVICE_ENV = "EASERVE_DEVICE"


def pick_device() -> str:
    dev = os.environ.get(DEVICE_ENV)
    if dev:
        return dev
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def green_pool(spec: EPDDeploymentSpec, device: str) -> Any:
    """The encode GPU's green-context streams, one primary/partner pair per ladder level (8-SM
    steps), when the spec splits the encode GPU with green contexts; None otherwise (or where they
    cannot be made). One pool per GPU, shared by the encode engine (primary streams) and the local
    prefill engine (partner streams) of the one process that hosts both (``colocated_engines``).
    """
    if str(spec.sm_partition.mode) == "none" or str(spec.sm_partition.backend) != "green-context":
        return None
    if not device.startswith("cuda"):
        return None
    import logging

    import torch

    from easerve_runtime.partition.backends import GreenContextPool

    idx = torch.device(device).index or 0
    total = int(torch.cuda.get_device_properties(idx).multi_processor_count)
    try:
        return GreenContextPool(range(16, total, 8), device=idx)
    except Exception as exc:  # noqa: BLE001 - serve unpartitioned rather than not at all
        logging.getLogger("easerve.engine").warning("green contexts unavailable (%r): prefill unpartitioned", exc)
        return None


def _engine_kw(spec: EPDDeploymentSpec) -> dict[str, Any]:
    m = spec.model
    if not m.path:
        raise ValueError("spec.model.path: is required when spec.engine.backend is torch")
    return {"device": pick_device(), "random_weights": m.random_weights, "trust_remote_code": m.trust_remote_code}


def encode_engine(spec: EPDDeploymentSpec, path: str, pool: Any = None, **kw: Any) -> Any:
    """The encoder of ``spec``, preprocessing where ``spec.encode.preprocessing`` says."""
    from easerve_runtime.engines.hf import HFEncodeEngine

    enc = HFEncodeEngine(path, pool=pool, **kw)
    enc.gpu_decode = str(spec.encode.preprocessing) == "gpu"
    return enc


def make_torch_engine(spec: EPDDeploymentSpec, stage: str = "encode", pool: Any = None) -> Any:
    """The torch engine of ``stage`` for ``spec`` (validation already required ``spec.model.path``)."""
    from easerve_runtime.engines.hf import HFDecodeEngine, HFPrefillEngine

    kw = _engine_kw(spec)
    path = str(spec.model.path)
    if stage == "encode":
        return encode_engine(spec, path, pool, **kw)
    if stage in ("prefill", "local-prefill"):
        if pool is None and stage == "local-prefill":
            pool = green_pool(spec, kw["device"])
        return HFPrefillEngine(path, pool=pool, **kw)
    if stage == "decode":
        return HFDecodeEngine(path, memory_fraction=spec.decode.kv_memory_fraction, **kw)
    raise ValueError(f"no torch engine for stage {stage!r}")


def make_aggregated_engines(spec: EPDDeploymentSpec) -> tuple[Any, Any, Any]:
    """The aggregated worker's engines on one device: encoder, then decode (its KV slots are sized
    from what the encoder's and the language model's weights leave), then prefill running the
    decode engine's language model (one copy of the weights) and handing its caches over on the
    device."""
    from easerve_runtime.engines.hf import HFDecodeEngine, HFPrefillEngine

    kw = _engine_kw(spec)
    path = str(spec.model.path)
    enc = encode_engine(spec, path, **kw)
    dec = HFDecodeEngine(path, memory_fraction=spec.decode.kv_memory_fraction, **kw)
    pre = HFPrefillEngine(path, share=dec, **kw)
    return enc, pre, dec


def colocated_engines(spec: EPDDeploymentSpec) -> tuple[Any, Any]:
    """The encode engine and its GPU's local prefill engine for ONE process
    (``topology.local_prefill_in_encode``), sharing one ``GreenContextPool`` on CUDA (None on the
    CPU or without a green-context split: then nothing about streams changes)."""
    from easerve_runtime.engines.hf import HFPrefillEngine

    kw = _engine_kw(spec)
    path = str(spec.model.path)
    pool = green_pool(spec, kw["device"])
    return encode_engine(spec, path, pool, **kw), HFPrefillEngine(path, pool=pool, **kw)
