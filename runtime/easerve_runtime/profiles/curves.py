"""Piecewise-linear curves over measured points: cheap to evaluate, no numpy on the hot path.

The twin evaluates profiles millions of times per search, so a lookup is a ``bisect`` plus one
multiply-add on Python floats (scalar numpy would be ~10x slower).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable


class Curve:
    """y(x) through sorted points; linear in between; beyond the ends either flat or continuing
    the end segment's slope (``extrapolate=True``), as the physics of each use dictates."""

    __slots__ = ("xs", "ys", "_slopes", "extrapolate", "log_x")

    def __init__(self, points: Iterable[tuple[float, float]], extrapolate: bool = False, log_x: bool = False):
        pts = sorted((float(x), float(y)) for x, y in points)
        if not pts:
            raise ValueError("Curve needs at least one point")
        if len({x for x, _ in pts}) != len(pts):
            raise ValueError(f"Curve: duplicate x in {pts}")
        self.log_x = log_x
        self.xs = [math.log2(x) if log_x else x for x, _ in pts]
        self.ys = [y for _, y in pts]
        self._slopes = [
            (self.ys[i + 1] - self.ys[i]) / (self.xs[i + 1] - self.xs[i]) for i in range(len(pts) - 1)
        ]
        self.extrapolate = extrapolate

    def __call__(self, x: float) -> float:
        if self.log_x:
            x = math.log2(x)
        xs = self.xs
        i = bisect_right(xs, x) - 1
        if i < 0:
            if self.extrapolate and self._slopes:
                return self.ys[0] + self._slopes[0] * (x - xs[0])
            return self.ys[0]
        if i >= len(xs) - 1:
            if self.extrapolate and self._slopes:
                return self.ys[-1] + self._slopes[-1] * (x - xs[-1])
            return self.ys[-1]
        return self.ys[i] + self._slopes[i] * (x - xs[i])


def cummax(values: list[float]) -> list[float]:
    """Running maximum: turns a noisy measured series into a monotone one."""
    out, m = [], -math.inf
    for v in values:
        m = max(m, v)
        out.append(m)
    return out
