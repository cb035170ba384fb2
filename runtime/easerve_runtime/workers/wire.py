"""The messages stages exchange over Dynamo's request plane (JSON objects), in one place.

Frontend -> encode (``<ns>.encode.generate``), one request::

    {"id", "seed", "text_tokens", "max_tokens", "priority", "deadline",
     "parts": [{"kind", "mime", "media": {...}, "b64"}]}

  ``deadline`` is the request's absolute deadline (Unix seconds, ``spec.limits.requestTimeoutSeconds``
  after admission); it rides along to prefill in the envelope's request entries.

  streams back ``{"token": int}`` items, then ``{"done": true, "route", "prompt_tokens"}``, or
  ``{"error": str}`` at any point.

Encode -> prefill (``<ns>.prefill.generate`` or the pod's ``<ns>.local_prefill_<key>.generate``),
one ENVELOPE per destination per micro-batch::

    {"buffer": base64, "index": [IndexEntry.wire()...],
     "requests": [{"id", "seed", "text_tokens", "mm_tokens", "max_tokens", "priority"}]}

  streams back ``{"ack": true}`` once unpacked (this frees the sender's window slot), then per
  request ``{"id", "token"}``..., ``{"id", "done": true}`` or ``{"id", "error"}``, multiplexed.

Prefill -> decode (``<ns>.decode.generate``), one request after prefill::

    {"id", "seed", "context_tokens", "max_tokens", "first_token", "kv_bytes", "priority"}

  streams back ``{"token": int}`` for tokens 2..max_tokens (the first came from prefill), and
  ``{"finish_reason": "stop"}`` last when a stop token ended it early. A real engine first sends
  the KV cache to the same instance as ``{"kv_chunk": {"id", "seq", "of", "b64"}}`` messages (each
  answered ``{"ack": true}``), then the request above with ``"kv_meta"`` and ``"kv_chunks"`` and
  the sampling fields ``"temperature"``, ``"top_p"`` (and ``"ignore_eos"`` when the client set it:
  no stop token ends the sequence).

Tokens travel as integer ids; the frontend renders them to text. Binary data is base64 because
the request plane carries JSON-like objects.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from easerve_runtime.engines.base import MediaPart

if TYPE_CHECKING:
    from easerve_runtime.api import EPDDeploymentSpec


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: str) -> bytes:
    return base64.b64decode(text)


def part_to_wire(part: MediaPart) -> dict[str, Any]:
    return {"kind": part.kind, "mime": part.mime, "media": dict(part.media), "b64": b64e(part.data)}


def part_from_wire(d: dict[str, Any]) -> MediaPart:
    return MediaPart(
        kind=str(d["kind"]), data=b64d(d.get("b64", "")), mime=str(d.get("mime", "")), media=d["media"]
    )


def request_meta(req: dict[str, Any], mm_tokens: int) -> dict[str, Any]:
    """The per-request part of an envelope (everything but the media)."""
    meta = {
        "id": req["id"],
        "seed": int(req.get("seed", 0)),
        "text_tokens": int(req["text_tokens"]),
        "mm_tokens": int(mm_tokens),
        "max_tokens": int(req["max_tokens"]),
        "priority": int(req.get("priority", 0)),
        "deadline": float(req.get("deadline") or 0.0),
    }
    for k in ("temperature", "top_p"):  # sampling, when the client set it (the sim engine ignores it)
        if k in req:
            meta[k] = float(req[k])
    if req.get("ignore_eos"):  # generate max_tokens whatever they are (benchmarks)
        meta["ignore_eos"] = True
    return meta


def media_tokens_for(spec: EPDDeploymentSpec) -> Callable[[MediaPart], int]:
    """LLM tokens of one media part by the model's own patching (``workload.media``), before any
    encoder has run: what the frontend's prompt limit and the aggregated worker's admission count.
    The part's own kind decides (a video deployment also takes images)."""
    from easerve_runtime.workload.media import is_anyres, items_tokens

    anyres = is_anyres(spec.model.name)

    def tokens(part: MediaPart) -> int:
        return int(items_tokens(part.kind, dict(part.media), anyres=anyres)[1])

    return tokens
