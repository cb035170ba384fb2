"""The engine protocol: what a worker asks of the hardware, and nothing about how.

Workers (``easerve_runtime.workers``) own queues, batching, routing and transport; an engine
only runs one batch of one stage and returns its outputs. Splitting the protocol per stage lets
an implementation cover only the stage it accelerates (the torch encoder in
``engines/torch_encode.py`` implements :class:`EncodeEngine` alone) while the sim engine covers
all three.

Every call is ``async`` because a real engine awaits a device (or a thread) and the sim engine
awaits its modelled latency: either way the worker's event loop keeps accepting arrivals while
a batch runs, which is what lets the micro-batcher see requests accumulate during a busy encoder.

Data crossing the protocol is plain bytes plus shape/dtype so that it can be packed into an
envelope (``policies.envelope``) and sent over Dynamo's TCP request plane without a framework
tensor type leaking into the transport.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

PART_KINDS = ("image", "audio", "video")
"""Media part kinds a request may carry (text is counted in ``text_tokens``, not a part)."""


@dataclass(frozen=True)
class MediaPart:
    """One decoded media input of a request: an image, an audio clip or a video.

    ``data`` holds the raw encoded bytes as received (PNG/JPEG, WAV/MP3, MP4...); real encoders
    decode them. ``media`` is the descriptor the frontend read from the headers, in the shape
    ``easerve_runtime.workload`` uses (``{"height", "width"}`` for images, ``{"frames", ...}`` for
    video, ``{"audio_s"}`` for audio): the sim engine charges work from it through
    ``workload.items_tokens``, exactly as the discrete-event twin does for the same request.
    """

    kind: str
    data: bytes
    mime: str = ""
    media: Mapping[str, Any] = field(default_factory=dict)


FRAME_LIST_MIME = "video/x-image-frames"
"""A video sent as a list of image frames: the part's ``data`` is the frames' bytes end to end and
``media.frame_bytes`` the length of each (``workers.openai`` makes it, ``video_frames`` splits it)."""
FRAME_LIST_FPS = 2.0
"""The frame rate a frame list is taken at when the request does not say (qwen-vl-utils' default)."""


def video_frames(part: MediaPart) -> list[bytes] | None:
    """The frames of a frame-list video part, or None for a container (mp4, webm, avi)."""
    sizes = part.media.get("frame_bytes") if part.mime == FRAME_LIST_MIME else None
    if not sizes:
        return None
    out, at = [], 0
    for n in sizes:
        out.append(part.data[at : at + int(n)])
        at += int(n)
    return out


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling: ``temperature <= 0`` is greedy; ``top_p`` nucleus; ``seed`` makes it repeatable."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Sampling:
        return cls(float(d.get("temperature", 1.0)), float(d.get("top_p", 1.0)), int(d.get("seed", 0)))

    def wire(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}


@dataclass(frozen=True)
class EncodeInput:
    """The encode stage's view of one request.

    ``messages`` is the chat with media parts reduced to ``{"type": kind}`` placeholders (in
    order, matching ``parts``): a real engine applies the model's chat template and processor to
    it and returns the prompt's token ids with the embeddings; the sim engine ignores it.
    """

    request_id: str
    parts: tuple[MediaPart, ...]
    seed: int = 0
    messages: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Embedding:
    """The encoder output for one request: ``tokens`` embedding rows as one contiguous buffer.

    ``shape`` is ``(tokens, hidden)`` and ``dtype`` a numpy dtype name (``"bfloat16"`` is carried
    as raw 2-byte values); ``len(data) == prod(shape) * itemsize``.
    """

    request_id: str
    data: bytes | memoryview
    """Bytes, or a read-only view of a host buffer (a GPU engine copies a micro-batch's rows to the
    host once and hands out views, rather than one more host copy per request)."""
    shape: tuple[int, ...]
    dtype: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able facts the prefill needs with the rows (a real engine: ``input_ids``, ``text_tokens``)."""

    @property
    def tokens(self) -> int:
        return int(self.shape[0]) if self.shape else 0


@dataclass(frozen=True)
class PrefillInput:
    """One request ready for prefill: its text tokens plus the multimodal embedding rows."""

    request_id: str
    text_tokens: int
    mm_tokens: int
    seed: int = 0
    embedding: Any = None
    """The embedding rows as an array (``(mm_tokens, hidden)``), or None; the sim engine ignores it."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    sampling: Sampling | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.mm_tokens


@dataclass(frozen=True)
class PrefillOutput:
    """Prefill's result: the first generated token and the KV cache handed to decode.

    ``kv_bytes`` is the size of the KV cache that the decode worker must receive. The sim engine
    does not materialise it (a 34B model's cache is hundreds of MB per request); the handoff time
    is charged from this size through the profile's transfer model instead.
    """

    request_id: str
    first_token: int
    kv_bytes: int
    kv: bytes | bytearray | memoryview | None = None
    """The KV cache itself (a real engine), ``kv_bytes`` long, laid out as ``kv_meta`` says."""
    kv_meta: Mapping[str, Any] = field(default_factory=dict)
    pack_kv: Callable[[], bytes | bytearray | memoryview] | None = None
    """A real engine may leave the cache on the device and give this instead: it returns the bytes
    (blocking; the worker calls it in a thread, AFTER the first token went out). Why: the
    device-to-host copy of a 7B model's 2,900-token cache (~390 MB) took longer than the prefill
    itself, and every request of the batch waited for it before its first token."""
    kv_local: Any = None
    """The cache as the engine holds it (a torch tensor, on the device): what a decode engine in
    the SAME process (the aggregated worker) loads into its slot without any host copy."""
    share_kv: Callable[[], tuple[dict[str, Any], Callable[[bool, bool], None]]] | None = None
    """A real engine on CUDA may offer this beside ``pack_kv``: it returns a descriptor that a decode
    process on the SAME GPU maps (``engines.kv_ipc``; blocking, called in a thread) and what to call
    with that decode's answer (True: copied; False: refused, the host path follows). Why: the host
    path cost ~150 ms a request on one H100 (GPU run 27)."""

    def has_kv(self) -> bool:
        return self.kv is not None or self.pack_kv is not None or self.share_kv is not None


@dataclass
class DecodeSequence:
    """A sequence being decoded: mutable because each step appends one token."""

    request_id: str
    context_tokens: int
    max_tokens: int
    seed: int = 0
    generated: list[int] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    sampling: Sampling | None = None
    kv: bytes | bytearray | memoryview | mmap.mmap | None = None
    """The handed-over cache's bytes (a same-host blob arrives as a private mapping of its file)."""
    kv_meta: Mapping[str, Any] = field(default_factory=dict)
    kv_local: Any = None
    """The cache as a prefill engine in this process left it (``PrefillOutput.kv_local``), or None."""
    kv_ipc: Mapping[str, Any] | None = None
    """The cache as a prefill process on this GPU left it: a CUDA IPC descriptor (``engines.kv_ipc``)
    that the engine maps and copies when it stages the cache, or None."""

    @property
    def stopped(self) -> bool:
        """The last token is a stop token (finish reason ``stop``)."""
        return bool(self.generated) and self.generated[-1] in self.stop_token_ids

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens or self.stopped


@runtime_checkable
class EncodeEngine(Protocol):
    """Encodes one micro-batch. ``sm_share`` in (0, 1] is the fraction of the GPU's SMs granted."""

    async def encode(self, batch: Sequence[EncodeInput], sm_share: float = 1.0) -> list[Embedding]: ...


@runtime_checkable
class PrefillEngine(Protocol):
    """Prefills one batch of requests whose embeddings have arrived."""

    async def prefill(self, batch: Sequence[PrefillInput], sm_share: float = 1.0) -> list[PrefillOutput]: ...


@runtime_checkable
class DecodeEngine(Protocol):
    """Runs one decode step over the running batch; returns one new token per sequence, in order.

    The caller appends the tokens and removes finished sequences; the engine keeps no per-request
    state, so a worker can add or drop sequences between any two steps (continuous batching).
    """

    async def decode_step(self, batch: Sequence[DecodeSequence]) -> list[int]: ...

    async def receive_kv(self, kv_bytes: int) -> None:
        """Account for receiving a KV cache of ``kv_bytes`` from prefill (sim: a modelled wait)."""
        ...


@runtime_checkable
class SlotDecodeEngine(DecodeEngine, Protocol):
    """A decode engine that holds each running sequence's KV cache in a bounded set of slots.

    The worker asks ``can_admit`` before a waiting sequence joins (admission waits while memory
    is full, never OOMs), ``admit`` loads its KV (``seq.kv``) at a step boundary, and
    ``release`` frees the slot when it leaves.
    """

    def can_admit(self, seq: DecodeSequence) -> bool: ...

    async def admit(self, seq: DecodeSequence) -> None: ...

    def release(self, request_id: str) -> None: ...


class Engine(EncodeEngine, PrefillEngine, DecodeEngine, Protocol):
    """An engine that covers all three stages (the sim engine does)."""
