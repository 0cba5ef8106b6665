"""The choices of a batch job's requests: one sequence per choice, each with its own sampling stream.

A request with `n` = k is answered by k choices of the same prompt (OpenAI's `choices[i].index`). Choice 0 samples
with the request's seed, so a request's first choice does not depend on its n; choice i > 0 with a seed derived
from (the request's seed, i) (`choice_seed`), so the same choice draws the same tokens in every run, resumed or
not, whatever sequence id it gets. Greedy choices are identical to each other, as they should be.

Sequences are the choices not finished yet, those of one request adjacent: sequence i of a run is `plan[i]`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from batchgen.batch.requests import Request
from batchgen.exec.sampling import SamplingParams

_SEED_MASK = (1 << 63) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request whose seed is `seed` (choice 0 keeps it)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"choice\0{seed}\0{index}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


@dataclass(frozen=True)
class Choice:
    """One sequence of a run: choice `index` of request `request` (an index into the job's todo list)."""

    request: int
    index: int
    params: SamplingParams  # the request's, with this choice's seed


def choice_params(r: Request, index: int) -> SamplingParams:
    return r.params if index == 0 else replace(r.params, seed=choice_seed(r.params.seed, index))


def plan_choices(todo: Sequence[Request], finished: Sequence[dict[int, object]]) -> list[Choice]:
    """The sequences to run: every choice of every request of `todo` but those in `finished[j]` (by index)."""
    return [Choice(j, i, choice_params(r, i)) for j, r in enumerate(todo) for i in range(r.n) if i not in finished[j]]
