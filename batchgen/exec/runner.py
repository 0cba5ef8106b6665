"""Module-based batching on real tensors: attention per rank in micro-batches, experts on the combined batch.

Every layer runs attention for each rank's sequences (each rank has its own paged KV cache, and its sequences
are split into micro-batches of `micro_batch`), then concatenates all their hidden states and runs the MoE
(or dense FFN) once on that combined batch: the expert batch is the sum of every micro-batch of every rank.
All ranks of one instance live on one device here (one process); a multi-process runner will put each rank
on its own device and exchange the combined batch with all-to-all.

Where a sequence's KV is decides how its attention runs (`RankBatch.host_resident`):
- device-resident: over its pages in the rank's device pool;
- host-resident: its micro-batches (of `micro_batch` sequences, apart from the device-resident ones) have each
  layer's KV restored from the host pool into a double-buffered device staging buffer (`staging.py`), attend
  there, and send the new token's KV back to the host copy;
- host-resident with `cpu_attention`: attention runs on the host CPU over the host pool itself (GQA/MHA only;
  on a GPU only q, k, v and the output cross the link), writing the new KV straight into the host copy;
- PARTITIONed (`RankBatch.tp` > 1): the tokens stay on the lead rank, but attention runs on every rank of its
  group (the lead and the next tp - 1 ranks), each over its head shard (`shards.py`), and the shards' partial
  outputs are summed (the all-reduce that joins them) before the residual.
Timings never add synchronisation on CUDA: events are recorded around modules and read once, at the end of
the forward (which waits for the logits anyway). On CPU the executor's clock (batchgen.exec.clock) is read around
each module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.exec import clock
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models.decoder import MoEDecoder
from batchgen.exec.models.tensor_parallel import group_attention, shard_attention
from batchgen.exec.overlap_layers import overlapped_layers
from batchgen.exec.shards import ShardStore, shards_of
from batchgen.exec.staging import RestorePipeline, StagedBatch, StagingArea, stage, staging_pages
from batchgen.pricing.costs import SIMILAR, SIMILAR_SLACK  # one rule: the simulator prices the calls made here


@dataclass
class RankBatch:
    """What one rank runs in a forward pass: new tokens of some sequences, contiguous per sequence."""

    cache: PagedKVCache
    seq_ids: list[int]
    token_ids: list[int]         # flat, sequence after sequence
    new_counts: list[int]        # new tokens per sequence
    start_positions: list[int]   # position of each sequence's first new token (= its KV length so far)
    host_resident: list[bool] = field(default_factory=list)  # per sequence; empty: all device-resident
    tp: list[int] = field(default_factory=list)  # per sequence: ranks its attention is split over; empty: all 1
    # per sequence: whether its last new token's logits are wanted (a prompt chunk that does not end its context
    # samples nothing, so it skips the LM head); empty: all
    sample: list[bool] = field(default_factory=list)
    # per sequence: the group whose shared prefix its decode query reads in a cascaded call (-1: none; the plan's
    # `decode_cascade`, batchgen.core.cascade), and that prefix's tokens (the plan's `decode_shared`); empty: none
    cascade: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)

    def lead_with(self, n: int) -> None:
        """Its per-sequence cascade lists as they stand once `n` sequences that cascade nothing come first."""
        if self.cascade:
            self.cascade = [-1] * n + self.cascade
            self.shared = [0] * n + self.shared


@dataclass
class ForwardStats:
    rank_attention_s: list[float] = field(default_factory=list)
    ffn_s: float = 0.0
    head_s: float = 0.0           # final norm and LM head over the last rows
    gate_tokens: int = 0
    host_resident: int = 0        # sequences that ran host-resident
    restored_bytes: int = 0       # KV restored from host into staging buffers, all layers
    appended_bytes: int = 0       # new tokens' KV sent back to host copies, all layers
    ffn_calls: int = 0            # FFN calls over all layers when each micro-batch runs its own
    prefix_reads: int = 0         # prefix tokens the cascaded calls read, each call its prefix once (per layer)
    weight_bytes: int = 0         # weights copied host -> device in this forward (streamed weights)


@dataclass
class _Piece:
    """One attention micro-batch: device (pages), staged (host pages restored per layer) or cpu (host pool)."""

    kind: str                     # device, staged, cpu or shard
    rank: int
    rows: slice
    meta: AttentionMetadata
    cache: PagedKVCache
    seq_ids: list[int]
    staged: StagedBatch | None = None
    index: int = 0                # its place among its rank's staged micro-batches
    shard: int = 0                # shard pieces: which head shard, of how many, and the store holding it
    degree: int = 1
    store: ShardStore | None = None


class InstanceRunner:
    def __init__(self, model: MoEDecoder, micro_batch: int = 0, attention_tp: int = 1, streamer=None):
        """`attention_tp` > 1: each rank is a TP-attention group; its device attention runs head-sharded over
        that many shards whose partial outputs are summed (`group_attention`), as the group's GPUs do.
        `streamer`: the model's `weight_stream.WeightStreamer` when the memory plan streams weights from host
        (every forward then acquires each layer's weights before it runs)."""
        self.model = model
        self.micro_batch = micro_batch
        self.attention_tp = attention_tp
        self.device = next(model.parameters()).device
        self.streamer = streamer
        # True when the MoE layers are collectives (batchgen.dist's ExpertParallelMoE): a forward with no tokens
        # on this rank still runs every layer, with zero rows, so that it joins the other ranks' all-to-alls
        self.collective = False
        # PARTITION across processes (batchgen.dist.partition.HeadShardExchange), set by a multi-process worker:
        # the other shards of its partitioned sequences live in other processes, so the runner plans only the
        # lead's own shard and, once per layer, hands the group's attention to this exchange (every rank calls
        # it, with or without partitioned sequences of its own: it is a collective)
        self.partition = None
        # data-parallel prefill (batchgen.dist.dp_prefill.PrefillRing), set by a multi-process worker whose policy
        # prefills data parallel: active during the forwards that prefill
        self.prefill_ring = None

    @torch.inference_mode()
    def forward(self, ranks: list[RankBatch], micro_batch: int | None = None, cpu_attention: bool = False,
                ffn_schedule: str = "combined", comm_overlap: bool = False,
                dp_prefill: bool = False) -> tuple[list[torch.Tensor], ForwardStats]:
        """Logits of each sequence's last new token, per rank ([num_seqs, vocab] each; only the sequences whose
        `sample` flag is set where a rank gives flags), and timings.

        `ffn_schedule` other than "combined" (the offloading systems): each attention micro-batch runs its own FFN
        instead of one combined expert batch. With a streamer, every streamed layer's weights are copied from
        their host copy into a staging slot before the layer runs (once per layer, reused by every micro-batch).
        `comm_overlap` (expert-parallel layers only): each micro-batch's all-to-all beside the next one's attention
        (batchgen.exec.overlap_layers). `dp_prefill`: expert-parallel layers run this process's tokens through
        every expert instead (`prefill_ring`; a process without one holds every expert already)."""
        ring = self.prefill_ring if dp_prefill else None
        if ring is not None and comm_overlap:
            raise ValueError("a data-parallel prefill has no all-to-all to overlap")
        if ring is None:
            return self._forward(ranks, micro_batch, cpu_attention, ffn_schedule, comm_overlap)
        ring.active = True
        try:
            return self._forward(ranks, micro_batch, cpu_attention, ffn_schedule, comm_overlap)
        finally:
            ring.active = False

    def _forward(self, ranks: list[RankBatch], micro_batch: int | None, cpu_attention: bool, ffn_schedule: str,
                 comm_overlap: bool) -> tuple[list[torch.Tensor], ForwardStats]:
        mb = self.micro_batch if micro_batch is None else micro_batch
        stats = ForwardStats(rank_attention_s=[0.0] * len(ranks))
        if cpu_attention and self.model.config.is_mla and any(any(b.host_resident) for b in ranks):
            raise ValueError("CPU attention needs GQA/MHA attention: MLA (DeepSeek-V3) expands its latent KV per "
                             "head with kv_b_proj, which stays on the accelerator; run it host-resident with "
                             "attention on the GPU (policy.attention=gpu)")
        pieces, tokens, last_rows = self._plan(ranks, mb, cpu_attention)
        stats.prefix_reads = sum(p.meta.prefix_tokens for p in pieces if p.kind in ("device", "staged"))
        if not pieces and not self.collective:
            return [torch.empty(0) for _ in ranks], stats
        pipelines = self._pipelines(pieces, mb)
        timer = _Timer(self.device)
        hidden = self.model.embed(torch.tensor(tokens, dtype=torch.long, device=self.device))
        offload = ffn_schedule != "combined"
        streamer = self.streamer
        if streamer is not None:
            streamer.begin()
            copied = streamer.copied_bytes
        if comm_overlap:
            if not self.collective or streamer is not None or self.attention_tp > 1 or offload:
                raise ValueError("the all-to-all overlapped across micro-batches runs expert-parallel layers over "
                                 "processes, with resident weights, data-parallel attention and one expert batch")
            hidden = overlapped_layers(self, pieces, hidden, timer, stats)
        else:
            hidden = self._layers(pieces, hidden, pipelines, mb, offload, timer, stats)
        if streamer is not None:
            streamer.finish()
            stats.weight_bytes = streamer.copied_bytes - copied
        start = timer.start()
        out = [self.model.final_logits(hidden[rows]).float() if rows else torch.empty(0) for rows in last_rows]
        timer.stop(start, "head")
        self._finish_host(pieces, stats)
        totals = timer.totals()
        stats.rank_attention_s = [totals.get(r, 0.0) for r in range(len(ranks))]
        stats.ffn_s = totals.get("ffn", 0.0)
        stats.head_s = totals.get("head", 0.0)
        return out, stats

    def _layers(self, pieces: list[_Piece], hidden: torch.Tensor, pipelines, mb: int, offload: bool, timer: "_Timer",
                stats: ForwardStats) -> torch.Tensor:
        """Every layer: each micro-batch's attention, then one FFN over every row (or one per micro-batch with
        `offload`); returns the hidden states after the last layer."""
        streamer = self.streamer
        for layer in range(self.model.num_layers):
            if streamer is not None:
                streamer.acquire(layer)
            for p in pieces:
                if p.kind == "shard":
                    if p.shard == 0 and self.partition is None:  # the whole group at once: the sum needs every shard
                        self._partitioned(layer, hidden, [q for q in pieces if q.rows == p.rows], timer)
                    continue
                start = timer.start()
                if p.kind == "device":
                    kv = p.cache.layer(layer)
                elif p.kind == "cpu":
                    kv = p.cache.host_layer(layer)
                else:
                    kv = pipelines[p.rank].acquire(layer, p.index)
                if self.attention_tp > 1 and p.kind == "device":
                    block = self.model.layers[layer]
                    x = hidden[p.rows]
                    hidden[p.rows] = x + group_attention(block.self_attn, block.input_layernorm(x), p.meta, kv,
                                                         self.attention_tp)
                else:
                    hidden[p.rows] = self.model.attention_block(layer, hidden[p.rows], p.meta, kv)
                timer.stop(start, p.rank)
                if p.kind == "staged":  # the copies (new tokens' KV kept, the next restore) are not attention
                    pipelines[p.rank].release(layer, p.index)
            if self.partition is not None:
                self.partition.layer(self.model, layer, hidden, [p for p in pieces if p.kind == "shard"], timer)
            start = timer.start()
            if offload:  # an FFN per attention micro-batch (the weights already loaded for the layer)
                ffn_rows = _ffn_rows(pieces, mb)
                for rows in ffn_rows:
                    hidden[rows] = self.model.ffn_block(layer, hidden[rows])
                stats.ffn_calls += len(ffn_rows)
            else:
                hidden = self.model.ffn_block(layer, hidden)  # COMBINE: one expert batch for every rank
            timer.stop(start, "ffn")
            stats.gate_tokens = hidden.shape[0]  # tokens at the gate of each MoE layer
        return hidden

    def _partitioned(self, layer: int, hidden: torch.Tensor, group: list[_Piece], timer: "_Timer") -> None:
        """Attention of partitioned sequences: each rank of the group over its head shard, then the sum of the
        partial outputs (the all-reduce) and o_proj's bias once, before the residual."""
        block = self.model.layers[layer]
        x = block.input_layernorm(hidden[group[0].rows])
        total = None
        for p in group:
            start = timer.start()
            part = shard_attention(block.self_attn, x, p.meta, p.store.layer(layer, p.degree), p.shard, p.degree)
            total = part if total is None else total + part
            timer.stop(start, p.rank)
        bias = block.self_attn.o_proj.bias
        hidden[group[0].rows] = hidden[group[0].rows] + (total if bias is None else total + bias)

    def _plan(self, ranks: list[RankBatch], mb: int, cpu_attention: bool):
        """Micro-batches per rank, with their metadata; the flat token list; each sequence's last row."""
        pieces: list[_Piece] = []
        tokens, last_rows, offset = [], [], 0
        for r, batch in enumerate(ranks):
            starts = [0]
            for n in batch.new_counts:
                starts.append(starts[-1] + n)
            last = [0] * len(batch.seq_ids)
            host = batch.host_resident or [False] * len(batch.seq_ids)
            tp = batch.tp or [1] * len(batch.seq_ids)
            staged = 0
            # Micro-batches of similar contexts: attention pads every sequence to the longest context (and
            # query) of its call, so with contexts of 30 to 500 tokens a random mix wastes half its work.
            order = sorted(range(len(batch.seq_ids)), key=lambda i: batch.start_positions[i] + batch.new_counts[i])
            for degree in sorted({d for d in tp if d > 1}):  # partitioned: one group of shards per degree
                idx = [i for i in order if tp[i] == degree]
                args = ([batch.seq_ids[i] for i in idx], [batch.new_counts[i] for i in idx],
                        [batch.start_positions[i] for i in idx])
                rows = slice(offset, offset + sum(args[1]))
                for j in range(degree) if self.partition is None else (0,):  # (the others: other processes)
                    store = shards_of(ranks[(r + j) % len(ranks)].cache)
                    pieces.append(_Piece("shard", (r + j) % len(ranks), rows, store.prepare(*args), store.cache,
                                         args[0], shard=j, degree=degree, store=store))
                for i in idx:
                    tokens.extend(batch.token_ids[starts[i]:starts[i + 1]])
                    offset += batch.new_counts[i]
                    last[i] = offset - 1
            for resident in (False, True):
                # Prompts and single decode tokens go to separate micro-batches: attention pads every query to
                # the longest one of its call, so one prompt would otherwise inflate a whole decode batch.
                mine = [i for i in order if host[i] == resident and tp[i] == 1]
                # a prompt that writes a shared prefix runs before the prompts that read it (kv_prefixes), a nested
                # level's writer after the writer of the level it reads (its wave)
                creating = batch.cache.take_creating() if not resident else {}
                waves = [[i for i in mine if creating.get(batch.seq_ids[i]) == w]
                         for w in sorted(set(creating.values()))]
                prompts = [i for i in mine if batch.new_counts[i] > 1 and batch.seq_ids[i] not in creating]
                decodes = [i for i in mine if batch.new_counts[i] == 1 and batch.seq_ids[i] not in creating]
                cascades: dict[int, list[int]] = {}  # a group's cascaded decodes: calls of at most mb of them
                for i in decodes if batch.cascade and not (resident and cpu_attention) else ():
                    if batch.cascade[i] >= 0:
                        cascades.setdefault(batch.cascade[i], []).append(i)
                if cascades:
                    decodes = [i for i in decodes if batch.cascade[i] < 0]
                calls = [*[(w, -1) for w in waves], (prompts, -1), (decodes, -1),
                         *[(m, g) for g, m in cascades.items()]]
                for members, cascade in calls:
                    ends = [batch.start_positions[i] + batch.new_counts[i] for i in members]
                    if cascade >= 0:  # a cascade: calls of at most mb members, as the engine counts them
                        step = mb or len(members)
                        chunks = [(lo, min(lo + step, len(members))) for lo in range(0, len(members), step)]
                    elif resident and not cpu_attention:  # staged: each micro-batch must fit a staging buffer
                        pages = [-(-n // batch.cache.page_size) for n in ends]
                        chunks = _chunks_within(pages, mb, batch.cache.staging_pages)
                    else:  # attention over pages in place: calls of similar contexts, padding kept small
                        chunks = _chunks_similar(ends, mb)
                    for lo, hi in chunks:
                        idx = members[lo:hi]
                        args = ([batch.seq_ids[i] for i in idx], [batch.new_counts[i] for i in idx],
                                [batch.start_positions[i] for i in idx])
                        n = sum(args[1])
                        rows = slice(offset, offset + n)
                        if cascade >= 0 and not resident:
                            meta = batch.cache.cascade_metadata(batch.cache.prepare(*args), args[0], cascade)
                            p = _Piece("device", r, rows, meta.to(self.device), batch.cache, args[0])
                        elif not resident:
                            p = _Piece("device", r, rows, batch.cache.prepare(*args).to(self.device), batch.cache,
                                       args[0])
                        elif cpu_attention:
                            p = _Piece("cpu", r, rows, batch.cache.prepare_host(*args), batch.cache, args[0])
                        else:
                            # a cascade's call restores its prefix once, from its first member's host copy
                            sb = stage(args[0], batch.cache.prepare_host(*args), batch.cache,
                                       batch.shared[idx[0]] if cascade >= 0 else 0)
                            p = _Piece("staged", r, rows, sb.meta, batch.cache, args[0], sb, staged)
                            staged += 1
                        pieces.append(p)
                        for i in idx:
                            tokens.extend(batch.token_ids[starts[i]:starts[i + 1]])
                            offset += batch.new_counts[i]
                            last[i] = offset - 1
            last_rows.append([row for row, keep in zip(last, batch.sample) if keep] if batch.sample else last)
        return pieces, tokens, last_rows

    def _pipelines(self, pieces: list[_Piece], mb: int) -> dict[int, RestorePipeline]:
        """Per rank with staged micro-batches: its staging area (allocated once, sized for B_attn sequences of
        the job's longest context when the cache knows it) and this forward's restore schedule."""
        by_rank: dict[int, list[_Piece]] = {}
        for p in pieces:
            if p.kind == "staged":
                by_rank.setdefault(p.rank, []).append(p)
        out = {}
        for r, mine in by_rank.items():
            cache = mine[0].cache
            need = max(p.staged.num_pages for p in mine)
            b_attn = mb or max(len(p.seq_ids) for p in mine)  # micro_batch 0: one micro-batch of them all
            hint = (cache.staging_pages or (staging_pages(b_attn, cache.max_context, cache.page_size)
                                            if cache.max_context else need))
            if cache.staging is None:
                cache.staging = StagingArea(cache, max(need, hint))
            cache.staging.ensure(need, hint)
            out[r] = RestorePipeline(cache.staging, [p.staged for p in mine], self.model.num_layers)
        return out

    def _finish_host(self, pieces: list[_Piece], stats: ForwardStats) -> None:
        """The new tokens' KV into the host copies (one index_copy per staged micro-batch), then count them."""
        for p in pieces:
            if p.kind in ("device", "shard"):
                continue
            if p.kind == "staged":
                p.cache.write_host_tokens(p.staged.host_slots, p.staged.appended.cpu())
                stats.restored_bytes += p.staged.num_pages * p.cache.layer_page_bytes * p.cache.num_layers
            p.cache.host_advance(p.seq_ids)
            stats.host_resident += len(p.seq_ids)
            stats.appended_bytes += p.meta.num_tokens * p.cache.bytes_per_token


def _ffn_rows(pieces: list["_Piece"], mb: int) -> list[slice]:
    """The row ranges of a forward's FFN calls under an offloading schedule, in order: one per micro-batch of `mb`
    sequences. Device decode pieces are attention calls of similar contexts (`_chunks_similar`), several to a
    micro-batch: consecutive ones of a rank are joined and cut into micro-batches of `mb` rows (what the simulator
    prices, `plan.decode._host_micro_batches`); any other piece is its own (a partition group's shards share one)."""
    out: list[slice] = []
    span: list[int] | None = None  # [rank, first row, end] of consecutive device decode pieces

    def flush() -> None:
        if span is not None:
            out.extend(slice(span[1] + lo, span[1] + hi) for lo, hi in _chunks(span[2] - span[1], mb))

    for p in pieces:
        decode = p.kind == "device" and p.rows.stop - p.rows.start == len(p.seq_ids)
        if decode and span is not None and span[0] == p.rank and span[2] == p.rows.start:
            span[2] = p.rows.stop
            continue
        flush()
        span = [p.rank, p.rows.start, p.rows.stop] if decode else None
        if not decode and (not out or p.rows != out[-1]):
            out.append(p.rows)
    flush()
    return out


def _chunks(n: int, size: int):
    size = size if size > 0 else max(n, 1)
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)




def _chunks_similar(lengths: list[int], size: int):
    """Consecutive runs of at most `size` items (0: any number) of ascending `lengths` whose longest is at most
    SIMILAR x the shortest + SIMILAR_SLACK: attention pads each call to its longest context (and query), so
    one call over contexts of 30 to 500 tokens does twice the work it needs. Splitting is invisible to the
    policy (the experts still run once on the combined batch) and costs a few small ops per call."""
    lo = 0
    for i, n in enumerate(lengths):
        if (size > 0 and i - lo == size) or n > SIMILAR * lengths[lo] + SIMILAR_SLACK:
            yield lo, i
            lo = i
    if lo < len(lengths):
        yield lo, len(lengths)


def _chunks_within(pages: list[int], size: int, capacity: int | None):
    """Consecutive runs of at most `size` items (0: any number) whose pages sum to at most `capacity` (None:
    no cap); an item larger than the capacity runs alone."""
    lo, total = 0, 0
    for i, p in enumerate(pages):
        full = (size > 0 and i - lo == size) or (capacity is not None and total + p > capacity and i > lo)
        if full:
            yield lo, i
            lo, total = i, 0
        total += p
    if lo < len(pages):
        yield lo, len(pages)


class _Timer:
    """Seconds per bucket. CPU: the executor's clock (batchgen.exec.clock) around each module. CUDA: events on the
    compute stream, read after the forward, so that timing never synchronises (a sync per module would serialise
    the staging restores with attention and bias what is measured)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._totals: dict = {}
        self._marks: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return clock.now()

    def stop(self, start, bucket) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marks.append((start, end, bucket))
        else:
            self._totals[bucket] = self._totals.get(bucket, 0.0) + clock.now() - start

    def totals(self) -> dict:
        if self._marks:
            self._marks[-1][1].synchronize()
            for start, end, bucket in self._marks:
                self._totals[bucket] = self._totals.get(bucket, 0.0) + start.elapsed_time(end) / 1e3
            self._marks.clear()
        return self._totals
