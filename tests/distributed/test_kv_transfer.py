"""MIGRATE between processes: a sequence's KV packed from one paged cache, sent over gloo, unpacked into
another process's cache (on other pages), arrives bit for bit, for K/V caches and MLA's latent-only cache."""

import pytest
import torch

from batchgen.dist import Comm
from batchgen.dist.kv_transfer import pack, recv_rows, recv_sequence, send_rows, send_sequence, unpack
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


def device_rows(cache, seq_id):
    """The sequence's device KV read through its pages, [tokens, layers, planes, heads, dim]."""
    pages, n = torch.tensor(cache.pages(seq_id)), cache.device_tokens(seq_id)
    per_layer = [torch.stack([p[pages].reshape(-1, *p.shape[2:])[:n] for p in cache.layer(l)[:cache.planes]], 1)
                 for l in range(cache.num_layers)]
    return torch.stack(per_layer, 1)


def source_cache(geometry, dtype):
    """Sequence 1: 13 tokens on device, the last 5 not yet synced to host; sequence 2: 6 tokens, yielded
    (host only); sequence 3 stays behind."""
    gen = torch.Generator().manual_seed(7)
    cache = new_cache(geometry, dtype)
    write_step(cache, 3, 5, gen)
    write_step(cache, 1, 8, gen)
    cache.sync_to_host([1])
    write_step(cache, 1, 5, gen)
    write_step(cache, 2, 6, gen)
    cache.yield_to_host([2])
    return cache


def _migrate(ctx, sources):
    comm = Comm()
    out = {}
    for geometry, src in sources.items():
        if comm.rank == 0:
            sent = [send_sequence(comm, src, sid, dst=1) for sid in (1, 2)]
            out[geometry] = sent
        else:
            dst = new_cache(geometry, src.dtype)
            write_step(dst, 9, 13, torch.Generator().manual_seed(1))  # 4 pages: the migrated ones land elsewhere
            got = [recv_sequence(comm, dst, 1, src=0, to_device=True), recv_sequence(comm, dst, 2, src=0)]
            dst.check()
            out[geometry] = (got, pack(dst, 1), pack(dst, 2), device_rows(dst, 1), dst.on_device(2),
                             dst.pages(1))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pack_send_recv_unpack_round_trips_exactly(dtype):
    sources = {g: source_cache(g, dtype) for g in GEOMETRIES}
    sender, receiver = run_procs(_migrate, 2, sources)
    for geometry, src in sources.items():
        want1, want2 = pack(src, 1), pack(src, 2)
        assert want1.shape[0] == 13 and want2.shape[0] == 6 and want1.dtype == dtype
        (n1, n2), got1, got2, dev1, on_dev2, pages1 = receiver[geometry]
        assert (n1, n2) == (13, 6)
        assert sender[geometry] == [want1.numel() * want1.element_size(), want2.numel() * want2.element_size()]
        assert torch.equal(got1, want1) and torch.equal(got2, want2)
        assert torch.equal(dev1, want1)  # loaded to device: the pages hold the same KV
        assert not on_dev2  # imported as a host copy only
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
    rows = pack(source_cache("gqa", torch.float32), 1)
    send_rows(comm, 5, rows, dst=1)
    with pytest.raises(RuntimeError, match="expected the KV of sequence 6 .* got sequence 5"):
        recv_rows(comm, 6, src=0)
    comm.queue.clear()
    comm.send(torch.zeros(10, dtype=torch.int64), 1)
    with pytest.raises(RuntimeError, match="not a KV header"):
        recv_rows(comm, 6, src=0)


def test_unpack_refuses_rows_of_another_geometry():
    rows = pack(source_cache("gqa", torch.float32), 1)
    with pytest.raises(ValueError, match="this cache stores"):
        unpack(new_cache("mla"), 1, rows)
