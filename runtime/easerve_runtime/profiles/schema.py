"""The schema of the profile data, and of a user's profile file.

The shipped data (``data/models.json``, ``gpus.json``, ``links.json``, ``h200_anchors.json``) is
validated against these models in the tests, so a profile file that passes them is in the same
schema by construction. A **profile file** is one JSON document that names the profile it
defines and adds (or replaces) entries of the shipped files, each section in that file's schema
and named after it::

    {
      "profile": "my-vlm@h200",                      # <model>@<gpu>, resolved in the merged data
      "models": {"backbones": {...}, "encoders": {...}, "models": {...}},   # models.json
      "gpus": {"my-gpu": {...}},                     # gpus.json entries
      "links": {"my-link": {...}},                   # links.json entries
      "h200_anchors": {"encoders": {"my-enc": {"graph_ms": {"1": 8.0, "8": 54.1}}}},
      "engine": {"engine": "torch", "device": "...", "encode": [...], "prefill": [...], "decode": [...]}
    }

Every section is optional: ``{"profile": "llava-v1.6-34b@h200"}`` is the shipped profile. A new
encoder needs its entry in ``models.encoders`` and its measured H200 curve in
``h200_anchors.encoders`` (the only part of the anchors a file may add: the calibration of
prefill, decode and SM sharing stays the shipped one). Errors name the file and the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _drop_comments(d: Any) -> Any:
    """``_doc`` and other ``_``-prefixed keys are comments in every data file."""
    if isinstance(d, dict):
        return {k: v for k, v in d.items() if not str(k).startswith("_")}
    return d


class BackboneDoc(_Doc):
    """A decoder-only transformer's shape (``models.json`` → ``backbones``)."""

    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    ffn: int = Field(gt=0)
    vocab: int = Field(gt=0)
    tied_embeddings: bool = False
    gated_mlp: bool = True
    sliding_window: int | None = Field(default=None, gt=0)
    global_every: int | None = Field(default=None, gt=0)


class EncoderDoc(_Doc):
    """An encoder (``models.json`` → ``encoders``): what one item is and how many LLM tokens it
    yields; ``mode`` says which H200 table the curve follows (eager or CUDA graphs)."""

    params: int = Field(gt=0)
    tokens_per_item: int = Field(gt=0)
    item: str = Field(min_length=1)
    mode: Literal["eager", "graph"]


class ModelDoc(_Doc):
    """A served model (``models.json`` → ``models``): its encoder and backbone by name."""

    hf: str = Field(min_length=1)
    modality: Literal["image", "video", "audio"]
    encoder: str = Field(min_length=1)
    backbone: str = Field(min_length=1)
    anyres: bool = False


class ModelsDoc(_Doc):
    """``models.json``."""

    backbones: dict[str, BackboneDoc] = Field(default_factory=dict)
    encoders: dict[str, EncoderDoc] = Field(default_factory=dict)
    models: dict[str, ModelDoc] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _comments(cls, d: Any) -> Any:
        return _drop_comments(d)


class GPUDoc(_Doc):
    """One ``gpus.json`` entry: datasheet peaks and the GPU-to-GPU link."""

    label: str = Field(min_length=1)
    sms: int = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    link: str = Field(min_length=1)
    link_gbps: float = Field(gt=0)
    sustained_clock_fraction: float = Field(default=1.0, gt=0, le=1)


class LinkDoc(_Doc):
    """One ``links.json`` entry: achievable share of the spec bandwidth and fixed costs."""

    efficiency: float = Field(gt=0, le=1)
    allreduce_latency_us: float = Field(ge=0)
    transfer_setup_ms: float = Field(ge=0)
    embedding_setup_ms: float | None = Field(
        default=None, ge=0,
        description="Setup of one embedding transfer (one envelope), if it differs from transfer_setup_ms: "
        "the fabric's per-transfer registration and metadata cost on the embedding path.")
    kv_setup_ms: float | None = Field(
        default=None, ge=0, description="Setup of one KV handoff, if it differs from transfer_setup_ms.")
    kv_ipc_setup_ms: float | None = Field(
        default=None, ge=0,
        description="Setup of one KV handoff between two processes on one GPU (CUDA IPC: the decode maps the "
        "prefill's cache and copies it device to device), if it differs from kv_setup_ms.")


def _batch_table(v: dict[str, float] | None, what: str) -> dict[str, float] | None:
    if v is None:
        return v
    for k, ms in v.items():
        if not str(k).isdigit() or int(k) < 1:
            raise ValueError(f"{what}: batch sizes are positive integers, got {k!r}")
        if not ms > 0:
            raise ValueError(f"{what}: latencies are positive milliseconds, got {ms!r} at batch {k}")
    if len(v) < 2:
        raise ValueError(f"{what}: needs at least two batch sizes (the curve continues the last slope)")
    return v


class EncoderAnchorsDoc(_Doc):
    """One encoder's measured H200 latencies (ms) per batch (``h200_anchors.json`` → ``encoders``)."""

    graph_ms: dict[str, float] | None = None
    eager_ms: dict[str, float] | None = None

    @field_validator("graph_ms")
    @classmethod
    def _graph(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return _batch_table(v, "graph_ms")

    @field_validator("eager_ms")
    @classmethod
    def _eager(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return _batch_table(v, "eager_ms")

    @model_validator(mode="after")
    def _one(self) -> EncoderAnchorsDoc:
        if not self.graph_ms and not self.eager_ms:
            raise ValueError("needs graph_ms or eager_ms (measured H200 latency per batch size)")
        return self


class AnchorsOverlayDoc(_Doc):
    """What a profile file may add to ``h200_anchors.json``: encoder curves only."""

    encoders: dict[str, EncoderAnchorsDoc] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _comments(cls, d: Any) -> Any:
        return _drop_comments(d)


class EncodePointDoc(_Doc):
    """One encoder micro-batch measured on an engine: ``items`` encoder items (crops, frame pairs,
    audio windows) in ``ms`` milliseconds, preprocessing included, on the whole GPU."""

    items: int = Field(gt=0)
    ms: float = Field(gt=0)


class PrefillPointDoc(_Doc):
    """One prefill measured on an engine: a ``tokens``-token prompt to its first token, in ``ms`` (the
    first call at that length, as serving pays it); ``warm_ms``: the same prompt repeated at once."""

    tokens: int = Field(gt=0)
    ms: float = Field(gt=0)
    warm_ms: float | None = Field(default=None, gt=0)


class DecodePointDoc(_Doc):
    """One decode step measured on an engine: ``batch`` sequences holding ``context_tokens`` KV
    tokens in all (a total over the batch, as the twin counts it), in ``ms``."""

    batch: int = Field(gt=0)
    context_tokens: int = Field(ge=0)
    ms: float = Field(gt=0)


class MPSSharingDoc(_Doc):
    """How pods that share this GPU under MPS slow each other (``sim.mpsshare``), fitted on this card's
    served runs (``benchmarks/twin_agreement.py --mps-fit --write-profile``): the constants of
    the MPS twin. Unset, the twin uses the ones fitted on the H200 (runs 14-15)."""

    contention: float = Field(
        ge=0, le=5, description="Any work dispatched while another pod on the GPU has work in flight pays 1 + this "
        "(memory bandwidth and caches, whatever the SM split).")
    decode_corun: float = Field(
        ge=0, le=5, description="A decode step dispatched while a capped pod has work in flight pays 1 + this as "
        "well, whatever the caps.")
    decode_saturation: float = Field(
        gt=0, le=1, description="The SM fraction on which a decode step reaches the GPU's memory bandwidth: with "
        "less left to it by the caps in flight, it runs that much slower (0.05 turns the rule off).")
    encode_corun: float = Field(
        default=0.0, ge=0, le=5, description="An encoder micro-batch dispatched while another pod on the GPU has "
        "work in flight pays 1 + this as well (on the H100 the served encoder beside decode took 1.3-1.8x what "
        "the twin charged without it, run 23); 0: none.")
    decode_contention: float | None = Field(
        default=None, ge=0, le=5, description="The contention a decode step pays while another pod has work in "
        "flight; unset: contention's.")
    decode_row_ms: float = Field(
        default=0.0, ge=0, le=20, description="Milliseconds an uncapped decode step pays per running sequence on a "
        "GPU that capped pods share, whether or not they have work in flight (on the H100 the served step over the "
        "profile's grew 0.36-0.38 ms a row in every capped layout, runs 18-26); 0: none.")
    decode_row_extra_ms: float = Field(
        default=0.0, ge=0, le=20, description="Milliseconds a decode step pays per running sequence on top of "
        "decode_row_ms for each capped pod beyond the first that runs prefill on its GPU (a local prefill in an "
        "encode pod, a remote prefill pod): on the H100 the per-row excess read 0.37 ms with prefill in one capped "
        "pod and 0.40 with two (runs 18-28); 0: none.")
    fitted_on: str | None = Field(default=None, description="The runs the constants were fitted on, for reports.")


class AggregatedLoopDoc(_Doc):
    """What the engine's aggregated worker pays per admitted request for encode and prefill, over what
    the twin charges from the points above for the same requests: read off the served loop's own
    counters at low load (``benchmarks/twin_agreement.py --calibrate-aggregated --write-profile``).
    The aggregated worker encodes and prefills one request at a time inside its loop (processor,
    prompt assembly, KV handed to a decode slot), which the per-stage points, timed on the
    disaggregated engines' calls, do not include. Unset: 1 (the points as they are)."""

    encode_over_profile: float = Field(
        gt=0, le=20, description="The aggregated loop's encode time per request over the twin's for the same requests.")
    prefill_over_profile: float = Field(
        gt=0, le=20, description="The aggregated loop's prefill time per request over the twin's for the same requests.")
    measured_on: str | None = Field(default=None, description="The served run the ratios were read off, for reports.")


class EngineDoc(_Doc):
    """Stage times measured on a serving engine (``easerve profile --engine torch``, docs/profiles.md,
    "Profiles measured on an engine"). The analytic model is kept for what was not measured (SM
    shares, TP degrees, other batch sizes and contexts): each stage's time is the model's times
    the ratio measured/model at the nearest measured points."""

    engine: str = Field(min_length=1, description="The engine measured (torch).")
    device: str = Field(min_length=1, description="The device it ran on, as torch names it.")
    encode: list[EncodePointDoc] = Field(default_factory=list)
    encode_host: list[EncodePointDoc] = Field(
        default_factory=list,
        description="Of an encode point's milliseconds, those spent on the host's CPU (image decode and the "
        "processor, where spec.encode.preprocessing is cpu) while the GPU is not held. The twin keeps the "
        "encoder busy for the whole point but counts only the rest as GPU work in flight on a GPU that pods "
        "share (sim.mpsshare). Empty: all of it is GPU work (preprocessing on the GPU).")
    prefill: list[PrefillPointDoc] = Field(default_factory=list)
    decode: list[DecodePointDoc] = Field(default_factory=list)
    request_path_ms: float | None = Field(
        default=None, ge=0,
        description="Latency each request spends on the serving path outside the engines before its first "
        "token (HTTP, chat parsing, request-plane hops, embedding bytes over the wire), measured at zero load: "
        "the served TTFT p50 minus the engines' own. The twin adds it to every request's path; no GPU is "
        "busy for it.")
    decode_loop_overhead_ms: float | None = Field(
        default=None, ge=0,
        description="What each iteration of the served decode loop costs beyond the step timed above (host "
        "bookkeeping, admission, streaming tokens out), measured at zero load: the served TPOT p50 minus the "
        "twin's without this term, on the same requests (benchmarks/twin_agreement.py --calibrate-path). The twin adds it to every decode step and "
        "charges it with the step (on a GPU that pods share, it time-slices too: the waits are at its syncs).")
    decode_loop_row_ms: float | None = Field(
        default=None, ge=0, le=20,
        description="What each iteration of the served decode loop costs per running sequence on top of "
        "decode_loop_overhead_ms (the loop fanning each row's token out to its request's stream): a property of "
        "the host's CPU, read off a served run's decode-loop counters (loop iteration minus engine step, over the "
        "rows; benchmarks/twin_agreement.py --calibrate-loop). The twin adds it times the rows to every decode step.")
    mixed_iteration: Literal["fused", "sequential"] | None = Field(
        default=None,
        description="How the engine's aggregated loop runs an iteration that prefills and decodes. fused: one "
        "forward over prefill chunks and decode tokens (vLLM's chunked prefill), timed as the larger of the two; "
        "sequential: whole prompts are prefilled, then the decode step runs, timed as their sum (the torch "
        "engine's aggregated worker). Unset: fused.")
    mps: MPSSharingDoc | None = Field(
        default=None, description="The MPS twin's constants for this card (sim.mpsshare), fitted on served runs; "
        "unset: the H200's.")
    aggregated: AggregatedLoopDoc | None = Field(
        default=None, description="The aggregated worker's own encode and prefill per request over the twin's "
        "(sim.aggregated), read off a served low-load run; unset: 1.")


class ProfileFileDoc(_Doc):
    """A user's profile file (docs/profiles.md, "Your own profile")."""

    profile: str = Field(pattern=r"^[^@\s]+@[^@\s]+$", description="<model>@<gpu> this file defines.")
    models: ModelsDoc = Field(default_factory=ModelsDoc)
    gpus: dict[str, GPUDoc] = Field(default_factory=dict)
    links: dict[str, LinkDoc] = Field(default_factory=dict)
    h200_anchors: AnchorsOverlayDoc = Field(default_factory=AnchorsOverlayDoc)
    engine: EngineDoc | None = Field(
        default=None, description="Stage times measured on an engine, laid over the analytic model.")

    @model_validator(mode="before")
    @classmethod
    def _comments(cls, d: Any) -> Any:
        d = _drop_comments(d)
        if isinstance(d, dict):
            for k in ("gpus", "links"):
                if k in d:
                    d[k] = _drop_comments(d[k])
        return d


def validation_lines(exc: ValidationError) -> list[str]:
    """``section.key.field: message`` per error (pydantic's own wording after the path)."""
    out = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(document)"
        msg = "unknown field" if e["type"] == "extra_forbid" or e["type"] == "extra_forbidden" else e["msg"]
        out.append(f"{loc}: {msg}")
    return out
