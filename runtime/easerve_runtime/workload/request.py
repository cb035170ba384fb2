"""What one request is, and what happened to it.

`Request` is the unit every load source shares: the generator makes them, JSONL traces store
them, the discrete-event twin and the live load client (`easerve bench`) replay them. It carries
both the media descriptor (what a client would send: an image size, a frame count, clip seconds)
and the token/encoder-item counts derived from it, so that the twin and the runtime's sim engine
charge exactly the same work for the same request.

`RequestRecord` is what a run observed for one request (virtual or wall-clock seconds, any
origin shared with `arrival_s`). Metrics are computed from records only, so the twin and the live
client report with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Request:
    """One multimodal request.

    ``encoder_items`` is what the encoder batches over (image crops, frame pairs, 30 s audio
    windows); ``media_tokens`` is what the encoder hands to the LLM; the prefill length is
    ``prompt_tokens + media_tokens``. The first output token comes from prefill, the other
    ``output_tokens - 1`` from decode steps.
    """

    id: str
    arrival_s: float
    modality: str
    media: dict[str, Any] = field(default_factory=dict)
    encoder_items: int = 1
    prompt_tokens: int = 0
    media_tokens: int = 0
    output_tokens: int = 1
    priority: int = 0
    output_class: str | None = None

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens + self.media_tokens

    def validate(self) -> None:
        """Raise ValueError naming the field when a request cannot be served as described."""
        if not self.id:
            raise ValueError("request.id: must be non-empty")
        if not self.arrival_s >= 0.0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.encoder_items < 0:
            raise ValueError(f"request {self.id}: encoder_items must be >= 0, got {self.encoder_items}")
        if self.prompt_tokens < 0 or self.media_tokens < 0:
            raise ValueError(f"request {self.id}: prompt_tokens/media_tokens must be >= 0")
        if self.prompt_tokens + self.media_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens + media_tokens must be >= 1")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.id}: output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(slots=True)
class RequestRecord:
    """What a run observed for one request. ``error`` set means the request failed."""

    id: str
    arrival_s: float
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    error: str | None = None
    route: str | None = None  # "remote" | "local" | None (aggregated / not routed)
    # when the second token arrived: in disaggregated serving the first comes from the prefill
    # worker and the second from decode, so the gap holds the KV handoff and the decode's admission,
    # which TPOT spreads over the tokens (None: not observed, e.g. the twin's aggregated replica)
    second_token_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None and self.finish_s is not None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for single-token outputs."""
        assert self.first_token_s is not None and self.finish_s is not None
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def token2_gap_s(self) -> float | None:
        """Time from the first token to the second (None where the second was not observed)."""
        if self.first_token_s is None or self.second_token_s is None:
            return None
        return self.second_token_s - self.first_token_s
