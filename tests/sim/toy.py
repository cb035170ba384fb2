"""A toy latency profile with round numbers, so stage latencies can be computed by hand."""

from __future__ import annotations


class ToyProfile:
    sm_count = 100
    gpu_memory_bytes = 80_000_000_000
    weight_bytes = 40_000_000_000

    def encode_s(self, batch: int, sm_share: float = 1.0) -> float:
        return (0.004 + 0.002 * batch) / min(1.0, 2.0 * sm_share)

    def prefill_s(self, tokens: int, sm_share: float = 1.0, tp: int = 1) -> float:
        return (0.010 + 1e-4 * tokens / tp) / sm_share

    def decode_step_s(self, batch: int, context_tokens: float, tp: int = 1) -> float:
        return (0.020 + 0.0005 * batch + 1e-8 * context_tokens * batch) / tp**0.5

    def transfer_s(self, nbytes: int, *, path: str = "embedding") -> float:
        return 0.001 + nbytes / 10e9

    def kv_bytes(self, tokens: int) -> int:
        return 100_000 * tokens

    def embedding_bytes(self, tokens: int) -> int:
        return 10_000 * tokens
