"""Which rank of an instance owns which expert (the same map for every MoE layer).

Contiguous blocks by default (experts 0..a to rank 0, the next block to rank 1, ...; the first E mod P ranks
take one more), which keeps each rank's shard one slice of the stacked weights. Any map is accepted as long as
every rank owns at least one expert: a rank with none would only forward tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.dist.errors import DistConfigError


@dataclass(frozen=True)
class ExpertPlacement:
    owner: tuple[int, ...]  # owner[e]: the rank (within the instance's group) holding expert e
    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise DistConfigError(f"an expert placement needs at least one rank, got {self.ranks}")
        if len(self.owner) < self.ranks:
            raise DistConfigError(f"{self.ranks} ranks but only {len(self.owner)} experts: every rank must own at "
                                  f"least one expert; use at most {len(self.owner)} processes per instance")
        bad = [e for e, r in enumerate(self.owner) if not 0 <= r < self.ranks]
        if bad:
            raise DistConfigError(f"experts {bad} are placed outside ranks 0..{self.ranks - 1}")
        idle = sorted(set(range(self.ranks)) - set(self.owner))
        if idle:
            raise DistConfigError(f"ranks {idle} own no expert: give every rank at least one")

    @classmethod
    def contiguous(cls, num_experts: int, ranks: int) -> "ExpertPlacement":
        if ranks < 1:
            raise DistConfigError(f"an expert placement needs at least one rank, got {ranks}")
        base, extra = divmod(num_experts, ranks)
        owner = [r for r in range(ranks) for _ in range(base + (r < extra))]
        return cls(tuple(owner), ranks)

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """The experts a rank holds, ascending: the order of its stacked shard."""
        return tuple(e for e, r in enumerate(self.owner) if r == rank)

    @property
    def max_local(self) -> int:
        """The most experts any rank holds (the width of the count exchange)."""
        return max(len(self.experts_of(r)) for r in range(self.ranks))

    def tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner [E], slot [E]) int64: expert e lives on rank owner[e] as the slot[e]-th of its shard."""
        slot = [self.experts_of(r).index(e) for e, r in enumerate(self.owner)]
        return (torch.tensor(self.owner, dtype=torch.int64, device=device),
                torch.tensor(slot, dtype=torch.int64, device=device))
