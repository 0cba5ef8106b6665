"""A workload as arrays, and its construction from the Hydra ``workload`` config node.

A batch job has every request present at t=0, so a workload is two length arrays, plus two columns that say
which prompts share a prefix (batchgen.workload.prefixes). It is a struct of
numpy arrays rather than a list of request objects because it must scale to millions of requests: building,
copying and slicing it stays vectorised.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.progress import bar

from .distributions import Distribution, make_distribution
from .prefix_tree import PrefixTree
from .prefixes import PrefixSpec, check_prefix_columns, prefill_tokens_distinct, prefill_tokens_submitted
from .traces import SHIPPED_DIR, load_trace, shipped_traces


def _as_lengths(name: str, values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    array = array.astype(np.int64)  # always a copy, so freezing it below cannot touch the caller's array
    if array.size and array.min() < 1:
        bad = int(np.argmax(array < 1))
        raise ValueError(f"{name} must be >= 1 everywhere, got {array[bad]} at index {bad}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous; identity equality and hashing instead
class Workload:
    """Every request of a batch job: prompt lengths and true output lengths (tokens until EOS).

    ``output_lens`` is ground truth for the simulator; a policy must never read it, since a real engine only
    learns a sequence's length when it stops. The arrays are read-only copies, so a Workload can be shared
    between runs without one run changing another's input. An empty workload is allowed (a shard of a
    small job may get no requests). ``prefix_group`` and ``prefix_len`` (None: no sharing) say which
    sequences share how many leading prompt tokens (batchgen.workload.prefixes); ``prefix_tree`` (None: one level)
    which groups' prefixes begin with another group's (batchgen.workload.prefix_tree).
    """

    name: str
    input_lens: np.ndarray
    output_lens: np.ndarray
    prefix_group: np.ndarray | None = None
    prefix_len: np.ndarray | None = None
    prefix_tree: PrefixTree | None = None

    def __post_init__(self) -> None:
        inputs = _as_lengths("input_lens", self.input_lens)
        outputs = _as_lengths("output_lens", self.output_lens)
        if inputs.shape != outputs.shape:
            raise ValueError(
                f"input_lens and output_lens must have the same length, got {inputs.size} and {outputs.size}"
            )
        group, shared = check_prefix_columns(inputs, self.prefix_group, self.prefix_len)
        if self.prefix_tree is not None:
            self.prefix_tree.check_members(group, shared)
        object.__setattr__(self, "input_lens", inputs)
        object.__setattr__(self, "output_lens", outputs)
        object.__setattr__(self, "prefix_group", group)
        object.__setattr__(self, "prefix_len", shared)

    def __len__(self) -> int:
        return int(self.input_lens.size)

    def prefill_tokens(self) -> dict[str, int]:
        """Prompt tokens as submitted, and with each group's shared prefix counted once."""
        return {"prefill_tokens_submitted": prefill_tokens_submitted(self.input_lens),
                "prefill_tokens_distinct": prefill_tokens_distinct(self.input_lens, self.prefix_group,
                                                                   self.prefix_len, self.prefix_tree)}

    def tree(self) -> PrefixTree:
        """The groups' prefix tree: the one given, or every group on its own."""
        return self.prefix_tree or PrefixTree.flat(self.prefix_group, self.prefix_len)

    def summary(self) -> dict[str, Any]:
        """Headline statistics, flat so they drop straight into a results table or a log line.

        The output P99/P95 ratio is included because it is the tail shape that drives straggler losses.
        Statistics of an empty workload are None.
        """
        out: dict[str, Any] = {"name": self.name, "count": len(self)}
        for side, lens in (("input", self.input_lens), ("output", self.output_lens)):
            empty = lens.size == 0
            out[f"{side}_mean"] = None if empty else float(lens.mean())
            for label, q in (("median", 50), ("p95", 95), ("p99", 99)):
                out[f"{side}_{label}"] = None if empty else float(np.percentile(lens, q))
            out[f"{side}_max"] = None if empty else int(lens.max())
        out["output_p99_over_p95"] = None if len(self) == 0 else out["output_p99"] / out["output_p95"]
        return out


VALID_KEYS = ("name", "num_sequences", "input", "output", "trace", "max_input", "max_output", "prefix")


def _optional_positive_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"workload.{key} must be a positive integer, got {value!r}")
    return int(value)


def _plain(cfg: Any) -> Any:
    """OmegaConf nodes -> plain containers, so the rest of this module only sees dicts and scalars."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra, but plain dicts need neither
        return cfg
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


@dataclass(frozen=True)
class WorkloadSpec:
    """A validated ``workload`` config node: either a trace file or a pair of length distributions.

    Validation happens here, before anything is sampled or read, so a typo in a YAML file fails in
    milliseconds with a message naming the key, not minutes into a run.
    """

    name: str
    num_sequences: int | None
    input: Distribution | None = None
    output: Distribution | None = None
    trace: str | None = None
    max_input: int | None = None
    max_output: int | None = None
    prefix: PrefixSpec | None = None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> WorkloadSpec:
        cfg = _plain(cfg)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"the workload config must be a mapping, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - set(VALID_KEYS))
        if unknown:
            raise ValueError(f"unknown workload key(s) {unknown}; valid keys: {', '.join(VALID_KEYS)}")

        num_sequences = _optional_positive_int("num_sequences", cfg.get("num_sequences"))
        clips = {k: _optional_positive_int(k, cfg.get(k)) for k in ("max_input", "max_output")}
        trace = cfg.get("trace")
        if trace is not None:
            if cfg.get("prefix") is not None:
                raise ValueError(f"workload.trace={trace} with workload.prefix: a trace gives its own lengths; "
                                 "shared prefixes are drawn for 'input'/'output' workloads only")
            if cfg.get("input") is not None or cfg.get("output") is not None:
                raise ValueError(f"workload.trace={trace} with workload {cfg.get('name')!r}, which draws lengths from "
                                 "'input'/'output' distributions: give one or the other, not both (a trace workload: "
                                 f"workload=azure_conv workload.trace={trace})")
            if not isinstance(trace, (str, Path)) or not str(trace):
                raise ValueError(f"workload.trace must be a file name, got {trace!r}")
            name = cfg.get("name") or Path(trace).stem
            return cls(name=str(name), num_sequences=num_sequences, trace=str(trace), **clips)

        missing = [k for k in ("input", "output") if cfg.get(k) is None]
        if missing:
            raise ValueError(f"workload: missing {missing}; a workload needs 'trace' or both 'input' and 'output'")
        if num_sequences is None:
            raise ValueError("workload.num_sequences must be a positive integer, got None")
        dists = {}
        for side in ("input", "output"):
            try:
                dists[side] = make_distribution(cfg[side])
            except ValueError as e:
                raise ValueError(f"workload.{side}: {e}") from None
        prefix = None if cfg.get("prefix") is None else PrefixSpec.from_config(cfg["prefix"])
        if prefix is not None:
            prefix.group_ids(num_sequences)  # a size that does not fit fails now, before anything is drawn
        return cls(name=str(cfg.get("name") or "workload"), num_sequences=num_sequences, **dists, **clips,
                   prefix=prefix)

    def build(self, seed: int, base_dir: Path | None = None, progress: Any = "auto") -> Workload:
        """Draw (or read) the arrays. Same seed, same arrays, with or without a progress bar (`progress`: auto,
        True, False; see batchgen.progress: a bar shows only once sampling has taken a second or so).

        Input, output and trace-row sampling each get their own stream spawned from the seed, so changing
        the input distribution does not reshuffle the output lengths: two configs that differ in one side
        only stay comparable request by request. Shared prefixes draw from two more streams (prefix lengths, the
        order of the sequences), spawned after those three, so a workload without them draws what it always did.
        """
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        input_rng, output_rng, row_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
        if self.prefix is not None:
            return self._build_shared(seed, input_rng, output_rng, progress)
        if self.trace is not None:
            inputs, outputs = self._read_trace(row_rng, base_dir)
        else:
            assert self.input is not None and self.output is not None and self.num_sequences is not None
            n = self.num_sequences
            with bar(2 * n, f"workload {self.name}", unit="seq", setting=progress, unit_scale=True) as shown:
                counter = None if shown.disable else shown
                inputs = self.input.sample(n, input_rng, progress=counter)
                outputs = self.output.sample(n, output_rng, progress=counter)

        if self.max_input is not None:
            inputs = np.minimum(inputs, self.max_input)
        if self.max_output is not None:
            outputs = np.minimum(outputs, self.max_output)
        return Workload(self.name, inputs, outputs)

    def _build_shared(self, seed: int, input_rng, output_rng, progress: Any) -> Workload:
        """A workload whose groups share a prefix: a shared prefix clipped by max_input stays the group's."""
        assert self.input is not None and self.output is not None and self.num_sequences is not None
        prefix_rng, order_rng, outer_rng = (np.random.default_rng(s)
                                            for s in np.random.SeedSequence(seed).spawn(6)[3:])
        n = self.num_sequences
        with bar(2 * n, f"workload {self.name}", unit="seq", setting=progress, unit_scale=True) as shown:
            counter = None if shown.disable else shown
            inputs, group, shared, order, tree = self.prefix.draw(n, self.input, input_rng, prefix_rng, order_rng,
                                                                  progress=counter, outer_rng=outer_rng)
            outputs = self.output.sample(n, output_rng, progress=counter)
        if self.max_input is not None:
            inputs, shared = np.minimum(inputs, self.max_input), np.minimum(shared, self.max_input)
            if tree is not None:  # an outer prefix stays shorter than the groups' own
                outer = tree.parent < 0
                length = np.where(outer, np.minimum(tree.length, self.max_input - 1),
                                  np.minimum(tree.length, self.max_input))
                tree = PrefixTree(tree.parent, np.maximum(length, 1))
        if self.max_output is not None:
            outputs = np.minimum(outputs, self.max_output)
        return Workload(self.name, inputs[order], outputs[order], group[order], shared[order], tree)

    def _read_trace(self, rng: np.random.Generator, base_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
        path = resolve_trace(self.trace, base_dir)
        inputs, outputs = load_trace(path)
        rows, n = inputs.size, self.num_sequences
        if n is None or n == rows:
            return inputs, outputs
        if n < rows:
            return inputs[:n], outputs[:n]
        warnings.warn(
            f"workload {self.name!r}: num_sequences={n} exceeds the {rows} rows of {path}; "
            f"sampling rows with replacement",
            stacklevel=3,
        )
        picks = rng.integers(0, rows, size=n)
        return inputs[picks], outputs[picks]


def resolve_trace(trace: str | Path, base_dir: Path | None = None) -> Path:
    """Find a trace file: as given if absolute; else under base_dir (default: cwd); else shipped with batchgen.

    ``base_dir`` exists because Hydra apps may run from a different directory than the user typed the
    command in; the caller passes the original working directory.
    """
    trace = Path(trace)
    candidates = [trace] if trace.is_absolute() else [Path(base_dir or Path.cwd()) / trace, SHIPPED_DIR / trace]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    shipped = ", ".join(shipped_traces()) or "none"
    raise FileNotFoundError(f"workload trace {str(trace)!r} not found; tried: {tried}. Shipped traces: {shipped}")


def build_workload(cfg: Mapping[str, Any], seed: int, base_dir: Path | None = None,
                   progress: Any = "auto") -> Workload:
    """Build a Workload from the Hydra ``workload`` node (see conf/workload/*.yaml); `progress`: a bar while
    sampling (auto: when stderr is a terminal, or BATCHGEN_PROGRESS says so)."""
    return WorkloadSpec.from_config(cfg).build(seed, base_dir, progress)
