"""PARTITION's KV moves: which GPU sends which part of a sequence's KV to which GPU when the GPUs holding it change.

A running device-resident sequence is held by a *group* of GPUs, its lead first. Unpartitioned, the group is
its one GPU, which holds the whole KV in its pages. PARTITIONed over d GPUs (the lead and the next d - 1 GPUs of
its instance, wrapping), GPU j of the group holds shard j: KV heads [j H/d, (j+1) H/d) of every token for
MHA/GQA, or, for MLA's latent (which has no heads to split), a whole replica.

When the group changes (a split, a join back to one GPU, another degree, another lead), every GPU of the new
group receives, device to device, the part of its new shard that it does not hold yet, from the GPU of the old
group that holds it; what it holds already stays on it (re-laid out in its own pool: a copy inside the device's
memory, over no link, which no tier counts). `overlaps` lists every part of every new shard with the GPU it comes
from (itself included), `pieces` only those that cross from one GPU to another. The state prices the pieces
(`ClusterState`: each charged to the GPU that receives it, peer within a node, network across) and the executors
copy exactly them (batchgen.exec.shards, batchgen.dist.partition), so priced and performed bytes are the same.

Heads are counted in `units` equal parts of the KV, units = lcm(old degree, new degree), so that every shard's
boundary falls on a unit: a part [lo, hi) of `units` carries (hi - lo) / units of the sequence's KV bytes (MLA:
0, 1 of 1, the whole latent, which a new member takes from the old lead).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import lcm


@dataclass(frozen=True)
class Part:
    """Units [lo, hi) of `units` of a sequence's KV (its heads; MLA: 0, 1, 1), held by `src`, for `dst`."""

    src: int
    dst: int
    lo: int
    hi: int
    units: int

    def nbytes(self, kv_bytes):
        """The part's bytes, of a sequence whose KV (all heads) is `kv_bytes`: exact for integer bytes (the
        product is an integer, and so is its quotient when the heads divide evenly)."""
        return kv_bytes * (self.hi - self.lo) / self.units


def shard_units(j: int, degree: int, units: int) -> tuple[int, int]:
    """Units [lo, hi) of shard j of `degree` (degree 1: the whole KV)."""
    return j * units // degree, (j + 1) * units // degree


@lru_cache(maxsize=4096)
def overlaps(old: tuple[int, ...], new: tuple[int, ...], by_heads: bool) -> tuple[Part, ...]:
    """Every part of every new shard and the old holder it comes from, new shards in group order, each one's parts
    in head order (src == dst: the GPU holds that part already). `old`, `new`: the groups (GPUs, lead first)."""
    if not old or not new:
        raise ValueError(f"a reshard needs GPUs on both sides: {old} -> {new}")
    if not by_heads:  # replicas: a GPU of both groups keeps its own, a new one takes the old lead's
        return tuple(Part(g if g in old else old[0], g, 0, 1, 1) for g in new)
    units = lcm(len(old), len(new))
    out = []
    for k, g in enumerate(new):
        lo, hi = shard_units(k, len(new), units)
        for i, s in enumerate(old):
            a, b = shard_units(i, len(old), units)
            if max(lo, a) < min(hi, b):
                out.append(Part(s, g, max(lo, a), min(hi, b), units))
    return tuple(out)


def pieces(old: tuple[int, ...], new: tuple[int, ...], by_heads: bool) -> tuple[Part, ...]:
    """The parts of `overlaps` that cross from one GPU to another: what a reshard copies, in the order the
    executors copy it (a dist backend's ranks walk it alike, so its sends and receives pair up)."""
    return tuple(p for p in overlaps(tuple(old), tuple(new), by_heads) if p.src != p.dst)
