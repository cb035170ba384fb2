"""The EPDDeployment spec as pydantic models: the one source of truth.

The operator generates the CRD schema from these models, validates admission requests and
reconciles with them, and renders the runtime ConfigMap through them; the workers, the
simulator and the tuner read their configuration through them. Python names are snake_case,
the wire format (YAML, JSON, CRD) is camelCase.

Cross-field rules that an OpenAPI schema cannot express live in ``api/rules.py`` and run in the
spec's model validator, so every way of building a spec checks them.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from easerve_runtime.api.constants import KIND


class Model(BaseModel):
    """Base for every spec model: camelCase on the wire, strict about unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        validate_default=True,
    )

    def wire(self) -> dict[str, Any]:
        """The camelCase JSON-compatible dict, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Modality(StrEnum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"
    OMNI = "omni"


class Backend(StrEnum):
    SIM = "sim"
    TORCH = "torch"
    VLLM = "vllm"


class DispatchPolicy(StrEnum):
    POISSON_GAP = "poisson-gap"
    FIXED_TIMEOUT = "fixed-timeout"
    EAGER = "eager"


class Preprocessing(StrEnum):
    """Where the encode worker decodes and processes media before the tower."""

    GPU = "gpu"
    CPU = "cpu"


class PartitionMode(StrEnum):
    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"


class PartitionBackend(StrEnum):
    GREEN_CONTEXT = "green-context"
    MPS = "mps"
    NONE = "none"


class LocalPrefillProcess(StrEnum):
    AUTO = "auto"
    IN_ENCODE_PROCESS = "in-encode-process"
    OWN_PROCESS = "own-process"


class DiscoveryBackend(StrEnum):
    ETCD = "etcd"
    KUBERNETES = "kubernetes"
    FILE = "file"


class TrialBackend(StrEnum):
    """Where HAS's Stage-2 trials run."""

    TWIN = "twin"
    CLUSTER = "cluster"


class DeploymentMode(StrEnum):
    DISAGGREGATED = "disaggregated"
    OMNI_COLOCATED = "omni-colocated"
    AGGREGATED = "aggregated"


class OutputModality(StrEnum):
    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"


Name = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]


class ModelVolume(Model):
    """Where the model directory comes from in the pods: a PersistentVolumeClaim or a directory of the
    node, mounted read-only into every container that loads the model or its tokenizer."""

    persistent_volume_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="PersistentVolumeClaim in the deployment's namespace that holds the model directory "
        "(ReadOnlyMany or ReadWriteMany when pods run on several nodes).",
    )
    host_path: str | None = Field(
        default=None,
        min_length=2,
        pattern=r"^/",
        description="Directory on every GPU node that holds the model directory (must exist there).",
    )
    mount_path: str = Field(
        default="/models", min_length=2, pattern=r"^/", description="Where the pods see it; spec.model.path lies under it."
    )


class ModelSpec(Model):
    """Which model is served and which encoder feeds it."""

    name: str = Field(min_length=1, description="Model name, e.g. llava-hf/llava-v1.6-34b-hf.")
    modality: Modality = Field(description="Input modality the encoder handles: image, video, audio or omni.")
    served_model_name: str | None = Field(
        default=None, description="Name clients put in the request's model field; defaults to name."
    )
    encoder: str = Field(min_length=1, description="Encoder id, e.g. clip-vit-l-336, whisper-large-v3.")
    path: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Model directory in the Hugging Face layout (config, safetensors, tokenizer, processor, chat "
            "template) as the pods see it; required by engine.backend torch. Never fetched from a hub."
        ),
    )
    volume: ModelVolume | None = Field(
        default=None,
        description="The volume the model directory is on (a PVC or a node path), mounted read-only; "
        "without it, spec.model.path must already exist in the image.",
    )
    random_weights: bool = Field(
        default=False,
        description="torch engine: random weights from the config alone (benchmarks; outputs are meaningless).",
    )
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "torch engine: allow the model directory's own Python code (e.g. Ultravox). That code runs with "
            "the worker's privileges; leave false unless you trust the directory's author."
        ),
    )


class EngineSpec(Model):
    """Which engine the workers run and which latency profile describes the hardware."""

    backend: Backend = Field(default=Backend.SIM, description="sim (profile-driven), torch or vllm.")
    image: str = Field(
        default="ghcr.io/easerve/runtime-cpu:0.1.0", min_length=1, description="Container image of the runtime."
    )
    profile: str | None = Field(
        default=None,
        min_length=1,
        description="Shipped latency profile, <model>@<gpu> (see docs/profiles.md). Exactly one of profile, "
        "profileFile and profileConfigMap is given.",
    )
    profile_file: str | None = Field(
        default=None,
        min_length=1,
        description="Path of a profile file (JSON, the schema of docs/profiles.md) readable by the workers and "
        "the CLI; relative paths are resolved against the working directory.",
    )
    profile_config_map: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="ConfigMap in the deployment's namespace whose key profile.json is a profile file; mounted "
        "into every pod at /etc/easerve/profile/.",
    )


class StageAllocation(Model):
    replicas: int = Field(default=1, ge=0, le=256, description="Number of workers of this stage.")
    tensor_parallel: Literal[1, 2, 4, 8] = Field(default=1, description="GPUs per worker (1, 2, 4 or 8).")

    @property
    def gpus(self) -> int:
        return self.replicas * self.tensor_parallel


class Allocation(Model):
    """GPUs across the encode, prefill and decode pools."""

    encode: StageAllocation = Field(default_factory=StageAllocation, description="Encode workers (TP 1 each).")
    prefill: StageAllocation = Field(default_factory=StageAllocation, description="Remote prefill workers.")
    decode: StageAllocation = Field(default_factory=StageAllocation, description="Decode workers.")

    @property
    def gpus(self) -> int:
        return self.encode.gpus + self.prefill.gpus + self.decode.gpus

    def label(self) -> str:
        """Compact human label, e.g. ``2E-2P(tp2)-2D(tp2)``."""

        def one(tag: str, s: StageAllocation) -> str:
            return f"{s.replicas}{tag}" + (f"(tp{s.tensor_parallel})" if s.tensor_parallel > 1 else "")

        return "-".join([one("E", self.encode), one("P", self.prefill), one("D", self.decode)])

    @classmethod
    def default_for(cls, gpu_budget: int | None, mode: Any = None) -> Allocation:
        """The allocation a disaggregated spec that leaves ``allocation`` out runs (and HAS starts
        from): one GPU per pool, or, on a 2-GPU budget, one encode GPU that also prefills locally
        and one decode GPU (``offload.ratio`` then defaults to 0). Why: the 3-GPU default refused
        every 2-GPU budget, though HAS's space holds the all-local layout and picks it there. Other
        modes have no E/P/D pools: they keep the plain default (which they require)."""
        if gpu_budget == 2 and mode in (None, DeploymentMode.DISAGGREGATED, DeploymentMode.DISAGGREGATED.value):
            return cls(prefill=StageAllocation(replicas=0))
        return cls()


class EncodeSpec(Model):
    """The encode micro-batcher."""

    batch_bound: int = Field(default=8, ge=1, le=256, description="B: the most requests in one micro-batch.")
    dispatch: DispatchPolicy = Field(
        default=DispatchPolicy.POISSON_GAP, description="poisson-gap (load-adaptive), fixed-timeout or eager."
    )
    max_age_ms: float = Field(
        default=50.0, gt=0, le=10_000, description="Safety valve: dispatch once the oldest waited this long."
    )
    gap_quantile: float = Field(
        default=0.5, gt=0, lt=1, description="q: dispatch after a gap g = -ln(1-q)/rate with no arrival."
    )
    rate_half_life_ms: float = Field(
        default=1000.0, gt=0, le=600_000, description="Half-life of the EWMA arrival-rate estimate."
    )
    timeout_ms: float = Field(
        default=10.0, gt=0, le=10_000, description="Wait of the fixed-timeout policy after the first arrival."
    )
    send_window: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Embedding envelopes in flight per encode worker (sent, not yet acknowledged by prefill) "
        "before the encoder waits: backpressure from a slow prefill pool.",
    )
    preprocessing: Preprocessing = Field(
        default=Preprocessing.GPU,
        description="Where images are decoded and processed before the tower: gpu (nvJPEG and the processor "
        "on CUDA: the shortest encode) or cpu (the processor on the host's cores, as Dynamo's encode worker "
        "does). On GPUs that the pods share, cpu frees GPU time for decode when the encode pod runs no local "
        "prefill, and costs it when it does (docs/engine.md).",
    )


class PrefillSpec(Model):
    """How a prefill worker (remote or local) batches the requests waiting for it."""

    max_batch_tokens: int = Field(
        default=8192,
        ge=1,
        le=1_048_576,
        description="Most prompt tokens in one prefill batch (whole requests, first come first served; a "
        "longer request still runs alone). Like vLLM's max_num_batched_tokens.",
    )


class DecodeSpec(Model):
    """How a decode worker admits sequences into its running batch."""

    max_sequences: int = Field(
        default=256, ge=1, le=65_536, description="Most sequences in one decode batch (vLLM's max_num_seqs)."
    )
    kv_memory_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory the engine may use for weights, activations and KV cache "
        "(vLLM's gpu_memory_utilization, per instance: other processes on the GPU do not count against it); "
        "a sequence joins only when its KV cache at full length fits.",
    )


class OffloadSpec(Model):
    ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="s: fraction of prefills sent to remote prefill workers; s < 1 adds a local prefill "
        "worker on each encode GPU.",
    )


class SMPartitionSpec(Model):
    mode: PartitionMode = Field(default=PartitionMode.NONE, description="none, static or dynamic (per micro-batch).")
    backend: PartitionBackend = Field(
        default=PartitionBackend.GREEN_CONTEXT, description="green-context, mps, or none."
    )
    static_encode_sms: int | None = Field(
        default=None, ge=8, le=1024, description="Encode SMs in static mode (the rest go to local prefill)."
    )
    table_config_map: str | None = Field(
        default=None, description="ConfigMap holding the partition table from `easerve profile-partition`."
    )
    epsilon: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="Latency slack of the dynamic split: encode gets the fewest SMs within (1+epsilon) of its "
        "full-GPU latency. Larger values give local prefill more SMs.",
    )
    local_prefill: LocalPrefillProcess = Field(
        default=LocalPrefillProcess.AUTO,
        description="Where the local prefill worker of an encode GPU runs: in-encode-process (one process holds "
        "both engines, so their kernels run concurrently without MPS; the torch engine only), own-process (a "
        "container of its own, e.g. under MPS), or auto (in-encode-process with the torch engine, own-process "
        "with the sim engine).",
    )


class SLOTier(Model):
    name: Name = Field(description="Tier name, e.g. strict, tight, moderate, loose, relaxed.")
    ttft_seconds: float = Field(gt=0, le=3600, description="P99 time-to-first-token bound, seconds.")
    tpot_ms: float = Field(gt=0, le=60_000, description="P99 time-per-output-token bound, milliseconds.")


class SLOSpec(Model):
    tiers: list[SLOTier] = Field(min_length=1, max_length=16, description="Named SLO tiers, strict to relaxed.")
    objective: str = Field(default="moderate", description="Tier whose goodput is the objective.")

    def tier(self, name: str) -> SLOTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


class AdaptSpec(Model):
    """The autopilot (docs/adapt.md): re-tune B and s live when the observed rate leaves a band."""

    enabled: bool = Field(default=False, description="Follow the observed arrival rate with live B and s changes.")
    band: float = Field(
        default=0.3,
        gt=0,
        le=10,
        description="Relative band around the tuned rate: re-tune once the rate is above rate*(1+band) or below rate/(1+band).",
    )
    hold_seconds: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="Hysteresis: the rate must stay outside the band (on one side) this long before a re-tune.",
    )
    min_interval_seconds: float = Field(
        default=120.0, ge=0, le=86_400, description="Fewest seconds between two applied changes."
    )
    guard_window_seconds: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="Window after a change over which goodput is measured; worse than before means roll back.",
    )
    rollback_tolerance: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Roll back when the good fraction (goodput / arrival rate) drops by more than this after a change.",
    )
    allow_allocation_changes: bool = Field(
        default=False,
        description="Apply a better allocation found at a re-tune with a roll (only when spec.allocation is unset: "
        "an explicit allocation is never moved); false: it is only recommended in status.adapt.decisions.",
    )


class TuningSpec(Model):
    enabled: bool = Field(default=False, description="Run HAS and report the best configuration in status.")
    target_rate: float | None = Field(default=None, gt=0, le=10_000, description="Λ: target arrival rate, req/s.")
    trial_budget: int = Field(default=30, ge=1, le=1000, description="Most Stage-2 trials.")
    requests_per_trial: int = Field(default=500, ge=10, le=1_000_000, description="Requests per trial rollout.")
    objective: str = Field(
        default="throughput", pattern=r"^(throughput|goodput@[a-z0-9-]+)$", description="throughput or goodput@TIER."
    )
    adapt: AdaptSpec = Field(default_factory=AdaptSpec, description="Online adaptation of B and s to the observed rate.")
    trials: TrialBackend = Field(
        default=TrialBackend.TWIN,
        description="Where Stage-2 trials run: twin (the operator's simulator: a prediction) or cluster (each "
        "trial rolled out as this deployment's children, driven by a load Job, scored from Prometheus at "
        "spec.observability.prometheusUrl or the operator's --prometheus-url: a measurement).",
    )


class DiscoverySpec(Model):
    backend: DiscoveryBackend = Field(default=DiscoveryBackend.ETCD, description="Dynamo discovery: etcd, kubernetes or file.")
    etcd_endpoints: str | None = Field(default=None, description="etcd endpoints for the etcd backend.")


HTTP_URL_PATTERN = r"^https?://[^/?#\s]+[^\s]*$"


class ObservabilitySpec(Model):
    prometheus_url: str | None = Field(
        default=None,
        max_length=2048,
        description="Prometheus base URL that HAS queries (http or https).",
        json_schema_extra={"pattern": HTTP_URL_PATTERN},  # the CRD refuses other schemes too
    )

    @field_validator("prometheus_url")
    @classmethod
    def _http_only(cls, v: str | None) -> str | None:
        """The operator fetches this URL: only http(s), with a host (no file://, gopher://, ...)."""
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc or not re.match(HTTP_URL_PATTERN, v):
            raise ValueError(f"must be an http:// or https:// URL with a host, got '{v[:100]}'")
        return v


class LimitsSpec(Model):
    """What one request may ask for, and how much the frontend admits: refused up front with a 4xx
    naming the limit (or 429/503 with Retry-After for the queue), before any work is done."""

    max_context_tokens: int = Field(
        default=32768, ge=16, le=10_000_000, description="Prompt (text + media) plus max_tokens must fit in this."
    )
    max_prompt_tokens: int = Field(
        default=16384, ge=1, le=10_000_000, description="Most prompt tokens (text + media) of one request."
    )
    max_output_tokens: int = Field(default=8192, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for.")
    max_images_per_request: int = Field(default=16, ge=0, le=1024, description="Most image parts in one request.")
    max_image_pixels: int = Field(
        default=16_777_216, ge=1, le=1_000_000_000, description="Most pixels of one image, read from its header before decoding."
    )
    max_audio_seconds: float = Field(default=600.0, gt=0, le=86_400, description="Longest audio clip, seconds.")
    max_video_frames: int = Field(default=256, ge=1, le=100_000, description="Most sampled frames of one video.")
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024, description="Largest request body, bytes."
    )
    max_json_depth: int = Field(default=32, ge=4, le=1000, description="Deepest nesting of the request JSON.")
    max_queued_requests: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Most admitted requests still waiting for their first token; beyond it 429 with Retry-After. "
        "Default: measured capacity (req/s) x queueSeconds.",
    )
    queue_seconds: float = Field(
        default=3.0, gt=0, le=3600, description="Queue budget: how long an admitted request may wait at capacity."
    )
    request_timeout_seconds: float = Field(
        default=600.0, gt=0, le=86_400, description="Deadline of an accepted request, carried by every internal hop."
    )


class AuthSpec(Model):
    """Optional API-key authentication of the OpenAI endpoint (``Authorization: Bearer <key>``)."""

    api_key_secret: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description="Secret (same namespace) whose values are the accepted API keys; unset: no authentication.",
    )
    api_key_secret_key: str = Field(
        default="api-keys", min_length=1, description="Key in the Secret: one API key per line."
    )


class EnvVar(Model):
    name: str = Field(min_length=1, description="Environment variable name.")
    value: str = Field(default="", description="Its value.")


class PodOverrides(Model):
    """Applied to every stage's pod template."""

    resources: dict[str, dict[str, str]] | None = Field(
        default=None, description="Extra requests/limits (nvidia.com/gpu is set from the allocation)."
    )
    node_selector: dict[str, str] | None = Field(default=None, description="Pod nodeSelector.")
    tolerations: list[dict[str, Any]] | None = Field(default=None, description="Pod tolerations.")
    env: list[EnvVar] | None = Field(default=None, description="Extra environment for every container.")


class AggregatedSpec(Model):
    """The aggregated engines (spec.mode aggregated): the vLLM-style baseline on the same engine (docs/engine.md)."""

    token_budget: int = Field(
        default=2048,
        ge=1,
        le=1_048_576,
        description="Most tokens of one engine iteration, decode tokens included (vLLM's "
        "max_num_batched_tokens): prefill fills what the running sequences leave.",
    )
    tensor_parallel: Literal[1, 2, 4, 8] = Field(
        default=1, description="GPUs per aggregated worker; spec.gpuBudget / this workers run (torch: 1)."
    )

    def replicas(self, gpu_budget: int) -> int:
        return gpu_budget // self.tensor_parallel


class OmniClass(Model):
    name: Name = Field(description="Class name, e.g. text, speech, image.")
    output: OutputModality = Field(description="Output modality: text, audio or image.")
    priority: int | None = Field(default=None, ge=0, le=1000, description="API priority; defaults 0/10/20 by output.")
    slo_multiplier: float = Field(default=5.0, gt=0, le=1000, description="SLO = solo p95 × this.")
    slo_seconds: float | None = Field(default=None, gt=0, le=3600, description="Absolute SLO; overrides the multiplier.")


class OmniSpec(Model):
    classes: list[OmniClass] = Field(min_length=1, max_length=16, description="Request classes and their SLOs.")
    rotation_m: int = Field(default=2, ge=1, le=64, description="M: long-path steps per rotation cycle.")
    n_min: int = Field(default=2, ge=1, le=64, description="Fewest short-path steps per rotation cycle.")
    n_max: int = Field(default=8, ge=1, le=64, description="Most short-path steps per rotation cycle.")
    long_path_cap: int = Field(default=4, ge=1, le=1024, description="Most ordinary long-path prefills per step.")
    u_guard: float = Field(default=1.5, gt=0, le=100, description="Slack ratio under which a request is protected.")


class EPDDeploymentSpec(Model):
    """The desired state of one multimodal serving deployment."""

    model: ModelSpec
    engine: EngineSpec
    gpu_budget: int = Field(ge=1, le=4096, description="Most GPUs this deployment may use.")
    mode: DeploymentMode = Field(
        default=DeploymentMode.DISAGGREGATED,
        description="disaggregated (E/P/D pools), omni-colocated (one omni pod per GPU) or aggregated (one "
        "engine per spec.aggregated.tensorParallel GPUs doing encode, prefill and decode: the vLLM-style baseline).",
    )
    allocation: Allocation = Field(
        default_factory=lambda data: Allocation.default_for(data.get("gpu_budget"), data.get("mode")),
        description="GPUs across the E/P/D pools (left out: one GPU per pool; on a 2-GPU budget 1E-0P-1D).",
    )
    encode: EncodeSpec = Field(default_factory=EncodeSpec, description="The encode micro-batcher.")
    prefill: PrefillSpec = Field(default_factory=PrefillSpec, description="Prefill batching.")
    decode: DecodeSpec = Field(default_factory=DecodeSpec, description="Decode admission.")
    offload: OffloadSpec = Field(
        default_factory=lambda data: OffloadSpec(ratio=0.0) if _no_remote_prefill(data) else OffloadSpec(),
        description="Partial prefill offload (left out with no remote prefill worker: every prefill local).",
    )
    sm_partition: SMPartitionSpec = Field(
        default_factory=SMPartitionSpec, description="How an encode GPU is split with its local prefill worker."
    )
    slo: SLOSpec = Field(description="SLO tiers; goodput is reported per tier.")
    tuning: TuningSpec = Field(default_factory=TuningSpec, description="Hybrid Auto Selection (HAS) search.")
    discovery: DiscoverySpec = Field(default_factory=DiscoverySpec, description="How workers find each other.")
    observability: ObservabilitySpec = Field(default_factory=ObservabilitySpec, description="Metrics endpoints.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Overrides applied to every pod.")
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description="Request limits and the admission queue.")
    auth: AuthSpec = Field(default_factory=AuthSpec, description="API-key authentication of the frontend.")
    omni: OmniSpec | None = Field(default=None, description="Omni request classes; only in omni-colocated mode.")
    aggregated: AggregatedSpec | None = Field(
        default=None, description="The aggregated engines' token budget and TP; only in aggregated mode."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> EPDDeploymentSpec:
        from easerve_runtime.api.rules import cross_field_errors  # rules read the models

        for err in cross_field_errors(self):
            raise err
        return self

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.name

    @property
    def aggregated_engine(self) -> AggregatedSpec:
        """``spec.aggregated``, or its defaults when the aggregated mode leaves it out."""
        return self.aggregated or AggregatedSpec()

    @property
    def has_local_prefill(self) -> bool:
        return self.mode == DeploymentMode.DISAGGREGATED and self.offload.ratio < 1.0


def _no_remote_prefill(data: dict[str, Any]) -> bool:
    """Whether the allocation validated so far has no remote prefill worker (the offload default's input)."""
    alloc = data.get("allocation")
    return isinstance(alloc, Allocation) and alloc.prefill.replicas == 0


def parse_spec(data: dict[str, Any]) -> EPDDeploymentSpec:
    return EPDDeploymentSpec.model_validate(data)


def load_manifest(path: str | Path) -> tuple[str, EPDDeploymentSpec]:
    """Read an EPDDeployment manifest (YAML) and return (metadata.name, validated spec)."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    for d in docs:
        if d.get("kind") == KIND:
            return d["metadata"]["name"], parse_spec(d.get("spec") or {})
    raise ValueError(f"{path}: no {KIND} document found")


