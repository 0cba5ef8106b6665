"""Paged KV cache: the metadata contract with attention, YIELD/restore, MIGRATE, eviction and the budget."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from batchgen.core.sequences import InvariantError
from batchgen.exec.host_pool import HostMemoryFullError, HostPool
from batchgen.exec.kv_cache import CacheFullError, HostKV, PagedKVCache, migrate

L, H, D, PS = 2, 2, 3, 4


def make_cache(num_pages=16, device="cpu", page_size=PS, dtype=torch.float32, host_pages=None):
    return PagedKVCache(L, H, D, page_size=page_size, num_pages=num_pages, dtype=dtype, device=device,
                        host_pages=host_pages)


def known_values(seq_id, positions):
    """[T, L, 2, H, D]: every element of token p of sequence s, layer l, K/V kv is s*1000 + p + l/4 + kv/8."""
    base = seq_id * 1000 + torch.as_tensor(positions, dtype=torch.float32).cpu()
    extra = torch.arange(L).view(L, 1) / 4 + torch.arange(2).view(1, 2) / 8
    return (base.view(-1, 1, 1, 1, 1) + extra.view(1, L, 2, 1, 1)).expand(-1, L, 2, H, D).contiguous()


def write(cache, md, values, pools=None):
    """What attention does: scatter each new token's K/V at its slot in every layer's flat pool."""
    slots = md.slot_mapping
    for l in range(cache.num_layers):
        for kv, pool in enumerate((pools or cache.layer)(l)):
            pool.view(-1, cache.num_kv_heads, cache.head_dim)[slots] = values[:, l, kv].to(pool)


def gather(cache, pages, length, pools=None):
    """What attention reads: the first `length` tokens through a block-table row, as [length, L, 2, H, D]
    (from the device pools, or from `pools`, e.g. `cache.host_layer`)."""
    pools = pools or cache.layer
    pages = torch.as_tensor(pages, dtype=torch.int64)[:-(-length // cache.page_size)]
    per_layer = [torch.stack([pool[pages.to(pool.device)].reshape(-1, cache.num_kv_heads, cache.head_dim)[:length]
                              for pool in pools(l)], 1) for l in range(cache.num_layers)]
    return torch.stack(per_layer, 1).cpu()


def host_kv(cache, sid):
    """The host copy of a sequence, read through its host pages without touching the cache's state."""
    return gather(cache, cache.host_pages(sid), cache.synced_tokens(sid), cache.host_layer)


def device_kv(cache, sid):
    return gather(cache, cache.pages(sid), cache.device_tokens(sid))


def run_step(cache, seq_ids, new_tokens):
    """prepare + write known values; returns the metadata."""
    starts = [cache.device_tokens(s) if s in cache else 0 for s in seq_ids]
    md = cache.prepare(seq_ids, new_tokens, starts)
    md.check()
    write(cache, md, torch.cat([known_values(s, torch.arange(p, p + n)) for s, n, p in
                                zip(seq_ids, new_tokens, starts)]))
    return md


# ---- the metadata contract ---------------------------------------------------------------------------
def test_prepare_builds_metadata_and_block_table_gathers_context_in_order():
    cache = make_cache()
    md = run_step(cache, [1, 2, 3], [5, 9, 1])
    assert md.positions.tolist() == list(range(5)) + list(range(9)) + [0]
    assert md.query_starts.tolist() == [0, 5, 14, 15]
    assert md.context_lens.tolist() == [5, 9, 1]
    assert md.block_table.shape == (3, 3)
    assert md.block_table[2, 1:].tolist() == [-1, -1] and md.block_table[0, 2].item() == -1
    assert cache.used_pages() == 2 + 3 + 1 and cache.free_pages() == 16 - 6
    for b, sid in enumerate([1, 2, 3]):
        ctx = int(md.context_lens[b])
        assert torch.equal(gather(cache, md.block_table[b], ctx), known_values(sid, range(ctx)))
    # decode and a multi-token step: new tokens follow the existing KV, pages grow lazily
    md = run_step(cache, [2, 1, 3], [1, 3, 1])
    assert md.positions.tolist() == [9, 5, 6, 7, 1]
    assert md.context_lens.tolist() == [10, 8, 2]
    assert cache.used_pages() == 3 + 2 + 1
    for b, sid in enumerate([2, 1, 3]):
        ctx = int(md.context_lens[b])
        assert torch.equal(gather(cache, md.block_table[b], ctx), known_values(sid, range(ctx)))
    cache.check()


def test_layer_views_are_contiguous_pools_of_the_documented_shape():
    cache = make_cache(num_pages=5)
    for l in range(L):
        k, v = cache.layer(l)
        assert k.shape == v.shape == (5, PS, H, D) and k.is_contiguous() and v.is_contiguous()
        assert k.view(-1, H, D).data_ptr() == k.data_ptr()
    assert torch.count_nonzero(cache.layer(0)[0]) == 0  # padding slots read as zeros, never garbage


def test_prepare_rejects_inconsistent_requests():
    cache = make_cache()
    run_step(cache, [1], [5])
    with pytest.raises(ValueError, match="start at position 3 but its KV holds 5"):
        cache.prepare([1], [1], [3])
    with pytest.raises(ValueError, match="start at position 2 but its KV holds 0"):
        cache.prepare([7], [1], [2])
    with pytest.raises(ValueError, match="twice"):
        cache.prepare([1, 1], [1, 1], [5, 6])
    with pytest.raises(ValueError, match="at least one token"):
        cache.prepare([1], [0], [5])
    cache.yield_to_host([1])
    with pytest.raises(ValueError, match="restore it"):
        cache.prepare([1], [1], [5])
    cache.check()


# ---- YIELD and restore ----------------------------------------------------------------------------
def test_yield_then_restore_gives_identical_kv_on_other_pages():
    cache = make_cache(num_pages=8)
    run_step(cache, [1, 2], [6, 3])
    before = device_kv(cache, 1)
    old_pages = cache.pages(1)
    assert cache.yield_to_host([1]) == 6
    assert not cache.on_device(1) and cache.pages(1) == [] and cache.used_pages() == 1
    run_step(cache, [3], [8])           # takes the pages seq 1 gave back
    assert cache.restore([1]) == 6
    assert cache.pages(1) != old_pages
    assert torch.equal(device_kv(cache, 1), before)
    run_step(cache, [1], [3])           # and it continues where it stopped
    assert torch.equal(device_kv(cache, 1), known_values(1, range(9)))
    cache.check()


def test_sync_copies_only_new_tokens_and_host_copy_grows_in_pages():
    cache = make_cache(num_pages=32)
    run_step(cache, [1], [3])
    assert cache.sync_to_host([1]) == 3 and cache.synced_tokens(1) == 3
    assert cache.sync_to_host([1]) == 0
    for n in range(1, 60):
        run_step(cache, [1], [1])
        if n % PS == 0:
            assert cache.sync_to_host([1]) == PS
    host = cache.export(1)
    assert host.length == 62 and host.capacity == 62
    assert torch.equal(host.tokens(), known_values(1, range(62)))
    assert len(cache.host_pages(1)) == -(-62 // PS)  # whole host pages, exactly the ones the copy covers
    assert torch.equal(host_kv(cache, 1), known_values(1, range(62)))
    cache.check()


def test_yield_of_a_sequence_not_on_device_is_refused():
    cache = make_cache()
    run_step(cache, [1], [2])
    cache.yield_to_host([1])
    with pytest.raises(ValueError, match="not on device"):
        cache.yield_to_host([1])
    cache.restore([1])
    with pytest.raises(ValueError, match="already on device"):
        cache.restore([1])
    with pytest.raises(KeyError, match="sequence 9"):
        cache.sync_to_host([9])


# ---- MIGRATE --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("to_device", [True, False])
def test_export_import_between_two_caches_keeps_kv(to_device):
    src, dst = make_cache(num_pages=6), make_cache(num_pages=10)
    run_step(dst, [5], [4])              # the target already has other pages in use
    run_step(src, [1], [7])
    src.sync_to_host([1])
    run_step(src, [1], [2])              # unsynced tokens: export must not leave them behind
    before = device_kv(src, 1)
    host = src.export(1)
    assert isinstance(host, HostKV) and host.length == 9
    src.release([1])
    loaded = dst.import_(1, host, to_device=to_device)
    assert src.free_pages() == 6
    if not to_device:
        assert loaded == 0 and not dst.on_device(1)
        dst.restore([1])
    assert torch.equal(device_kv(dst, 1), before)
    run_step(dst, [1], [1])
    assert torch.equal(device_kv(dst, 1), known_values(1, range(10)))
    src.check(), dst.check()


def _pools_used(*caches):
    return [c.host_pool.used_pages() for c in caches]


@pytest.mark.parametrize("to_device", [True, False])
def test_migrate_copies_device_pages_straight_into_the_destination_and_leaves_no_host_copy(to_device):
    """MIGRATE of a device-resident sequence with no host copy: its tokens go from the source's device pages into
    the destination's device pages (or, to_device=False, into its host copy only), and no host copy is left at
    either end unless the destination is to keep one."""
    src, dst = make_cache(num_pages=6), make_cache(num_pages=10)
    run_step(dst, [5], [4])
    run_step(src, [1], [9])
    before = device_kv(src, 1)
    copied = migrate(src, dst, 1, to_device=to_device, host_copy=not to_device)
    assert 1 not in src and src.free_pages() == 6
    assert (copied.source, copied.target) == ("device", "device" if to_device else "host")
    assert copied.transfer_bytes == 9 * src.bytes_per_token and copied.local_bytes == 0
    if to_device:
        assert dst.on_device(1) and dst.synced_tokens(1) == 0  # no host copy anywhere
        assert _pools_used(src, dst) == [0, 0]
        assert torch.equal(device_kv(dst, 1), before)
    else:
        assert not dst.on_device(1) and torch.equal(host_kv(dst, 1), before)
    src.check(), dst.check()


def test_migrate_within_one_host_pool_hands_the_host_copy_over():
    """Two caches of one node share its host pool: a sequence that migrates between them keeps its host copy where
    it is (its pages change hands, no byte moves); only the device pages are copied."""
    pool = HostPool(L, 2, PS, H, D, torch.float32, pages=4)
    src, dst = (PagedKVCache(L, H, D, page_size=PS, num_pages=8, host_pool=pool) for _ in range(2))
    run_step(src, [1], [6])
    src.sync_to_host([1])
    run_step(src, [1], [3])  # 9 tokens on device, the first 6 on host
    pages, before = src.host_pages(1), device_kv(src, 1)
    copied = migrate(src, dst, 1, to_device=True, host_copy=True)
    assert copied.transfer_bytes == 9 * src.bytes_per_token and copied.local_bytes == 0
    assert copied.handed_over == 6 and dst.host_pages(1) == pages and dst.synced_tokens(1) == 6
    assert torch.equal(device_kv(dst, 1), before) and torch.equal(host_kv(dst, 1), before[:6])
    assert pool.used_pages() == 2
    # back to the first cache as a host copy only: nothing moves at all
    dst.yield_to_host([1])
    copied = migrate(dst, src, 1, to_device=False, host_copy=True)
    assert copied.transfer_bytes == copied.local_bytes == 0
    assert src.host_pages(1)[:2] == pages and len(src.host_pages(1)) == 3  # the copy grew by the yield, in place
    assert torch.equal(host_kv(src, 1), before) and pool.used_pages() == 3
    # and without its host copy (PD-disaggregation's decode side): restored, then the copy goes back to the pool
    copied = migrate(src, dst, 1, to_device=True, host_copy=False)
    assert copied.transfer_bytes == 9 * src.bytes_per_token and (copied.source, copied.target) == ("host", "device")
    assert dst.synced_tokens(1) == 0 and pool.used_pages() == 0 and torch.equal(device_kv(dst, 1), before)
    src.check(), dst.check()


def test_migrate_from_a_host_copy_to_another_pool_keeps_one_there_when_asked():
    src, dst = make_cache(num_pages=6), make_cache(num_pages=10)
    run_step(src, [1], [7])
    before = device_kv(src, 1)
    src.yield_to_host([1])
    copied = migrate(src, dst, 1, to_device=True, host_copy=True)  # another node: on device, its copy made again
    assert (copied.source, copied.target) == ("host", "device")
    assert copied.transfer_bytes == copied.local_bytes == 7 * src.bytes_per_token
    assert dst.on_device(1) and dst.synced_tokens(1) == 7 and _pools_used(src, dst) == [0, 2]
    assert torch.equal(device_kv(dst, 1), before) and torch.equal(host_kv(dst, 1), before)
    src.check(), dst.check()


def test_host_pool_refuses_to_grow_past_its_budget_and_changes_nothing():
    cache = make_cache(num_pages=16, host_pages=2)
    cache.host_pool.budget_pages = 5
    run_step(cache, [1, 2], [9, 8])  # 3 + 2 pages
    cache.yield_to_host([1])
    assert cache.host_pool.capacity_pages() == 4  # doubled
    cache.yield_to_host([2])
    assert cache.host_pool.capacity_pages() == 5  # grown to its budget, not past it
    run_step(cache, [3], [1])
    with pytest.raises(HostMemoryFullError, match=r"needs 1 more host pages .* budget of 5 pages"):
        cache.yield_to_host([3])
    assert cache.on_device(3) and cache.synced_tokens(3) == 0 and cache.host_pool.capacity_pages() == 5
    cache.check()


def test_import_rejects_wrong_shapes_dtypes_and_duplicates():
    cache = make_cache()
    good = HostKV(known_values(1, range(3)), 3)
    cache.import_(1, good)
    with pytest.raises(ValueError, match="already has KV"):
        cache.import_(1, good)
    with pytest.raises(ValueError, match=r"rows are \(2, 2, 3, 3\)"):
        cache.import_(2, HostKV(torch.zeros(3, L, 2, 3, D), 3))
    with pytest.raises(ValueError, match="bfloat16"):
        cache.import_(2, HostKV(good.kv.to(torch.bfloat16), 3))
    with pytest.raises(ValueError, match="length 4"):
        cache.import_(2, HostKV(good.kv, 4))
    assert cache.seq_ids() == [1]
    cache.check()


# ---- eviction and release ------------------------------------------------------------------------------
def test_host_copies_name_each_copy_and_tell_a_retaken_sequence_from_one_that_stayed():
    cache = make_cache(num_pages=16)
    run_step(cache, [1, 2, 3], [5, 2, 3])
    assert cache.host_copies() == {}
    cache.sync_to_host([1, 3])
    copies = cache.host_copies()
    assert {sid: entry[1:] for sid, entry in copies.items()} == {1: (5, 2), 3: (3, 1)}  # synced tokens, host pages
    assert cache.host_copies()[1][0] is copies[1][0]  # the same sequence: the same record
    cache.release([1])
    run_step(cache, [1], [5])
    cache.sync_to_host([1])
    again = cache.host_copies()
    assert again[1][1:] == (5, 2) and again[1][0] is not copies[1][0]  # taken again: another record
    cache.check()


def test_evict_frees_everything_and_the_sequence_is_recomputed_from_zero():
    cache = make_cache(num_pages=6)
    run_step(cache, [1, 2], [9, 2])
    cache.sync_to_host([1])
    cache.evict([1])
    assert 1 not in cache and cache.used_pages() == 1
    with pytest.raises(KeyError):
        cache.export(1)
    run_step(cache, [1], [11])           # recompute prompt + generated tokens
    assert torch.equal(device_kv(cache, 1), known_values(1, range(11)))
    cache.yield_to_host([2])
    cache.release([1, 2])
    assert cache.seq_ids() == [] and cache.free_pages() == 6
    with pytest.raises(KeyError):
        cache.release([2])
    cache.check()


# ---- the budget ------------------------------------------------------------------------------------------
def test_cache_full_error_names_the_numbers_and_leaves_state_unchanged():
    cache = make_cache(num_pages=4)
    run_step(cache, [1], [9])            # 3 pages
    with pytest.raises(CacheFullError, match=r"needs 2 more pages of 4 tokens but only 1 of 4 are free") as err:
        cache.prepare([1, 2], [4, 4], [9, 0])
    assert (err.value.needed, err.value.free) == (2, 1)
    assert cache.used_pages() == 3 and 2 not in cache and cache.device_tokens(1) == 9
    cache.check()
    cache.yield_to_host([1])
    run_step(cache, [2], [5])
    with pytest.raises(CacheFullError, match="restoring 1 sequences"):
        cache.restore([1])
    assert not cache.on_device(1) and cache.used_pages() == 2
    other = make_cache(num_pages=2)
    with pytest.raises(CacheFullError, match="importing sequence 1"):
        other.import_(1, cache.export(1), to_device=True)
    assert 1 not in other
    cache.check(), other.check()


def test_can_fit_counts_new_resident_and_host_only_sequences():
    cache = make_cache(num_pages=5)
    run_step(cache, [1], [3])            # 1 page, 1 free slot
    assert cache.pages_needed({1: 1}) == 0 and cache.pages_needed({1: 2}) == 1
    assert cache.pages_needed({7: 9}) == 3
    cache.yield_to_host([1])
    assert cache.pages_needed({1: 1}) == 1  # restoring counts
    assert cache.can_fit({1: 1, 7: 16}) and not cache.can_fit({1: 2, 7: 16})


def test_reserve_claims_pages_ahead_so_prepare_cannot_fail():
    cache = make_cache(num_pages=4)
    run_step(cache, [1], [2])
    cache.reserve({1: 8})
    assert len(cache.pages(1)) == 3
    run_step(cache, [2], [4])
    run_step(cache, [1], [8])            # fits in the reservation although the pool is full
    assert cache.free_pages() == 0
    with pytest.raises(CacheFullError):
        cache.reserve({1: 3})
    assert torch.equal(device_kv(cache, 1), known_values(1, range(10)))
    cache.check()


def test_from_budget_arithmetic():
    per_page = 2 * L * PS * H * D * 4
    assert PagedKVCache.page_bytes(L, H, D, PS, torch.float32) == per_page
    for budget, pages in [(per_page, 1), (7 * per_page, 7), (7 * per_page - 1, 6)]:
        c = PagedKVCache.from_budget(L, H, D, page_size=PS, budget_bytes=budget, dtype=torch.float32)
        assert c.num_pages == pages
        assert c.layer(0)[0].numel() * 4 * 2 * L <= budget
    assert PagedKVCache.from_budget(L, H, D, page_size=PS, budget_bytes=per_page,
                                    dtype=torch.bfloat16).num_pages == 2
    with pytest.raises(ValueError, match=rf"{per_page - 1} bytes holds no page.*takes {per_page} bytes"):
        PagedKVCache.from_budget(L, H, D, page_size=PS, budget_bytes=per_page - 1)
    assert make_cache().bytes_per_token == per_page // PS


def test_check_catches_a_page_owned_twice():
    cache = make_cache()
    run_step(cache, [1, 2], [1, 1])
    cache._seqs[2].pages[0] = cache._seqs[1].pages[0]
    with pytest.raises(InvariantError, match="owned twice"):
        cache.check()


# ---- random operation sequences against a reference -------------------------------------------------
class CacheMachine(RuleBasedStateMachine):
    """Two caches (two devices) and a reference: each sequence's full KV, and which cache holds it."""

    def __init__(self):
        super().__init__()
        # host pools of 2 pages: they must grow while sequences live in them
        self.caches = [make_cache(num_pages=9, page_size=3, host_pages=2),
                       make_cache(num_pages=6, page_size=3, host_pages=2)]
        self.ref: dict[int, tuple[int, torch.Tensor]] = {}
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    def _pick(self, data, c, pred=lambda cache, sid: True):
        ids = [s for s, (ci, _) in self.ref.items() if ci == c and pred(self.caches[c], s)]
        return data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=4)) if ids else []

    @rule(data=st.data(), c=st.integers(0, 1), new=st.integers(0, 2))
    def step(self, data, c, new):
        cache = self.caches[c]
        ids = self._pick(data, c, lambda cc, s: cc.on_device(s)) + list(range(self.next_id, self.next_id + new))
        if not ids:
            return
        ids = data.draw(st.permutations(ids))
        counts = [data.draw(st.integers(1, 7)) for _ in ids]
        starts = [cache.device_tokens(s) if s in cache else 0 for s in ids]
        used = cache.used_pages()
        if not cache.can_fit(dict(zip(ids, counts))):
            with pytest.raises(CacheFullError):
                cache.prepare(ids, counts, starts)
            assert cache.used_pages() == used
            return
        self.next_id += new
        md = cache.prepare(ids, counts, starts)
        md.check()
        values = torch.randn(sum(counts), L, 2, H, D, generator=self.gen)
        write(cache, md, values)
        for b, (sid, chunk) in enumerate(zip(ids, values.split(counts))):
            old = self.ref[sid][1] if sid in self.ref else values[:0]
            self.ref[sid] = (c, torch.cat([old, chunk]))
            assert torch.equal(gather(cache, md.block_table[b], int(md.context_lens[b])), self.ref[sid][1])

    @rule(data=st.data(), c=st.integers(0, 1))
    def host_step(self, data, c):
        """A host-resident step: new tokens written straight into the host pool (what CPU attention does,
        and what a staged step's append does), the pool growing as needed."""
        cache = self.caches[c]
        ids = self._pick(data, c, lambda cc, s: not cc.on_device(s))
        if not ids:
            return
        counts = [data.draw(st.integers(1, 4)) for _ in ids]
        md = cache.prepare_host(ids, counts, [cache.synced_tokens(s) for s in ids])
        md.check()
        values = torch.randn(sum(counts), L, 2, H, D, generator=self.gen)
        write(cache, md, values, cache.host_layer)
        cache.host_advance(ids)
        for sid, chunk in zip(ids, values.split(counts)):
            self.ref[sid] = (c, torch.cat([self.ref[sid][1], chunk]))

    @rule(data=st.data(), c=st.integers(0, 1))
    def sync(self, data, c):
        self.caches[c].sync_to_host(self._pick(data, c))

    @rule(data=st.data(), c=st.integers(0, 1))
    def yield_(self, data, c):
        self.caches[c].yield_to_host(self._pick(data, c, lambda cc, s: cc.on_device(s)))

    @rule(data=st.data(), c=st.integers(0, 1))
    def restore(self, data, c):
        cache = self.caches[c]
        ids = self._pick(data, c, lambda cc, s: not cc.on_device(s))
        if cache.can_fit({s: 0 for s in ids}):
            cache.restore(ids)
        else:
            with pytest.raises(CacheFullError):
                cache.restore(ids)

    @rule(data=st.data(), c=st.integers(0, 1), to_device=st.booleans())
    def migrate(self, data, c, to_device):
        ids = self._pick(data, c)[:1]
        if not ids:
            return
        src, dst = self.caches[c], self.caches[1 - c]
        host = src.export(ids[0])
        if to_device and not dst.can_fit({ids[0]: host.length}):
            with pytest.raises(CacheFullError):
                dst.import_(ids[0], host, to_device=True)
            return
        dst.import_(ids[0], host, to_device=to_device)
        src.release(ids)
        self.ref[ids[0]] = (1 - c, self.ref[ids[0]][1])

    @rule(data=st.data(), c=st.integers(0, 1), to_device=st.booleans(), keep=st.booleans())
    def migrate_straight(self, data, c, to_device, keep):
        """MIGRATE as the executor performs it: from device pages (or the host copy) straight to the other
        cache's device pages (or host copy), a host copy kept there only when asked."""
        ids = self._pick(data, c)[:1]
        if not ids:
            return
        src, dst = self.caches[c], self.caches[1 - c]
        n = src.device_tokens(ids[0]) if src.on_device(ids[0]) else src.synced_tokens(ids[0])
        if to_device and not dst.can_fit({ids[0]: n}):
            with pytest.raises(CacheFullError):
                migrate(src, dst, ids[0], to_device=True, host_copy=keep)
            assert ids[0] in src and ids[0] not in dst
            return
        had = src.synced_tokens(ids[0])
        migrate(src, dst, ids[0], to_device=to_device, host_copy=keep or not to_device)
        assert ids[0] not in src and dst.on_device(ids[0]) == to_device
        assert dst.synced_tokens(ids[0]) == (had if keep else 0) if to_device else n  # the copy it had, or none
        self.ref[ids[0]] = (1 - c, self.ref[ids[0]][1])

    @rule(data=st.data(), c=st.integers(0, 1), finished=st.booleans())
    def drop(self, data, c, finished):
        ids = self._pick(data, c)
        (self.caches[c].release if finished else self.caches[c].evict)(ids)
        for sid in ids:
            del self.ref[sid]

    @invariant()
    def kv_matches_reference(self):
        for cache in self.caches:
            cache.check()
            assert cache.used_pages() + cache.free_pages() == cache.num_pages
            assert sum(len(cache.pages(s)) for s in cache.seq_ids()) == cache.used_pages()
        for sid, (c, kv) in self.ref.items():
            cache = self.caches[c]
            assert sid in cache and sid not in self.caches[1 - c]
            synced = cache.synced_tokens(sid)
            if synced:
                assert torch.equal(host_kv(cache, sid), kv[:synced])
            if cache.on_device(sid):
                assert cache.device_tokens(sid) == kv.shape[0]
                assert torch.equal(device_kv(cache, sid), kv)
            else:
                assert synced == kv.shape[0]


class SharedPoolMachine(CacheMachine):
    """The same, with both caches on one node: one host pool, which migrations hand host copies over in."""

    def __init__(self):
        super().__init__()
        pool = HostPool(L, 2, 3, H, D, torch.float32, pages=2)
        self.caches = [PagedKVCache(L, H, D, page_size=3, num_pages=n, host_pool=pool) for n in (9, 6)]


TestCacheMachine = CacheMachine.TestCase
TestSharedPoolMachine = SharedPoolMachine.TestCase
for _case in (TestCacheMachine, TestSharedPoolMachine):
    _case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


# ---- CUDA ----------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_restore_on_cuda_equals_cpu():
    caches = {d: make_cache(num_pages=8, device=d) for d in ("cpu", "cuda")}
    for cache in caches.values():
        run_step(cache, [1, 2], [6, 3])
        cache.yield_to_host([1])
        run_step(cache, [3], [5])
        cache.restore([1])
        run_step(cache, [1], [2])
        cache.check()
    assert caches["cuda"].host_layer(0)[0].is_pinned()
    for sid in (1, 2, 3):
        assert torch.equal(device_kv(caches["cuda"], sid), device_kv(caches["cpu"], sid))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_migrate_cpu_cuda_cpu_round_trip(dtype):
    cpu, gpu, back = (make_cache(num_pages=8, device=d, dtype=dtype) for d in ("cpu", "cuda", "cpu"))
    run_step(cpu, [1], [10])
    before = device_kv(cpu, 1)
    gpu.import_(1, cpu.export(1), to_device=True)
    cpu.release([1])
    assert gpu.host_layer(0)[0].is_pinned()  # an unpinned host copy lands in the pinned pool
    run_step(gpu, [1], [3])
    back.import_(1, gpu.export(1), to_device=True)
    gpu.release([1])
    assert torch.equal(device_kv(back, 1)[:10], before)
    assert torch.equal(device_kv(back, 1), known_values(1, range(13)).to(dtype))
    gpu.check(), back.check()
