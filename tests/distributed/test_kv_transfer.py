"""MIGRATE between processes: a sequence's KV read where it is in one process's paged cache (its device pages, or
its host copy when it has none on device), sent over gloo and landed where the other process runs it (its device
pages, or a host copy), bit for bit, on other pages, for K/V caches and MLA's latent-only cache; no host copy is
made on the way, and the destination keeps one only when asked (holding what the source's held)."""

import pytest
import torch

from batchgen.dist import Comm
from batchgen.dist.kv_transfer import recv_rows, recv_sequence, send_rows, send_sequence
from batchgen.exec.kv_cache import PagedKVCache

from .conftest import run_procs

PAGE = 4
GEOMETRIES = {"gqa": dict(num_layers=2, num_kv_heads=2, head_dim=3),
              "mla": dict(num_layers=3, num_kv_heads=1, head_dim=5, v_head_dim=0)}


def new_cache(geometry, dtype=torch.float32):
    return PagedKVCache(**GEOMETRIES[geometry], page_size=PAGE, num_pages=32, host_pages=2, dtype=dtype)


def write_step(cache, seq_id, n, gen):
    """What attention does for n new tokens: random K (and V) at their slots in every layer."""
    start = cache.device_tokens(seq_id) if seq_id in cache else 0
    slots = cache.prepare([seq_id], [n], [start]).slot_mapping
    for l in range(cache.num_layers):
        for pool in cache.layer(l)[:cache.planes]:
            flat = pool.view(-1, cache.num_kv_heads, pool.shape[-1])
            flat[slots] = torch.randn(n, cache.num_kv_heads, pool.shape[-1], generator=gen).to(pool.dtype)


def source_cache(geometry, dtype):
    """Sequences 1 and 4: 13 tokens on device, the first 8 synced to host; sequence 2: 6 tokens, yielded (host
    only); sequence 3 stays behind."""
    gen = torch.Generator().manual_seed(7)
    cache = new_cache(geometry, dtype)
    write_step(cache, 3, 5, gen)
    for sid in (1, 4):
        write_step(cache, sid, 8, gen)
        cache.sync_to_host([sid])
        write_step(cache, sid, 5, gen)
    write_step(cache, 2, 6, gen)
    cache.yield_to_host([2])
    return cache


def kv_of(cache, sid):
    """(the tokens where the sequence's KV is, from there; its host copy's tokens) as [layers, planes, T, ...]."""
    rows, where = cache.migration_rows(sid)
    host = cache._read_host(cache._token_slots([cache._seqs[sid]], "host_pages", [0], [cache.synced_tokens(sid)]))
    return rows.clone(), where, host.clone()


def _migrate(ctx, sources):
    comm = Comm()
    out = {}
    for geometry, src in sources.items():
        if comm.rank == 0:
            out[geometry] = [send_sequence(comm, src, sid, dst=1) for sid in (1, 2, 4)]
        else:
            dst = new_cache(geometry, src.dtype)
            write_step(dst, 9, 13, torch.Generator().manual_seed(1))  # 4 pages: the migrated ones land elsewhere
            got = [recv_sequence(comm, dst, 1, src=0, to_device=True, host_copy=False),
                   recv_sequence(comm, dst, 2, src=0, to_device=False, host_copy=True),
                   recv_sequence(comm, dst, 4, src=0, to_device=True, host_copy=True)]
            dst.check()
            out[geometry] = (got, {sid: kv_of(dst, sid) for sid in (1, 2, 4)},
                             {sid: (dst.on_device(sid), dst.synced_tokens(sid)) for sid in (1, 2, 4)},
                             dst.pages(1), dst.host_pool.used_pages())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_lands_where_the_destination_runs_it_bit_for_bit(dtype):
    sources = {g: source_cache(g, dtype) for g in GEOMETRIES}
    sender, receiver = run_procs(_migrate, 2, sources)
    for geometry, src in sources.items():
        want = {sid: kv_of(src, sid) for sid in (1, 2, 4)}
        size = src.bytes_per_token
        assert sender[geometry] == [13 * size, 6 * size, 13 * size]  # exactly the tokens, no whole pages
        got, kv, where, pages1, host_pages = receiver[geometry]
        assert [(m.source, m.target, m.transfer_bytes) for m in got] == [
            ("device", "device", 13 * size), ("host", "host", 6 * size), ("device", "device", 13 * size)]
        assert [m.local_bytes for m in got] == [0, 0, 8 * size]  # 4: its host copy made again, device -> host
        assert where == {1: (True, 0), 2: (False, 6), 4: (True, 8)}  # host copies only where asked, as the source's
        assert want[1][1] == want[4][1] == "device" and want[2][1] == "host"
        for sid in (1, 2, 4):
            assert torch.equal(kv[sid][0], want[sid][0]), (geometry, sid)  # the KV itself, where it runs
        assert torch.equal(kv[4][2], want[4][2]) and kv[4][2].shape[2] == 8  # the kept copy: what the source's held
        assert host_pages == 2 + 2  # 2's six tokens and 4's eight: nothing for 1
        assert pages1 != src.pages(1)  # really other pages: the receiver's page 0.. were taken


class LoopbackComm:
    """A Comm stand-in whose sends are received by its own recvs, in order (header logic without processes)."""

    ranks = (0, 1)

    def __init__(self):
        self.queue = []

    def send(self, tensor, dst, what=""):
        self.queue.append(tensor.clone())

    def recv(self, tensor, src, what=""):
        got = self.queue.pop(0)
        assert got.shape == tensor.shape and got.dtype == tensor.dtype, (got.shape, tensor.shape)
        tensor.copy_(got)


def test_kv_for_another_sequence_is_refused():
    comm = LoopbackComm()
    rows = source_cache("gqa", torch.float32).migration_rows(1)[0]
    send_rows(comm, 5, rows, dst=1)
    with pytest.raises(RuntimeError, match="expected the KV of sequence 6 .* got sequence 5"):
        recv_rows(comm, 6, src=0)
    comm.queue.clear()
    comm.send(torch.zeros(12, dtype=torch.int64), 1)  # a header's size, not a header
    with pytest.raises(RuntimeError, match="not a KV header"):
        recv_rows(comm, 6, src=0)


def test_adopt_refuses_rows_of_another_geometry():
    rows, where = source_cache("gqa", torch.float32).migration_rows(1)
    with pytest.raises(ValueError, match="do not fit this cache"):
        new_cache("mla").adopt(1, rows, where, to_device=True, host_copy=False)
