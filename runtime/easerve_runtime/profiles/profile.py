"""``Profile``: latency and size model of one (model, GPU) pair, derived from H200 measurements.

How each cost is modelled (details and every number's source: docs/profiles.md):

- **Encode** (compute-bound at useful batch sizes): the H200 curve of GPU work vs batch, scaled
  by the peak-FLOP ratio H200/GPU and by the SM-share multiplier from the measured CLIP knee
  table; an eager encoder additionally pays a host floor (kernel-launch bound, CPU-side, so it
  does not scale with the GPU): ``max(floor, gpu_work + overhead)``.
- **Prefill** (compute-bound): FLOPs (2·params·tokens + causal attention) over the GPU's peak
  times the efficiency measured on the H200 for that many tokens, split over TP ranks, plus two
  ring all-reduces per layer on the GPU's link; never below the time to stream the weights once.
- **Decode step** (bandwidth-bound): a per-layer floor (small kernels) + weights/TP over HBM +
  KV bytes/TP over HBM (both with efficiencies fitted on the H200) + a batch-dependent extra
  (fitted on the 34B/H200 sweep and scaled by FLOPs) + all-reduces.
- **Transfers**: a fixed setup per transfer + bytes over the link's achievable bandwidth.
- **Measured on an engine** (a profile file's ``engine`` section): encode, prefill and decode
  times above are multiplied by measured / model at the nearest measured points
  (``profiles.measured``), so the profile reproduces what the engine did where it was measured.

All methods are plain float arithmetic (no pydantic, no numpy) so the twin can call them
millions of times; ``encode_s`` is memoised since its arguments take few distinct values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.profiles.calibration import REF_GPU, Calibration, EncoderCalib
from easerve_runtime.profiles.hardware import BYTES_BF16, GPU, Backbone, TransferPath, gpu
from easerve_runtime.profiles.measured import StageCorrections

TP_CHOICES = (1, 2, 4, 8)
USABLE_MEMORY_FRACTION = 0.90
"""Share of device memory a serving engine may use (vLLM's default gpu_memory_utilization)."""
ACTIVATION_RESERVE_BYTES = 2 * 1024**3
"""Per GPU: activations, CUDA graphs, NCCL buffers and allocator slack outside weights and KV."""
KV_RESERVE_TOKENS = 16_384
"""``min_tp`` requires room for at least this many cached tokens (e.g. 8 sequences of 2k)."""


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    model: str
    gpu: str
    encoder: str
    modality: str
    hf_name: str
    backbone: Backbone
    hw: GPU
    tokens_per_encoder_item: int
    encoder_item: str
    encoder_mode: str
    anyres: bool
    calib: Calibration = field(repr=False)
    _enc: EncoderCalib = field(repr=False)
    corrections: StageCorrections | None = field(default=None, repr=False)
    """measured / model ratios of an engine profile (``profiles.measured``); None: the model as is."""
    _cache: dict[tuple[int, float], float] = field(init=False, repr=False, compare=False)
    _k: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Fold every constant of the hot paths into one dict once (the twin calls them per event)."""
        c, bb, hw = self.calib, self.backbone, self.hw
        k: dict[str, float] = {}
        object.__setattr__(self, "_k", k)  # fresh per instance, also under dataclasses.replace()
        object.__setattr__(self, "_cache", {})
        k["flops_scale"] = gpu(REF_GPU).flops_per_s / hw.flops_per_s
        k["layer_floor_s"] = bb.layers * c.floor_per_layer_s
        k["weights_s"] = bb.decode_stream_bytes / (hw.hbm_bytes_per_s * c.eta_weights)  # at tp = 1
        k["kv_s_per_byte"] = 1.0 / (hw.hbm_bytes_per_s * c.eta_kv)
        k["extra_scale"] = (bb.decode_flops_per_token / c.decode_extra_ref_flops) * k["flops_scale"]
        k["kv_global"] = float(bb.kv_bytes_per_token_layer * bb.global_layers)
        k["kv_local"] = float(bb.kv_bytes_per_token_layer * bb.local_layers)
        k["window"] = float(bb.sliding_window) if bb.sliding_window else math.inf
        k["allreduces"] = 2.0 * bb.layers
        k["act_bytes_per_token"] = float(bb.hidden * BYTES_BF16)
        k["flops_per_s"] = hw.flops_per_s

    @property
    def request_path_s(self) -> float:
        """The serving path's own latency per request, outside the engines (an engine profile's
        ``request_path_ms``; 0 for a modelled profile, which knows nothing of the host)."""
        return self.corrections.request_path_s if self.corrections is not None else 0.0

    @property
    def decode_overhead_s(self) -> float:
        """The served decode loop's cost per iteration beyond the step (an engine profile's
        ``decode_loop_overhead_ms``; 0 for a modelled profile)."""
        return self.corrections.decode_overhead_s if self.corrections is not None else 0.0

    @property
    def decode_row_overhead_s(self) -> float:
        """The served decode loop's host cost per running sequence per iteration, beyond
        ``decode_overhead_s`` (an engine profile's ``decode_loop_row_ms``; 0 for a modelled profile)."""
        return self.corrections.decode_row_overhead_s if self.corrections is not None else 0.0

    @property
    def mixed_iteration(self) -> str:
        """How the engine's aggregated loop runs prefill beside decode: ``fused`` (the modelled
        vLLM-style engine) or ``sequential`` (an engine profile that says so)."""
        return self.corrections.mixed_iteration if self.corrections is not None else "fused"

    @property
    def mps_constants(self) -> Mapping[str, float] | None:
        """The MPS twin's constants fitted on this card (an engine profile's ``engine.mps``:
        ``measured.MPS_CONSTANTS``); None: ``sim.mpsshare``'s own, fitted on the H200."""
        return self.corrections.mps if self.corrections is not None else None

    @property
    def aggregated_loop(self) -> Mapping[str, float] | None:
        """The aggregated worker's own encode and prefill per request over the twin's (an engine
        profile's ``engine.aggregated``: ``encode_over_profile``, ``prefill_over_profile``); None: 1."""
        return self.corrections.aggregated if self.corrections is not None else None

    def encode_host_share(self, batch: int) -> float:
        """The share of an encoder micro-batch of ``batch`` items spent on the host's CPU with the GPU
        not held (an engine profile's ``encode_host``: CPU preprocessing); 0 for a profile without it."""
        c = self.corrections
        if c is None or c.encode_host is None or batch <= 0:
            return 0.0
        return min(1.0, max(0.0, c.encode_host(batch)))

    # ------------------------------------------------------------------ sizes
    @property
    def weight_bytes(self) -> int:
        return self.backbone.weight_bytes

    @property
    def gpu_memory_bytes(self) -> int:
        return self.hw.memory_bytes

    @property
    def sms(self) -> int:
        return self.hw.sms

    sm_count = sms  # the name the twin's adapter looks for

    def embedding_bytes(self, tokens: int) -> int:
        """Projected multimodal embeddings handed to prefill: tokens × LLM hidden × bf16."""
        return max(0, int(tokens)) * self.backbone.hidden * BYTES_BF16

    def kv_bytes(self, tokens: int) -> int:
        """KV cache of one sequence of ``tokens`` (sliding-window layers hold only the window)."""
        return int(math.ceil(self.backbone.kv_bytes(tokens)))

    def kv_budget_bytes(self, tp: int = 1, memory_fraction: float = USABLE_MEMORY_FRACTION) -> int:
        """KV cache a worker of ``tp`` GPUs can hold after weights and reserves (≤ 0 if it does
        not fit), when the engine may use ``memory_fraction`` of each GPU's memory
        (``spec.decode.kvMemoryFraction`` for decode admission)."""
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        per_gpu = memory_fraction * self.hw.memory_bytes - ACTIVATION_RESERVE_BYTES
        return int(tp * per_gpu - self.weight_bytes)

    def fits(self, tp: int = 1) -> bool:
        """Weights plus a KV reserve of ``KV_RESERVE_TOKENS`` fit on ``tp`` GPUs."""
        return self.kv_budget_bytes(tp) >= self.backbone.kv_bytes(KV_RESERVE_TOKENS)

    def min_tp(self) -> int:
        for tp in TP_CHOICES:
            if self.fits(tp):
                return tp
        raise ValueError(f"{self.name}: {self.weight_bytes / 1e9:.1f} GB of weights do not fit on 8 GPUs")

    # ------------------------------------------------------------------ media -> items/tokens
    def tokens_per_item(self, kind: str | None = None) -> int:
        """LLM tokens one encoder item yields (CLIP crop 576, Qwen frame pair 256, Whisper
        30 s window ≈188). ``kind`` (a media part kind) is accepted for callers that pass it;
        a kind of another modality is an error rather than a silent guess."""
        if kind is not None and kind not in (self.modality, "image_url", "input_audio", "video_url", "video"):
            raise ValueError(f"{self.name}: media kind {kind!r} does not match modality {self.modality!r}")
        return self.tokens_per_encoder_item

    def items_tokens(self, media: dict[str, Any]) -> tuple[int, int]:
        """(encoder items, LLM tokens) for one media descriptor ({height,width} | {frames} |
        {audio_s}), following the encoder's own patching (``workload.media``)."""
        from easerve_runtime.workload.media import items_tokens

        return items_tokens(self.modality, media, anyres=self.anyres)

    def items_per_request(self, media: dict[str, Any]) -> int:
        return self.items_tokens(media)[0]

    # ------------------------------------------------------------------ latencies
    @property
    def _flops_scale(self) -> float:
        """H200 time → this GPU's time for compute-bound work."""
        return self._k["flops_scale"]

    def encode_s(self, batch: int, sm_share: float = 1.0) -> float:
        """One encoder forward of ``batch`` items on ``sm_share`` of this GPU's SMs."""
        key = (batch, sm_share)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if batch <= 0:
            return 0.0
        if not 0.0 < sm_share <= 1.0:
            raise ValueError(f"sm_share must be in (0, 1], got {sm_share}")
        e = self._enc
        work = e.compute(batch) * self._flops_scale * self.calib.sm_ratio(batch, sm_share)
        t = max(e.floor_s, work + e.overhead_s)
        c = self.corrections
        if c is not None and c.encode is not None:
            t *= c.encode(batch)
        if len(self._cache) < 100_000:
            self._cache[key] = t
        return t

    def encoder_capacity(self, batch: int, sm_share: float = 1.0) -> float:
        """Encoder items per second at a steady batch size."""
        return batch / self.encode_s(batch, sm_share)

    def _kv_total(self, batch: int, context_tokens: float) -> float:
        """KV bytes of ``batch`` sequences holding ``context_tokens`` in total (equal lengths)."""
        k = self._k
        per_seq = context_tokens / batch
        return batch * (k["kv_global"] * per_seq + k["kv_local"] * min(per_seq, k["window"]))

    def prefill_s(self, tokens: int, sm_share: float = 1.0, tp: int = 1, sequences: int = 1) -> float:
        """One prefill batch of ``tokens`` total tokens (``sequences`` prompts of equal length) on a
        worker of ``tp`` GPUs, each with ``sm_share`` of its SMs. ``sm_share < 1`` means sharing an
        encode GPU: the measured co-run penalty κ applies (see ``local_prefill_efficiency``)."""
        if tokens <= 0:
            return 0.0
        if tp not in TP_CHOICES:
            raise ValueError(f"tp must be one of {TP_CHOICES}, got {tp}")
        if not 0.0 < sm_share <= 1.0:
            raise ValueError(f"sm_share must be in (0, 1], got {sm_share}")
        k = self._k
        flops = self.backbone.prefill_flops(tokens, sequences)
        compute = flops / (k["flops_per_s"] * self.calib.prefill_fraction(tokens)) / tp
        floor = k["layer_floor_s"] + k["weights_s"] / tp
        t = compute if compute > floor else floor
        if sm_share < 1.0:
            t /= sm_share * self.calib.kappa
        c = self.corrections
        if c is not None and c.prefill is not None:
            t *= c.prefill(tokens)
        if tp > 1:
            t += k["allreduces"] * self.hw.link.allreduce_s(tokens * k["act_bytes_per_token"], tp)
        return t

    def decode_step_s(self, batch: int, context_tokens: float, tp: int = 1) -> float:
        """One continuous-batching decode step for ``batch`` sequences holding ``context_tokens``
        cached tokens IN TOTAL (summed over the batch)."""
        if batch <= 0:
            return 0.0
        if tp not in TP_CHOICES:
            raise ValueError(f"tp must be one of {TP_CHOICES}, got {tp}")
        k = self._k
        ctx = context_tokens if context_tokens > 0.0 else 0.0
        t = k["layer_floor_s"] + k["weights_s"] / tp + self._kv_total(batch, ctx) * k["kv_s_per_byte"] / tp
        t += self.calib.decode_extra(batch) * k["extra_scale"] / tp
        c = self.corrections
        if c is not None and c.decode is not None:
            t *= c.decode(batch)
        if tp > 1:
            t += k["allreduces"] * self.hw.link.allreduce_s(batch * k["act_bytes_per_token"], tp)
        return t

    def transfer_s(self, nbytes: int, transfers: int = 1, *, path: TransferPath = "embedding") -> float:
        """``transfers`` point-to-point sends totalling ``nbytes`` over this GPU's link, on the
        embedding path (envelopes) or the KV path (handoffs): each path has its own setup cost,
        because a fabric's per-transfer registration and metadata cost is what envelopes amortise.
        ``kv_ipc``: a KV handoff between two processes on one GPU, a device-to-device copy (its bytes
        read and written in HBM, not sent over the link)."""
        link = self.hw.link
        setup = link.setup_s(path)
        if transfers <= 0 and nbytes <= 0:
            return 0.0
        rate = self.hw.hbm_bytes_per_s / 2 if path == "kv_ipc" else link.bytes_per_s
        return max(0, transfers) * setup + max(0, nbytes) / rate

    def local_prefill_efficiency(self, encode_sm_share: float, encode_busy: float = 1.0) -> float:
        """α: throughput of a local prefill worker relative to one owning a whole GPU, when the
        encoder holds ``encode_sm_share`` of the SMs for the ``encode_busy`` fraction of time and
        (dynamic partitioning) releases them otherwise.

        α = busy·(1 - e)·κ + (1 - busy), κ = measured co-run penalty (≈0.97 on the H200). HAS's
        default (docs/profiles.md): the encoder's utilisation at the target rate for ``encode_busy``
        and the partition table's share for the typical batch; busy = 1 is the conservative bound.
        """
        if not 0.0 <= encode_sm_share < 1.0:
            raise ValueError(f"encode_sm_share must be in [0, 1), got {encode_sm_share}")
        if not 0.0 <= encode_busy <= 1.0:
            raise ValueError(f"encode_busy must be in [0, 1], got {encode_busy}")
        return encode_busy * (1.0 - encode_sm_share) * self.calib.kappa + (1.0 - encode_busy)
