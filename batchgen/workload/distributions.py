"""Length distributions for synthetic workloads.

Each distribution is a small frozen dataclass that validates itself on construction and draws a whole
array at once (``sample(n, rng)``): a workload of millions of requests must never be built one request at
a time. All samples are int64 and >= 1, because a request with no prompt or no output token does not exist.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

import numpy as np

# Standard-normal quantiles at 0.99 and 0.95 (scipy.stats.norm.ppf), written out to avoid a scipy dependency.
Z_99 = 2.3263478740408408
Z_95 = 1.6448536269514722
BISECTION_STEPS = 60  # LongTailed: halvings of the scale's bracket when the absolute cap binds
FITTING = ", fitting the mean"  # a progress bar's description meanwhile


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_n(n: Any) -> None:
    _check_int("n", n, 0)


CHUNK = 4_000_000  # draws per progress update: the same stream as one draw of all, so the same arrays


def _draw(draw, n: int, dtype, progress) -> np.ndarray:
    """draw(n), or, with a progress bar, the same values drawn CHUNK at a time (numpy's generators give the
    same stream either way: tests/test_progress.py checks it) with the bar advanced after each chunk."""
    if progress is None:
        return draw(n)
    out = np.empty(n, dtype=dtype)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        out[start:stop] = draw(stop - start)
        progress.update(stop - start)
    return out


@dataclass(frozen=True)
class Fixed:
    """Every request has the same length: the paper's LongBench-style runs fix the prompt length."""

    value: int

    def __post_init__(self) -> None:
        _check_int("value", self.value, 1)

    def sample(self, n: int, rng: np.random.Generator, progress=None) -> np.ndarray:
        _check_n(n)
        if progress is not None:
            progress.update(n)
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers drawn uniformly from [low, high], both ends included (so Uniform(k, k) == Fixed(k))."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_int("low", self.low, 1)
        _check_int("high", self.high, 1)
        if self.high < self.low:
            raise ValueError(f"high must be >= low, got low={self.low}, high={self.high}")

    def sample(self, n: int, rng: np.random.Generator, progress=None) -> np.ndarray:
        _check_n(n)
        return _draw(lambda k: rng.integers(self.low, self.high, size=k, endpoint=True, dtype=np.int64), n,
                     np.int64, progress)


@dataclass(frozen=True)
class LongTailed:
    """A clipped lognormal parameterised by the tail shapes that matter for stragglers, not by (mu, sigma).

    Output lengths in batch inference are long-tailed, and what hurts the makespan is how far the tail
    reaches beyond the bulk. The production DeepSeek-R1 trace in the paper reports exactly two such numbers,
    P99 = 3.78 x P95 and max = 9.2 x P95, so those are the knobs:

    - ``sigma = ln(p99_over_p95) / (z_0.99 - z_0.95)``: for a lognormal, P99/P95 = exp(sigma (z_0.99 - z_0.95))
      whatever mu is, so the ratio alone fixes sigma (3.78 gives sigma ~ 1.95).
    - The sample is clipped at ``max_over_p95`` x its own P95. Using the sample's P95 (not the theoretical
      one) makes the bound hold in every draw, as it does in the trace being imitated; clipping only touches
      values above P99 (we require max_over_p95 >= p99_over_p95), so P95 and P99 are left as requested.
    - ``exp(mu)`` is a pure scale factor, solved from the clipped standard samples so that the *sample* mean
      equals ``mean`` (exact up to rounding to integers and raising values below ``min``). A mean-preserving
      draw keeps total work, and hence comparisons between policies, independent of the tail shape.

    ``max_over_p95=math.inf`` disables the clip.

    ``max`` is an absolute cap (a request's max_tokens, or what the model's context leaves). When it binds, the
    scale is solved by bisection so that the mean of the capped sample still equals ``mean``: the workload
    keeps its nominal size, and the capped sequences become the stragglers.
    """

    mean: float
    p99_over_p95: float = 3.78
    max_over_p95: float = 9.2
    min: int = 1
    max: float = math.inf

    def __post_init__(self) -> None:
        _check_real("mean", self.mean)
        _check_real("p99_over_p95", self.p99_over_p95)
        _check_real("max_over_p95", self.max_over_p95)
        _check_int("min", self.min, 1)
        if not math.isfinite(self.mean) or self.mean < 1:
            raise ValueError(f"mean must be a finite number >= 1, got {self.mean}")
        if self.mean < self.min:
            raise ValueError(f"mean must be >= min, got mean={self.mean}, min={self.min}")
        if not math.isfinite(self.p99_over_p95) or self.p99_over_p95 <= 1:
            raise ValueError(f"p99_over_p95 must be a finite number > 1, got {self.p99_over_p95}")
        if not self.max > self.mean:
            raise ValueError(f"max must be > mean (the cap cannot keep the requested mean), got max={self.max}, "
                             f"mean={self.mean}")
        if self.max_over_p95 < self.p99_over_p95:
            raise ValueError(
                f"max_over_p95 must be >= p99_over_p95 (a clip below P99 would break the requested P99), "
                f"got max_over_p95={self.max_over_p95}, p99_over_p95={self.p99_over_p95}"
            )

    @property
    def sigma(self) -> float:
        return math.log(self.p99_over_p95) / (Z_99 - Z_95)

    def sample(self, n: int, rng: np.random.Generator, progress=None) -> np.ndarray:
        """`progress`: a tqdm-like bar counting sequences drawn; when the cap binds, the passes of the bisection
        over all n (about 60) are added to its total and counted too."""
        _check_n(n)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        standard = np.exp(self.sigma * _draw(rng.standard_normal, n, np.float64, progress))  # lognormal, mu = 0
        if math.isfinite(self.max_over_p95):
            np.minimum(standard, self.max_over_p95 * np.quantile(standard, 0.95), out=standard)
        scale = self.mean / standard.mean()
        if math.isfinite(self.max) and standard.max() * scale > self.max:
            def capped_mean(s: float) -> float:
                if progress is not None:
                    progress.update(n)
                return np.minimum(standard * s, self.max).mean()

            if progress is not None:  # the bisection's passes, each over every sequence (when n is large, most
                progress.total += (BISECTION_STEPS + 1) * n  # of the time goes here)
                desc = getattr(progress, "desc", None)
                if desc is not None and not desc.endswith(FITTING):
                    progress.set_description_str(desc + FITTING, refresh=False)
            lo, hi = scale, scale * 2
            while capped_mean(hi) < self.mean and hi < scale * 1e6:
                if progress is not None:
                    progress.total += n
                hi *= 2
            for _ in range(BISECTION_STEPS):  # the capped mean is monotone in the scale
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if capped_mean(mid) < self.mean else (lo, mid)
            scale = hi
        scaled = np.minimum(standard * scale, self.max)
        return np.maximum(np.rint(scaled), self.min).astype(np.int64)


Distribution = Fixed | Uniform | LongTailed

KINDS: dict[str, type] = {"fixed": Fixed, "uniform": Uniform, "longtail": LongTailed}


def make_distribution(cfg: Mapping[str, Any]) -> Distribution:
    """Build a distribution from its config node, e.g. ``{kind: longtail, mean: 4096}``.

    Errors name the valid kinds and parameters, because the usual mistake is a typo in a YAML file.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"a length distribution must be a mapping with a 'kind' key, got {cfg!r}")
    params = dict(cfg)
    kind = params.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"unknown distribution kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    cls = KINDS[kind]
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for kind {kind!r}; valid: {', '.join(names)}")
    required = [f.name for f in fields(cls) if f.default is MISSING]
    missing = [name for name in required if name not in params]
    if missing:
        raise ValueError(f"missing parameter(s) {missing} for kind {kind!r}; valid: {', '.join(names)}")
    return cls(**params)
