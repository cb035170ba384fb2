"""The KV handoff between processes on one GPU by CUDA IPC: decode maps the prefill's device tensor.

Why: on one GPU shared by the encode, prefill and decode pods (MPS), the handoff went through
host memory: a device-to-host copy of the cache into a same-host blob (330 MB for LLaVA-NeXT 7B
at 2,560 tokens: 101-146 ms on the H100, GPU run 27), then a host-to-device copy on the decode
side (31-64 ms from reaching decode to joining its batch). Both processes already sit on the same
device memory; CUDA IPC lets the decode process map the prefill's allocation and copy it device
to device, as Dynamo's NIXL moves a cache between GPUs without touching the host.

This rides on torch's own IPC (``UntypedStorage._share_cuda_`` and
``torch.multiprocessing.reductions.rebuild_cuda_tensor``, what ``torch.multiprocessing`` sends a
CUDA tensor with), written as plain JSON, not a pickle, so that nothing on the request plane is
ever unpickled. torch's IPC reference counter governs the producer's block: the producer may drop
its tensor once the consumer has copied, and the block is freed when the consumer's mapping is
closed. When decode refuses a descriptor (it never mapped it), the producer returns that
descriptor's count itself (``release_refused``, through ``deferred_share``'s answer), else its
block would wait for a consumer forever.

On by default since GPU run 28 (on one H100: a 335 MB handoff took 1.4 ms against the host
path's 150 ms, and 5,700 requests were served through it); ``EASERVE_KV_IPC=0`` turns it off.
This path's own test, ``tests/engines/test_kv_ipc_gpu.py``, needs CUDA. It is tried only where
the engine is on CUDA, and the decode side refuses a descriptor from another GPU (``KVIPCRefused``), upon which the
prefill worker sends that instance the host copy instead (``workers.prefill``).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Mapping
from typing import Any

ENV = "EASERVE_KV_IPC"


class KVIPCRefused(Exception):
    """This process cannot map that descriptor (another GPU, no CUDA, or the driver refused).

    ``mapped``: the share was mapped before the failure, so closing the mapping has already
    returned the producer its IPC count (the producer must not return it again)."""

    def __init__(self, message: str, *, mapped: bool = False) -> None:
        super().__init__(message)
        self.mapped = mapped


DEFAULT = "1"
"""On: GPU run 28 served 5,700 requests through it on one H100 (docs/benchmarks.md, run 28);
``EASERVE_KV_IPC=0`` sends every cache through host memory instead."""


def enabled() -> bool:
    """Same-GPU handoffs by CUDA IPC (``EASERVE_KV_IPC``; ``DEFAULT`` when unset)."""
    return os.environ.get(ENV, DEFAULT) != "0"


def gpu_uuid(device: Any) -> str:
    """The physical GPU behind ``device`` (the same string in every process that sees it)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def export(kv: Any) -> dict[str, Any]:
    """A JSON descriptor that another process on the same GPU opens with :func:`open_shared`.

    The caller keeps ``kv`` alive until the consumer has answered (it copies before answering),
    and has made sure the kernels that wrote it are done (the handle's event is recorded on the
    calling thread's current stream)."""
    storage = kv.untyped_storage()
    _device, handle, size, offset, ref, ref_offset, event, event_sync = storage._share_cuda_()
    return {
        "gpu": gpu_uuid(kv.device),
        "handle": _b64(handle),
        "size": int(size),
        "offset": int(offset),
        "ref": _b64(ref),
        "ref_offset": int(ref_offset),
        "event": _b64(event),
        "event_sync": bool(event_sync),
        "shape": [int(x) for x in kv.shape],
        "stride": [int(x) for x in kv.stride()],
        "storage_offset": int(kv.storage_offset()),
        "dtype": str(kv.dtype).removeprefix("torch."),
    }


def check(desc: Mapping[str, Any], device: Any) -> None:
    """Raise :class:`KVIPCRefused` unless ``device`` is the GPU ``desc``'s tensor lies on (no CUDA call
    beyond reading the device's properties): decode answers this before it queues the request."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise KVIPCRefused(f"this decode engine is on {dev.type}, not on the producer's GPU")
    try:
        mine = gpu_uuid(dev)
    except Exception as exc:  # noqa: BLE001 - no such device here
        raise KVIPCRefused(f"cannot read this process's GPU: {exc}") from exc
    if mine != str(desc.get("gpu")):
        raise KVIPCRefused(f"the cache is on GPU {desc.get('gpu')}, this decode engine on {mine}")


def open_shared(desc: Mapping[str, Any], device: Any, dst: Any = None, after: Any = None) -> Any:
    """A device-local copy of the tensor ``desc`` describes, into ``dst``'s memory when given (after
    CUDA event ``after``), made on a side stream and finished before this returns; the mapping is
    closed again, which returns the producer its block.

    Raises :class:`KVIPCRefused` if ``device`` is not the producer's GPU or the driver refuses; its
    ``mapped`` says whether the mapping was opened (and, closed again, returned the producer's count)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    check(desc, device)
    dev = torch.device(device)
    shared = None
    try:
        dtype = getattr(torch, str(desc["dtype"]))
        stream = torch.cuda.Stream(device=dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)  # ``dst`` is free once that event has run
            shared = rebuild_cuda_tensor(
                torch.Tensor, torch.Size(desc["shape"]), tuple(desc["stride"]), int(desc["storage_offset"]),
                torch.UntypedStorage, dtype, torch.cuda.current_device(),
                _unb64(desc["handle"]), int(desc["size"]), int(desc["offset"]), False,
                _unb64(desc["ref"]), int(desc["ref_offset"]), _unb64(desc.get("event")), bool(desc["event_sync"]),
            )
            if dst is None:
                local = shared.clone()
            else:
                local = dst[: shared.numel()].view(shared.shape)
                local.copy_(shared)
        stream.synchronize()  # the copy has read the producer's block: the mapping may close
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        mapped = shared is not None
        del shared  # closing a mapping returns the producer's count (torch's IPC deleter)
        raise KVIPCRefused(f"could not map the cache: {exc}", mapped=mapped) from exc
    del shared
    return local


def release_refused(desc: Mapping[str, Any]) -> None:
    """Return the count a refused descriptor held, so the producer's block is not kept forever
    (only for a descriptor never mapped: closing a mapping returns it already)."""
    import torch

    ref = _unb64(desc.get("ref"))
    if ref:
        torch.UntypedStorage._release_ipc_counter(ref, int(desc["ref_offset"]))


def deferred_share(held: list[Any], ready: Any) -> Callable[[], tuple[dict[str, Any], Callable[[bool, bool], None]]]:
    """``PrefillOutput.share_kv`` over the device tensor in ``held`` (one item, written on the
    stream that recorded ``ready``), the same holder the host path (``hf.deferred_pack``) pops.

    ``share()`` returns ``(descriptor, answered)``; the worker calls ``answered(True)`` once decode
    has copied the cache (the tensor is dropped then, not when the request's decode ends) or
    ``answered(False, mapped)`` if decode refused it: the tensor is kept for the host copy, and its
    IPC count is returned here unless decode had mapped it (closing the mapping returned it)."""

    def share() -> tuple[dict[str, Any], Callable[[bool, bool], None]]:
        import torch

        if not held:
            raise RuntimeError("this KV cache was already packed or released")
        if ready is not None:
            ready.synchronize()  # the prefill's kernels wrote it
        with torch.cuda.device(held[0].device):
            desc = export(held[0])

        def answered(taken: bool, mapped: bool = False) -> None:
            if taken:
                held.clear()
            elif not mapped:
                release_refused(desc)

        return desc, answered

    return share
