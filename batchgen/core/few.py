"""Two primitives of `ClusterState` for a few ids at a time, on Python scalars: the chunks of one forward and the
finishes of one run, where numpy's per-call overhead costs more than the arithmetic: the same checks, the same state
after, the same ops emitted (tests/test_sim_paths.py). A serving engine's one-GPU boundary chunks and finishes one
to three sequences (what these save: benchmarks/results/sim_scale.md). They are the state's remaining second
implementation: one representation for a boundary's few ids and its many would retire them."""

from __future__ import annotations

import numpy as np

from batchgen.core.sequences import FINISHED, PENDING, InvariantError, without


class FewIds:
    """`ClusterState.prefill_chunks` and `finish` for a few ids (mixed into ClusterState)."""

    def _prefill_chunks_few(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                            lengths: np.ndarray) -> bool:
        """`prefill_chunks` of a few chunks, nothing partitioned, on Python scalars (the same checks, the same state
        after). False, having changed nothing, where a precondition fails: the array code then names it."""
        t, P = self.table, self.page_tokens
        rows = []
        for sid, g, s, n in zip(ids.tolist(), gpus.tolist(), starts.tolist(), lengths.tolist()):
            w, c, e = int(t.where[sid]), int(t.input_len[sid]) + int(t.decoded[sid]), s + n
            if not ((w == PENDING if s == 0 else w == g and int(t.prefilled[sid]) == s) and n >= 1 and e <= c):
                return False
            rows.append((sid, g, s, e, c))
        new = [(sid, g) for sid, g, s, _, _ in rows if s == 0]
        if new:  # _join_gpu without its reserve
            if any(int(self.topo.gpu_instance[g]) != instance for _, g in new):
                raise InvariantError("a sequence can only run on a GPU of the instance that schedules it")
            for sid, g in new:
                t.where[sid] = g
                t.kv_gpu[sid] = g
                t.host_resident[sid] = False
                t.instance[sid] = instance
            self.active[instance] = np.concatenate([self.active[instance], np.array([sid for sid, _ in new], np.int64)])
        grown: dict[int, int] = {}  # GPU -> pages its chunks add
        for sid, g, s, e, c in rows:
            need, held = -(-(e + (e == c)) // P), int(t.pages[sid])
            if need > held:
                t.pages[sid] = need
                grown[g] = grown.get(g, 0) + need - held
            t.prefilled[sid] = 0 if e == c else e
            self.num_part_prefilled += (e != c) - (s != 0)  # s != 0: it was part-way (prefilled == s)
        for g, added in grown.items():
            self._gpu_holds(g, int(self.pages_used[g]) + added)
        return True

    def _finish_few(self, instance: int, ids: np.ndarray, times: np.ndarray) -> bool:
        """`finish` of a few sequences, nothing partitioned, no host copy, nothing prefilling to host, on Python
        scalars (the same check, the same state after). False, having changed nothing, where a sequence is not done:
        the array code then names it."""
        t = self.table
        freed: dict[int, int] = {}  # GPU -> pages the finished sequences held
        running, held = [], []
        for sid in ids.tolist():
            if int(t.decoded[sid]) != int(t.output_len[sid]):
                return False
            g = int(t.where[sid])
            if g >= 0:
                running.append(sid)
                held.append(g)
                freed[g] = freed.get(g, 0) + int(t.pages[sid])
        if running:  # `_drop_kv`: nothing is partitioned, and only running sequences hold KV here
            self.oplogs[instance].add("free", np.array(running, np.int64), np.array(held, np.int64))
            t.kv_gpu[running] = -1
        for sid in running:  # _leave_gpu
            t.pages[sid] = 0
            t.host_resident[sid] = False
            if t.prefilled[sid]:
                self.num_part_prefilled -= 1
                t.prefilled[sid] = 0
        for g, pages in freed.items():
            self.pages_used[g] -= pages
        if running:
            self.active[instance] = without(self.active[instance], np.array(running, np.int64), self._leaving)
        t.where[ids] = FINISHED
        t.finish_time[ids] = times
        self.num_finished += ids.size
        return True
