"""Token sampling whose result for a sequence does not depend on how that sequence was batched.

A coroutine scheduler batches, yields, migrates and partitions sequences freely, so the draw for a
sequence's t-th generated token may only depend on that sequence's own logits row and on a key made of
(seed, t) or (job seed, sequence id, t): never on the other rows of the batch, their order, or the
device. Two choices make this hold:

* **Per-(sequence, step) noise.** Each sampled row gets its own `torch.Generator` seeded from a
  SplitMix64 hash of its key, and its uniforms are drawn on the CPU (so a CUDA batch gets bit-identical
  noise) and then moved to the logits' device. Nothing is drawn from a shared stream, so adding, removing
  or reordering rows cannot shift another row's randomness.
* **Gumbel-max selection.** The token is argmax(logits / T + G) with G = -log(E), E ~ Exp(1), i.e.
  argmax(p / E): an exact sample from softmax(logits / T) that needs no normalisation, cumulative sum or
  binary search, so (top-p's cut aside) the only floating-point work between the logits and the choice
  is one division and one addition per element, both correctly rounded on every device. Top-p's cut
  uses a softmax and a cumulative sum, row by row: batch-independent, and equal across devices except
  for a token whose mass lies within rounding of the cut.

Filtering order: temperature first, then top-k (keep the k largest scaled logits), then top-p on the
distribution renormalised over what top-k kept (keep the smallest set of most probable tokens whose mass
reaches top_p, never fewer than one). Tokens tied with the last kept one are kept too, so that the
support never depends on how a sort orders equal values. Rows with temperature 0, or top_k == 1, are
greedy: a plain argmax, with ties going to the lowest token id.

Seeding: a sequence with an explicit `seed` draws from key (seed, t) alone, so the same request with the
same seed reproduces its output in any job and under any sequence id (the convention of OpenAI-style
APIs). A sequence without a seed draws from (job_seed, seq_id, t): distinct sequences get independent
streams, and rerunning the job reproduces them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
# Domain tags keep the two key shapes apart: (seed, t) and (job_seed, seq_id, t) start from different
# words, so they meet only by a 64-bit hash collision, not by a coincidence of small integers.
_TAG_SEEDED = 0x5EED_0000_0000_0001
_TAG_JOB = 0x5EED_0000_0000_0002


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens and when it stops; immutable so that it can be shared across
    batches and sent between processes without anyone changing it mid-sequence."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # Lists are accepted for convenience but stored as tuples so the dataclass stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _validate(self)

    @property
    def greedy(self) -> bool:
        """Top-k of 1 is greedy too; routing it through argmax makes ties resolve exactly as greedy does."""
        return self.temperature == 0 or self.top_k == 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate(p: SamplingParams) -> None:
    if not _is_number(p.temperature) or not math.isfinite(p.temperature) or p.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
    if not _is_number(p.top_p) or not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {p.top_p}")
    if not _is_int(p.top_k) or p.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {p.top_k}")
    if p.seed is not None and not _is_int(p.seed):
        raise ValueError(f"seed must be an integer or None, got {p.seed!r}")
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {p.max_tokens}")
    bad_ids = [t for t in p.stop_token_ids if not _is_int(t) or t < 0]
    if bad_ids:
        raise ValueError(f"stop_token_ids must be integers >= 0, got {bad_ids}")
    bad_stops = [s for s in p.stop if not isinstance(s, str) or not s]
    if bad_stops:
        raise ValueError(f"stop strings must be non-empty strings, got {bad_stops}")
    if not isinstance(p.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {p.ignore_eos!r}")


# ---------------------------------------------------------------------------------------------- keys


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit words that spreads every input bit over the output,
    so that neighbouring (seq_id, step) pairs get unrelated generator seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _hash_words(*words: int) -> int:
    h = 0
    for w in words:
        h = _mix64(h ^ (w & _MASK64))
    return h


def noise_key(params: SamplingParams, seq_id: int, step: int, job_seed: int = 0) -> int:
    """The 64-bit generator seed for one draw; everything the draw may depend on besides the logits."""
    if params.seed is not None:
        return _hash_words(_TAG_SEEDED, params.seed, step)
    return _hash_words(_TAG_JOB, job_seed, seq_id, step)


def gumbel_noise(keys: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] float32 Gumbel noise, computed entirely on the CPU so every device sees the
    same bits. Uniforms are float64 so that u == 0 (which would exclude a token) and the cap near u == 1
    (which would clip the noise's tail) both sit at 2**-53 rather than float32's 2**-24; E = -log(u) keeps
    its precision in float32, so the second log runs in float32, at half the cost."""
    u = torch.empty(len(keys), vocab, dtype=torch.float64)
    g = torch.Generator(device="cpu")
    for row, key in zip(u, keys):
        g.manual_seed(key)
        row.uniform_(generator=g)
    return (-torch.log((-torch.log(u)).to(torch.float32))).to(device)


# ------------------------------------------------------------------------------------------ filtering


def _apply_top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """One topk at the largest k in the batch serves every row: each row reads its own k-th value from it."""
    k = torch.tensor(ks, device=x.device)
    kth = x.topk(max(ks), dim=1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, -math.inf))
    return x.masked_fill(x < kth, -math.inf)


# Top-p looks for its cut among this many most probable tokens first; only a row whose head holds less
# than top_p of the mass (a nearly flat distribution) pays for a full sort. A constant, not a batch
# property, so that a row's arithmetic never depends on its neighbours.
_TOP_P_HEAD = 1024


def _count_kept(sorted_p: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the sorted probabilities top-p keeps, and whether the list held enough mass to tell.
    The mass before each token comes from the shifted cumulative sum, not cumsum - p, so that rounding
    cannot make it decrease: the kept tokens are then a prefix, and counting them finds the cut."""
    cum = torch.cumsum(sorted_p, dim=1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    n_keep = (mass_before < top_p[:, None]).sum(dim=1)  # >= 1: top_p > 0 = the mass before the first
    return n_keep, cum[:, -1] >= top_p


def _top_p_threshold(x: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, smallest probability top-p keeps) per row."""
    probs = torch.softmax(x, dim=1)
    head = probs.topk(min(_TOP_P_HEAD, probs.shape[1]), dim=1).values  # sorted, largest first
    n_keep, enough = _count_kept(head, top_p)
    threshold = head.gather(1, (n_keep - 1)[:, None])
    if head.shape[1] < probs.shape[1] and not bool(enough.all()):
        flat = torch.nonzero(~enough).flatten()
        full = probs[flat].sort(dim=1, descending=True).values
        threshold[flat] = full.gather(1, (_count_kept(full, top_p[flat])[0] - 1)[:, None])
    return probs, threshold


def _apply_top_p(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    rows = [i for i, p in enumerate(ps) if p < 1]
    idx = torch.tensor(rows, device=x.device)
    sub = x.index_select(0, idx)
    probs, threshold = _top_p_threshold(sub, torch.tensor([ps[i] for i in rows], device=x.device,
                                                             dtype=sub.dtype))
    x = x.clone()
    x[idx] = sub.masked_fill(probs < threshold, -math.inf)
    return x


def filtered_scaled_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 logits / T with the tokens top-k and top-p exclude set to -inf; rows may have different
    parameters. softmax of the result is the distribution `sample` draws from (for non-greedy rows)."""
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device, dtype=torch.float32)
    x = logits.to(torch.float32) / temps[:, None]
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    if any(ks):
        x = _apply_top_k(x, ks)
    ps = [p.top_p for p in params]
    if any(p < 1 for p in ps):
        x = _apply_top_p(x, ps)
    return x


# ------------------------------------------------------------------------------------------- sampling


def _as_int_list(values, name: str, n: int) -> list[int]:
    out = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but logits has {n} rows")
    return [int(v) for v in out]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seq_ids: Sequence[int] | torch.Tensor,
           steps: Sequence[int] | torch.Tensor, *, job_seed: int = 0) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V]; returns int64 [B] on the logits' device.

    `steps[b]` is how many tokens row b's sequence had generated before this one (0 for the first), so
    recomputing or resuming a sequence replays exactly the same draws. `job_seed` only matters for
    sequences without their own seed.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch:
        raise ValueError(f"params has {len(params)} entries but logits has {batch} rows")
    ids = _as_int_list(seq_ids, "seq_ids", batch)
    ts = _as_int_list(steps, "steps", batch)
    out = torch.argmax(logits, dim=1)  # documented to return the first (lowest) index among ties
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        out[torch.tensor(rows, device=logits.device)] = _sample_rows(logits, params, ids, ts, rows, job_seed)
    return out


def _sample_rows(logits, params, ids, ts, rows, job_seed) -> torch.Tensor:
    sub_params = [params[i] for i in rows]
    x = filtered_scaled_logits(logits[torch.tensor(rows, device=logits.device)], sub_params)
    keys = [noise_key(params[i], ids[i], ts[i], job_seed) for i in rows]
    return torch.argmax(x + gumbel_noise(keys, logits.shape[1], logits.device), dim=1)
