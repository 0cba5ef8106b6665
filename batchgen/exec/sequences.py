"""Tokens of every sequence of an executed job: prompts, what was generated, and why each one stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from batchgen.exec.sampling import SamplingParams
from batchgen.exec.stopping import StopChecker
from batchgen.workload.prefix_tree import PrefixTree


def random_prompts(input_lens: np.ndarray, vocab_size: int, seed: int, prefix_group: np.ndarray | None = None,
                   prefix_len: np.ndarray | None = None, tree: PrefixTree | None = None) -> list[np.ndarray]:
    """Synthetic prompts of the workload's lengths: what a length-only workload needs to run on real tensors.
    Where the workload says sequences share a prefix (batchgen/workload/prefixes.py), their first prefix_len
    tokens are the group's first member's, and, where groups nest (`tree`), each outer group's tokens are its
    first member's before them; the draws are the same either way."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, int(n), dtype=np.int64) for n in input_lens]
    if prefix_group is not None and prefix_len is not None:
        group = np.asarray(prefix_group)
        tree = tree or PrefixTree.flat(group, np.asarray(prefix_len))
        chains, first = tree.chains(), {}
        for i in np.flatnonzero(group >= 0).tolist():
            for a in chains[int(group[i])]:  # outermost first: an inner group's first member begins with it too
                shared, n = first.setdefault(a, prompts[i]), int(tree.length[a])
                prompts[i][:n] = shared[:n]
    return prompts


@dataclass
class SequenceTokens:
    prompts: list[np.ndarray]
    params: list[SamplingParams]
    eos_token_ids: tuple[int, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None  # a tokenizer's decode: needed for stop strings
    # tokens some sequences generated before (a resumed batch job): they continue from there, their KV rebuilt by
    # prefilling prompt + these tokens, and sample their next token at step len(resumed[i]), as they would have
    resumed: list[Sequence[int]] | None = None
    generated: list[list[int]] = field(init=False)
    stops: list[StopChecker] = field(init=False)

    def __post_init__(self):
        if len(self.params) != len(self.prompts):
            raise ValueError("one SamplingParams per prompt")
        if self.decode is None and any(p.stop for p in self.params):
            raise ValueError("stop strings need a tokenizer to decode with (a model directory with tokenizer.json)")
        self.generated = [[] for _ in self.prompts]
        self.stops = [StopChecker(p, self.eos_token_ids, context_ids=prompt[-4:].tolist())
                      for p, prompt in zip(self.params, self.prompts)]
        for sid, earlier in enumerate(self.resumed or ()):
            for token in earlier:
                if self.append(sid, token):
                    raise ValueError(f"sequence {sid}: its resumed tokens already end it; it is not unfinished")

    def context(self, sid: int) -> list[int]:
        """Everything whose KV a sequence needs: the prompt, then what it generated."""
        return self.prompts[sid].tolist() + self.generated[sid]

    def context_len(self, sid: int) -> int:
        return len(self.prompts[sid]) + len(self.generated[sid])

    def last_token(self, sid: int) -> int:
        return self.generated[sid][-1] if self.generated[sid] else int(self.prompts[sid][-1])

    def append(self, sid: int, token: int) -> bool:
        """Record a new token; True if the sequence has finished with it."""
        step = len(self.generated[sid])
        self.generated[sid].append(int(token))
        return self.stops[sid].check(int(token), step, self.decode) is not None

    def text(self, sid: int) -> str | None:
        """The output text (without EOS, stop tokens or the matched stop string), when a tokenizer is known."""
        return self.stops[sid].text if self.decode is not None else None

    def finish_reason(self, sid: int) -> str | None:
        finish = self.stops[sid].finish
        return finish.reason if finish else None
