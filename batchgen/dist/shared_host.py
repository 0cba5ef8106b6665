"""Host copies that outlive their process: a rank's host KV pool in a named shared-memory file (issue 9, part 4).

A `backend=dist` rank keeps every sequence's host copy in its cache's host pool (`PagedKVCache._host`). When the
process dies, an anonymous pool dies with it, and a lost rank's sequences can only be recomputed. Here the pool
is a file in /dev/shm instead (`SharedHostFiles.alloc`, the cache's `host_alloc` hook), so a survivor on the
same machine can read a dead rank's host copies and adopt them (restore.restore_lost) when the latency model
says restoring is cheaper than recomputing.

Files, per run (`run_id`) and launch rank r:

- `batchgen-<run id>-r<r>-<n>`: the n-th host pool of that process ([layers, planes, host pages, page size,
  kv heads, head dim] in the cache's dtype, laid out as the tensor). The pool doubles when full: the cache
  copies the old pool into a new file (n + 1); the old file stays until the next index names the new one (a
  process killed in between leaves an index whose file still exists), then it is removed.
- `batchgen-<run id>-r<r>.idx`: the index of its complete host copies (`publish`), replaced atomically (write
  to a temporary name, then rename): one JSON line {"file", "shape", "dtype", "host": hostname, "page_size",
  "seqs": count}, then int64 arrays: ids, synced tokens, host-page counts, and every sequence's host pages
  covering its synced tokens, concatenated (binary: a JSON list of the same pages took 5-10 times longer).
  A sequence's first `synced` tokens in those pages never change while it is held (syncs rewrite a page with
  the same values; new tokens go past `synced`), so an entry stays true until the sequence is released and its
  pages handed to another. The worker publishes before a boundary's releases (without the released
  sequences, only when one of them is in the published index) and after its KV ops (`RankWorker._kv`), and
  each survivor after a recovery settled its cache: a reader never follows an entry whose pages were reused.

Cost per boundary: one pass over the cache's sequences comparing (sequence object, synced, host pages held)
with the last index (a sequence's pages only grow while it is held; a released and re-added one is a new
object) and, only when something changed, one write and rename (`publish` returns whether it wrote); a
sequence's page array is rebuilt only when its pages change. `python benchmarks/shared_host_cost.py` measures
a call's cost (benchmarks/results/shared_host_cost.md): tens of microseconds to a few milliseconds per boundary,
and end to end a BCT within run-to-run noise of the anonymous pool's: hence on by default.

Files are removed by their process at the end (`close`), by rank 0 once it has read a lost rank's
(`remove_rank`), by the launcher's parent after the run whatever happened (`sweep`), and, for a run killed
whole (its launcher too), by the next run's launcher on this machine (`sweep_orphans`).

Not done: the pool is pageable memory even on CUDA (an anonymous pool is pinned there; the cache's copies go
through pinned staging buffers either way); multi-machine runs restore only from files on rank 0's machine;
under torchrun the files of a killed run stay until the next run on the machine finds its agent gone
(`sweep_orphans`; no launcher parent sweeps them at the end).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field

import numpy as np
import torch

from batchgen.exec.kv_cache import HostKV, PagedKVCache

SHM_DIR = "/dev/shm"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shared host index")
    return dtype


def pool_path(run_id: str, rank: int, n: int, root: str = SHM_DIR) -> str:
    return os.path.join(root, f"batchgen-{run_id}-r{rank}-{n}")


def index_path(run_id: str, rank: int, root: str = SHM_DIR) -> str:
    return os.path.join(root, f"batchgen-{run_id}-r{rank}.idx")


def sweep(run_id: str, root: str = SHM_DIR) -> int:
    """Remove every file of the run (what a killed process left); returns how many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(root, f"batchgen-{glob.escape(run_id)}-*")):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


_LAUNCHED = re.compile(r"batchgen-(\d+)-[0-9a-f]{8}-")  # a one-machine run's files: its launcher's pid first


def sweep_orphans(root: str = SHM_DIR) -> int:
    """Remove the files of one-machine runs whose launcher is gone: a run killed whole (SIGKILL, the OOM killer)
    never reached its `sweep`, and each rerun of a killed batch job would leave its pools in memory. A run is
    gone when its launcher's pid is not alive here and none of its indexes names another host (a container
    sharing this /dev/shm, whose pids this one cannot see). Returns how many files were removed."""
    runs: dict[tuple[str, int], list[str]] = {}  # (run id, its launcher's pid) -> its files
    for path in glob.glob(os.path.join(root, "batchgen-*")):
        m = _LAUNCHED.match(os.path.basename(path))
        if m:
            runs.setdefault((m.group(0), int(m.group(1))), []).append(path)
    removed = 0
    for (_, pid), paths in runs.items():
        if _alive(pid) or any(_elsewhere(p) for p in paths if p.endswith(".idx")):
            continue
        for path in paths:
            _unlink(path)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _elsewhere(index: str) -> bool:
    """The index was written on another host (or cannot be read: then it is left alone too)."""
    try:
        with open(index, "rb") as f:
            return json.loads(f.readline()).get("host") != socket.gethostname()
    except (OSError, ValueError, AttributeError):
        return True


@dataclass
class SharedHostFiles:
    """One process's host pools and index (rank: its launch rank, kept over recoveries)."""

    run_id: str
    rank: int
    root: str = SHM_DIR
    current: str | None = None        # the pool file the cache uses now
    shape: tuple = ()
    dtype: torch.dtype | None = None
    _n: int = 0
    _retired: list = field(default_factory=list)  # older pool files, removed once the index names `current`
    _published: dict | None = None    # the last index's entries, {id: (its _Seq, synced, host pages held)}
    _published_file: str | None = None
    _arrays: dict = field(default_factory=dict)  # id -> (its _Seq, its pages array) of the last index written
    fallback: str | None = None       # why the last pool is in ordinary memory (no room in root), if it is
    writes: int = 0                   # index files written
    publish_s: float = 0.0            # seconds inside publish (entries built, and written when they changed)
    index_kept: bool = False          # handed over to rank 0 (`hand_over`): close leaves the files

    def __post_init__(self):
        if not self.run_id or os.sep in self.run_id:
            raise ValueError(f"run id {self.run_id!r}: give a non-empty name without {os.sep!r}")
        if not os.path.isdir(self.root):
            raise ValueError(f"shared host copies need {self.root} (a tmpfs); it does not exist here: set "
                             "backend.shared_host_copies=false")

    @property
    def index(self) -> str:
        return index_path(self.run_id, self.rank, self.root)

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled pool tensor mapped onto a new file (the cache's `host_alloc`). The file's memory is
        reserved up front (posix_fallocate: what torch.zeros touches anyway), so a full tmpfs is an error here,
        not a SIGBUS at the first write into a hole. When it is full, the pool falls back to ordinary memory
        (`fallback` says why; the index then names no file: this rank's copies are recomputed if it dies)."""
        path = pool_path(self.run_id, self.rank, self._n, self.root)
        self._n += 1
        numel = math.prod(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self.current is not None:
            self._retired.append(self.current)
        self.current, self.shape, self.dtype = None, tuple(shape), dtype
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # never another run's (or pool's) file
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            _unlink(path)
            self.fallback = f"{path}: {e.strerror or e} ({nbytes:,} bytes)"
            return torch.zeros(*shape, dtype=dtype)
        self.current = path
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)

    @staticmethod
    def entries(cache: PagedKVCache, skip=()) -> dict:
        """`PagedKVCache.host_copies` less `skip`: what decides whether the index changed."""
        skip = set(skip)
        return {sid: entry for sid, entry in cache.host_copies().items() if sid not in skip}

    def _same(self, entries: dict) -> bool:
        old = self._published
        return (old is not None and self.current == self._published_file and len(old) == len(entries)
                and all((o := old.get(sid)) is not None and o[0] is e[0] and o[1:] == e[1:]
                        for sid, e in entries.items()))

    def publish(self, cache: PagedKVCache, skip=()) -> bool:
        """Write the index of the cache's host copies (less `skip`: sequences about to be released), atomically;
        nothing when it is what the last index said. Retired pool files go once the index names the current
        one. Returns whether it wrote."""
        import time
        t0 = time.perf_counter()
        entries = self.entries(cache, skip)
        wrote = False
        if not self._same(entries):
            page = cache.page_size
            n = len(entries)
            ids = np.fromiter(entries, np.int64, n)
            synced = np.fromiter((e[1] for e in entries.values()), np.int64, n)
            counts = -(-synced // page)
            pages = self._page_arrays(entries, counts.tolist())
            head = {"file": self.current, "shape": list(self.shape), "dtype": str(self.dtype),
                    "host": socket.gethostname(), "page_size": page, "seqs": n}
            tmp = self.index + ".tmp"
            with open(tmp, "wb") as f:
                f.write(json.dumps(head).encode() + b"\n")
                f.write(np.concatenate([ids, synced, counts, pages]))  # the buffer itself: no bytes copy
            os.replace(tmp, self.index)
            self._published, self._published_file = entries, self.current
            self.writes += 1
            wrote = True
        for path in self._retired:
            _unlink(path)
        self._retired.clear()
        self.publish_s += time.perf_counter() - t0
        return wrote

    def _page_arrays(self, entries: dict, counts: list[int]) -> np.ndarray:
        """Every entry's host pages covering its synced tokens, concatenated; a sequence's array is built again
        only when it is a new sequence object or covers another number of pages (its pages only grow)."""
        cached, arrays = {}, []
        for (sid, (seq, _, _)), count in zip(entries.items(), counts):
            hit = self._arrays.get(sid)
            arr = hit[1] if hit is not None and hit[0] is seq and hit[1].size == count else \
                np.array(seq.host_pages[:count], np.int64)
            cached[sid] = (seq, arr)
            arrays.append(arr)
        self._arrays = cached
        return np.concatenate(arrays) if arrays else np.empty(0, np.int64)

    def publish_before_release(self, cache: PagedKVCache, released) -> bool:
        """Before a boundary releases `released` (their host pages may go to another sequence in the same
        boundary): take them out of the index first, if it names any."""
        if self._published and any(sid in self._published for sid in released):
            return self.publish(cache, skip=released)
        return False

    def hand_over(self) -> None:
        """This process leaves the run alive (its instance was dropped by a recovery): its files stay for rank 0
        to read and remove (`remove_rank`; the launcher's `sweep` takes what is left); `close` keeps them."""
        self._retired.clear()
        self.current = self._published = self._published_file = None
        self.index_kept = True

    def close(self) -> None:
        """Remove this process's files (at the end of its run), unless it handed them over."""
        if self.index_kept:
            return
        for path in (*self._retired, self.current, self.index, self.index + ".tmp"):
            if path is not None:
                _unlink(path)
        self._retired.clear()
        self.current = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_rank(run_id: str, rank: int, root: str = SHM_DIR) -> None:
    """A lost rank's files, once read (its pool files: those its index named and any others)."""
    for path in glob.glob(os.path.join(root, f"batchgen-{glob.escape(run_id)}-r{rank}-*")) + [
            index_path(run_id, rank, root), index_path(run_id, rank, root) + ".tmp"]:
        _unlink(path)


@dataclass
class PublishedIndex:
    """A rank's published index, read back by a survivor."""

    file: str
    shape: tuple
    dtype: torch.dtype
    host: str
    page_size: int
    seqs: dict  # id -> (synced tokens, host pages)

    @classmethod
    def load(cls, path: str) -> "PublishedIndex | None":
        """None when there is no index (the rank published none, or not on this machine)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        line, _, body = data.partition(b"\n")
        head = json.loads(line)
        n = int(head["seqs"])
        arr = np.frombuffer(body, np.int64)
        ids, synced, counts = arr[:n].tolist(), arr[n:2 * n].tolist(), arr[2 * n:3 * n]
        if arr.size != 3 * n + int(counts.sum()):
            raise ValueError(f"{path}: a shared host index of {n} sequences holds {arr.size} numbers")
        ends = np.cumsum(counts).tolist()
        pages = arr[3 * n:].tolist()
        seqs = {sid: (t, pages[e - c:e]) for sid, t, c, e in zip(ids, synced, counts.tolist(), ends)}
        return cls(head["file"], tuple(head["shape"]), _dtype(head["dtype"]), head["host"], int(head["page_size"]),
                   seqs)

    def readable(self) -> bool:
        """This machine holds the pool file the index names, at full size."""
        if not self.file or self.host != socket.gethostname() or not os.path.exists(self.file):
            return False
        need = math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()
        return os.path.getsize(self.file) >= need

    def read(self, seq_id: int) -> HostKV:
        """The sequence's host copy as token-major rows (what MIGRATE carries and `PagedKVCache.import_`
        adopts), read from the pool file: one gather of its pages."""
        synced, pages = self.seqs[seq_id]
        layers, planes, capacity, page, heads, dim = self.shape
        if page != self.page_size or not pages or max(pages) >= capacity:
            raise ValueError(f"sequence {seq_id}: index pages {pages} do not fit the pool {self.shape}")
        pool = torch.from_file(self.file, shared=False, size=math.prod(self.shape), dtype=self.dtype)
        picked = pool.view(*self.shape).index_select(2, torch.tensor(pages, dtype=torch.int64))
        rows = picked.permute(2, 3, 0, 1, 4, 5).reshape(len(pages) * page, layers, planes, heads, dim)
        return HostKV(rows[:synced].clone(), synced)
