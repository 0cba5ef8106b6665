"""A new scheduling policy, written against batchgen/policy/base.py and run on the simulator.

`FillFirst` admits prompts in arrival order while the ranks' KV pages last, then decodes every running sequence
until the first one finishes (so a freed slot is refilled at once). When a rank cannot grow all its sequences by
one more page, it evicts the newest ones (they are recomputed later from their prompt).

Run it:  python docs/examples/fill_first.py
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.policy.base import Decision, PolicyDefaults, Snapshot
from batchgen.policy.common import fill_ranks, pages_for, shed_to_fit


@dataclass(frozen=True)
class FillFirst(PolicyDefaults):
    max_running: int = 256              # running sequences per rank, at most (a knob: a dataclass field)
    name: str = "fill_first"
    can_stream_weights: bool = False    # the memory plan must hold every weight on the GPUs
    uses_host_kv: bool = False          # KV lives on the device only (no YIELD, no host-resident decode)

    def decide(self, snap: Snapshot) -> Decision:
        P = snap.page_tokens
        d = Decision(steps=P, stop="first_finish")  # decode up to one page, stop at the first finish
        # 1. memory: every running sequence must be able to grow by a page before the next boundary
        need = pages_for(snap.active_context + P, P)
        drop = shed_to_fit(snap.active_rank, need, -snap.active_decoded.astype(float), snap.pages_capacity)
        d.evict_ids = snap.active_ids[drop]
        if drop.size or not len(snap.pending):
            return d
        # 2. admit: the head of the pending pool, onto ranks with free slots and pages, in FIFO order
        free = snap.pages_capacity - snap.pages_used
        np.subtract.at(free, snap.active_rank, need - snap.active_pages)  # keep the next page of each running one
        slots = self.max_running - snap.rank_count()
        cand = snap.pending.peek(int(max(slots.sum(), 0)))
        ranks = fill_ranks(pages_for(snap.lengths.context(cand) + P, P), slots, free,
                           np.argsort(snap.rank_count(), kind="stable"))
        if ranks.size:
            d.prefill_ids, d.prefill_ranks = cand[: ranks.size], ranks
        return d


def main() -> None:
    # what runs the policy: imported here, so that the class above can move into batchgen/policy/ as it is
    from batchgen.job import Job
    from batchgen.policy import make_policy
    from batchgen.results import format_table, summarize
    from batchgen.sim.run import simulate
    from batchgen.specs import load_cluster, load_model
    from batchgen.workload import build_workload

    workload = build_workload({"name": "small", "num_sequences": 500,
                               "input": {"kind": "uniform", "low": 256, "high": 2048},
                               "output": {"kind": "longtail", "mean": 512, "p99_over_p95": 3.78,
                                          "max_over_p95": 9.2, "max": 2048}}, seed=0, progress=False)
    rows = []
    for policy in (FillFirst(), make_policy({"name": "continuous"})):
        job = Job(model=load_model("qwen3_30b_a3b"), cluster=load_cluster("h100_8"), workload=workload,
                  policy=policy, check_invariants=True)  # recount every account at every boundary
        rows.append(summarize(simulate(job, progress=False)))
    print(format_table(rows))


if __name__ == "__main__":
    main()
