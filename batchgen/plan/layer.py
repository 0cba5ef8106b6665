"""The per-layer decode DAG of module-based batching with host-resident KV, and its steady-state time.

One decode layer on one rank (every cost broadcasts over a ranks x iterations grid):

- compute, on the GPU stream, in this order: attention of the device-resident micro-batches (one node: they
  need nothing from the host), attention of each host-resident micro-batch (over its staging buffer; with CPU
  attention only the projections), the per-rank FFN work (shared experts and router, or a dense layer's FFN),
  then the MoE (all-to-all + routed experts), which starts when every rank is ready (lockstep);
- on the CPU (CPU attention): attention of each host-resident micro-batch beside its KV;
- on the h2d link (PCIe, host -> device, at this GPU's share of host DRAM): the restore of each host-resident
  micro-batch's KV for this layer, double-buffered: restore i may start once attention i-2 has finished (two
  staging buffers, reused across layers); with CPU attention instead the attention outputs coming back; and
  the next MoE layer's experts when weights are streamed (a ring of two layers: the prefetch for layer l+1
  may start once the MoE of layer l-1 has freed its slot), after this layer's restores;
- on the d2h link: each host-resident micro-batch's new KV appended to host right after its attention (with
  CPU attention: its queries and new KV going down to the CPU).

The steady-state time of a layer is taken from a two-layer unroll: the end of layer 2 minus the end of layer
1, where a layer ends when its MoE and its appends have finished. So restoring the next layer's first two
micro-batches during this layer's MoE is credited (their buffers are free), and nothing else is free: a
restore that cannot hide behind compute delays its attention and shows in the time. Without host traffic the
DAG is a chain and the time is max over ranks of (attention + FFN work) + MoE, the plain sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchgen.plan.dag import Dag

GPU, H2D, D2H, CPU = "gpu", "h2d", "d2h", "cpu"


@dataclass
class LayerCosts:
    """Seconds of one layer's nodes on one rank; floats, or arrays over a (ranks x iterations) grid. The lists
    hold one entry per host-resident micro-batch (all of the same length)."""

    dev_attn: Any                 # GPU: attention of all device-resident micro-batches
    ffn: Any                      # GPU: per-rank FFN work before the barrier (shared experts + router, dense FFN)
    moe: Any = 0.0                # GPU, after all ranks are ready: all-to-all + routed experts (0: dense layer)
    host_attn: list = field(default_factory=list)  # GPU: attention over the staging buffer, or projections (CPU)
    restore: list = field(default_factory=list)    # h2d: KV of the micro-batch for this layer (GPU attention)
    append: list = field(default_factory=list)     # d2h: new KV (GPU attention) / queries + new KV (CPU attention)
    cpu_attn: list = field(default_factory=list)   # CPU: attention beside the host KV (CPU attention)
    ship_back: list = field(default_factory=list)  # h2d: attention outputs back (CPU attention)
    prefetch: Any = 0.0           # h2d: the next MoE layer's streamed expert weights
    cpu_attention: bool = False
    serial: bool = False          # one set of cores runs every node (a CPU device): nothing overlaps

    def __post_init__(self) -> None:
        m = len(self.host_attn)
        if len(self.append) != m:
            raise ValueError("LayerCosts: one append per host-resident micro-batch")
        if self.cpu_attention and not (len(self.cpu_attn) == len(self.ship_back) == m):
            raise ValueError("LayerCosts: CPU attention needs cpu_attn and ship_back per micro-batch")
        if not self.cpu_attention and len(self.restore) != m:
            raise ValueError("LayerCosts: GPU attention of host-resident micro-batches needs a restore each")

    @property
    def micro_batches(self) -> int:
        return len(self.host_attn)

    def gpu_work(self) -> Any:
        """GPU stream seconds before the barrier: attention (all micro-batches) and FFN work."""
        total = self.dev_attn + self.ffn
        for a in self.host_attn:
            total = total + a
        return total


def build_layer_dag(c: LayerCosts, layers: int = 2) -> tuple[Dag, list[int]]:
    """`layers` identical decode layers in a row; returns the DAG and the end node of each layer."""
    dag = Dag()
    ends: list[int] = []
    host_attn_nodes: list[int] = []  # every host micro-batch's attention so far, in order (staging buffers)
    moes: list[int] = []
    prefetch_for = dag.add("prefetch experts L1", c.prefetch, resource=H2D)
    m = c.micro_batches
    for layer in range(1, layers + 1):
        tag = f"L{layer}"
        last_d2h = None
        done: list[int] = []  # what the FFN waits for besides the GPU stream (CPU attention outputs)
        if not c.cpu_attention:
            def restore(i: int) -> int:
                g = (layer - 1) * m + i  # micro-batches are numbered across layers: buffers alternate
                buffer_free = host_attn_nodes[g - 2] if g >= 2 else None
                return dag.add(f"restore {tag}.{i}", c.restore[i], after=[buffer_free], resource=H2D)

            restores = {i: restore(i) for i in range(min(2, m))}
            dag.add(f"attn dev {tag}", c.dev_attn, resource=GPU)
            for i in range(m):
                a = dag.add(f"attn host {tag}.{i}", c.host_attn[i], after=[restores[i]], resource=GPU)
                host_attn_nodes.append(a)
                last_d2h = dag.add(f"append {tag}.{i}", c.append[i], after=[a], resource=D2H)
                if i + 2 < m:
                    restores[i + 2] = restore(i + 2)
        else:
            for i in range(m):
                p = dag.add(f"proj {tag}.{i}", c.host_attn[i], resource=GPU)
                last_d2h = dag.add(f"ship q,kv {tag}.{i}", c.append[i], after=[p], resource=D2H)
                a = dag.add(f"cpu attn {tag}.{i}", c.cpu_attn[i], after=[last_d2h], resource=CPU)
                done.append(dag.add(f"ship out {tag}.{i}", c.ship_back[i], after=[a], resource=H2D))
            dag.add(f"attn dev {tag}", c.dev_attn, resource=GPU)
        dag.add(f"ffn {tag}", c.ffn, after=done, resource=GPU)
        moe = dag.add(f"moe {tag}", c.moe, after=[prefetch_for], resource=GPU, sync=True)
        ring_free = moes[-1] if moes else None  # the slot of the MoE layer before this one
        moes.append(moe)
        prefetch_for = dag.add(f"prefetch experts L{layer + 1}", c.prefetch, after=[ring_free], resource=H2D)
        ends.append(dag.add(f"end {tag}", 0.0, after=[moe, last_d2h], sync=True))
    return dag, ends


def _row(x: Any) -> Any:
    """A synced (1 x iterations) grid as a flat array; floats stay floats."""
    return x[0] if isinstance(x, np.ndarray) and x.ndim == 2 else x


def layer_time(c: LayerCosts) -> Any:
    """Steady-state seconds of one layer (the same for every rank: they meet at the MoE): the end of layer 2
    of a two-layer unroll minus the end of layer 1. Floats in, float out; grids in, one value per iteration."""
    if c.serial:
        return _serial_time(c)
    if c.micro_batches == 0 and _is_zero(c.prefetch):
        return _chain_time(c)
    dag, ends = build_layer_dag(c, 2)
    return _row(dag.finish[ends[1]] - dag.finish[ends[0]])


def _chain_time(c: LayerCosts) -> Any:
    """No host traffic: the DAG is a chain, max over ranks of (attention + FFN work) + MoE."""
    work = c.dev_attn + c.ffn
    if isinstance(work, np.ndarray) and work.ndim >= 1:
        work = work.max(axis=0)
    return _row(work + c.moe)


def _serial_time(c: LayerCosts) -> Any:
    """Every node on one set of cores, one after another: max over ranks of all their work + MoE."""
    work = c.gpu_work() + c.prefetch
    for part in (c.restore, c.append, c.cpu_attn, c.ship_back):
        for x in part:
            work = work + x
    if isinstance(work, np.ndarray) and work.ndim >= 1:
        work = work.max(axis=0)
    return _row(work + c.moe)


def compute_time(c: LayerCosts) -> Any:
    """The layer with every transfer free and the CPU infinitely fast: max over ranks of the GPU stream's
    work + MoE. `layer_time - compute_time` is the host traffic (or CPU time) the GPU could not hide."""
    work = c.gpu_work()
    if isinstance(work, np.ndarray) and work.ndim >= 1:
        work = work.max(axis=0)
    return _row(work + c.moe)


def _is_zero(x: Any) -> bool:
    return not np.any(x)
