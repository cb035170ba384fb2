"""GPUs, links and model architectures, read from ``data/*.json`` (facts, no fitting)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

TransferPath = Literal["embedding", "kv", "kv_ipc"]
"""The transfer paths with a setup cost of their own: envelopes of embeddings, KV handoffs, and KV
handoffs between two processes on one GPU (CUDA IPC)."""

BYTES_BF16 = 2


@cache
def load_json(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("easerve_runtime.profiles").joinpath("data").joinpath(name).read_text()
    )
    return data


@dataclass(frozen=True, slots=True)
class Link:
    kind: str
    spec_gbps: float
    efficiency: float
    allreduce_latency_s: float
    transfer_setup_s: float
    embedding_setup_s: float
    """Fixed cost of one embedding transfer (an envelope): ``transfer_setup_s`` unless the link sets it."""
    kv_setup_s: float
    """Fixed cost of one KV handoff: ``transfer_setup_s`` unless the link sets it."""
    kv_ipc_setup_s: float
    """Fixed cost of one KV handoff between two processes on one GPU (CUDA IPC, ``engines.kv_ipc``):
    ``kv_setup_s`` unless the link sets it."""

    def setup_s(self, path: TransferPath) -> float:
        if path == "embedding":
            return self.embedding_setup_s
        if path == "kv":
            return self.kv_setup_s
        if path == "kv_ipc":
            return self.kv_ipc_setup_s
        raise ValueError(f"transfer path must be 'embedding', 'kv' or 'kv_ipc', got {path!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.spec_gbps * 1e9 * self.efficiency

    def allreduce_s(self, nbytes: float, tp: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``tp`` GPUs: latency + 2(tp-1)/tp of the data per GPU."""
        if tp <= 1:
            return 0.0
        return self.allreduce_latency_s + 2.0 * (tp - 1) / tp * nbytes / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    label: str
    sms: int
    bf16_tflops: float
    hbm_gbps: float
    memory_bytes: int
    sustained_clock_fraction: float
    link: Link

    @property
    def flops_per_s(self) -> float:
        """Usable tensor peak: datasheet dense bf16 x sustained clock fraction."""
        return self.bf16_tflops * 1e12 * self.sustained_clock_fraction

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9


def _ms_or(value: Any, default: Any) -> float:
    """A path's own setup (ms) when the link sets it (a file's entry may carry it as null), else the link's."""
    return float(default if value is None else value)


def gpu(name: str, gpus: dict[str, Any] | None = None, links: dict[str, Any] | None = None) -> GPU:
    """The GPU ``name`` from ``gpus``/``links`` (default: the shipped ``gpus.json``/``links.json``;
    a profile file passes the shipped entries merged with its own)."""
    gpus = load_json("gpus.json") if gpus is None else gpus
    links = load_json("links.json") if links is None else links
    if name not in gpus or name.startswith("_"):
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(k for k in gpus if not k.startswith('_'))}")
    g = gpus[name]
    lk = links[g["link"]]
    link = Link(
        kind=g["link"],
        spec_gbps=float(g["link_gbps"]),
        efficiency=float(lk["efficiency"]),
        allreduce_latency_s=float(lk["allreduce_latency_us"]) * 1e-6,
        transfer_setup_s=float(lk["transfer_setup_ms"]) * 1e-3,
        embedding_setup_s=_ms_or(lk.get("embedding_setup_ms"), lk["transfer_setup_ms"]) * 1e-3,
        kv_setup_s=_ms_or(lk.get("kv_setup_ms"), lk["transfer_setup_ms"]) * 1e-3,
        kv_ipc_setup_s=_ms_or(lk.get("kv_ipc_setup_ms"), _ms_or(lk.get("kv_setup_ms"), lk["transfer_setup_ms"])) * 1e-3,
    )
    return GPU(
        name=name,
        label=g["label"],
        sms=int(g["sms"]),
        bf16_tflops=float(g["bf16_tflops"]),
        hbm_gbps=float(g["hbm_gbps"]),
        memory_bytes=int(g["memory_bytes"]),
        sustained_clock_fraction=float(g["sustained_clock_fraction"]),
        link=link,
    )


def gpu_names() -> list[str]:
    return sorted(k for k in load_json("gpus.json") if not k.startswith("_"))


@dataclass(frozen=True, slots=True)
class Backbone:
    """A decoder-only transformer's shape: enough to count FLOPs and bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    sliding_window: int | None = None
    global_every: int | None = None

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        attn = h * self.attn_width * 2 + h * self.kv_width * 2  # q, o + k, v
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return attn + mlp

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.matmul_params + emb * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.params * BYTES_BF16

    @property
    def decode_stream_bytes(self) -> int:
        """Bytes one decode step must read: all layer weights plus the LM head (not the embedding
        table, of which a step reads one row per sequence)."""
        return (self.matmul_params + self.vocab * self.hidden) * BYTES_BF16

    @property
    def global_layers(self) -> int:
        if self.sliding_window is None or not self.global_every:
            return self.layers
        return self.layers // self.global_every

    @property
    def local_layers(self) -> int:
        return self.layers - self.global_layers

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_width * BYTES_BF16  # K and V

    def kv_bytes(self, tokens: float) -> float:
        """KV cache of ONE sequence of ``tokens`` (sliding-window layers keep only the window)."""
        if tokens <= 0:
            return 0.0
        local = min(tokens, self.sliding_window) if self.sliding_window else tokens
        return self.kv_bytes_per_token_layer * (self.global_layers * tokens + self.local_layers * local)

    def _attn_pairs(self, t: float) -> float:
        """Query-key pairs per layer for one causal sequence of length t, summed over layers."""
        full = t * t / 2.0
        if not self.sliding_window or not self.local_layers:
            return self.layers * full
        w = float(self.sliding_window)
        local = full if t <= w else w * t - w * w / 2.0
        return self.global_layers * full + self.local_layers * local

    def prefill_flops(self, tokens: float, sequences: int = 1) -> float:
        """2·params·tokens for the matmuls, + causal attention (QKᵀ and AV), + LM head per sequence."""
        if tokens <= 0:
            return 0.0
        seqs = max(1, sequences)
        per_seq = tokens / seqs
        linear = 2.0 * self.matmul_params * tokens + 2.0 * self.vocab * self.hidden * seqs
        attn = 4.0 * self.attn_width * self._attn_pairs(per_seq) * seqs
        return linear + attn

    @property
    def decode_flops_per_token(self) -> float:
        return 2.0 * (self.matmul_params + self.vocab * self.hidden)


def backbone(name: str, backbones: dict[str, Any] | None = None) -> Backbone:
    bbs = load_json("models.json")["backbones"] if backbones is None else backbones
    if name not in bbs:
        raise ValueError(f"unknown backbone {name!r}; known: {sorted(bbs)}")
    return Backbone(name=name, **bbs[name])
