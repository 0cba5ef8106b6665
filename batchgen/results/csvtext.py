"""CSV text from whole columns: no Python string per value, since decisions.csv holds millions of ids.

A cell is a run of tokens (a number, or a 4-byte piece of a string), each followed by its separator inside the
cell (`after`: "-" and " " in "0-15 18"); cells are joined by commas and rows end with the line end. A block of
rows is rendered at once into a (tokens x words) uint32 matrix: a number's digits come from a table of every
4-digit group (the digits left of the number's first as NUL bytes), a string piece is NUL-padded, the separator
takes the last word; deleting every NUL byte then leaves the text (CSV text holds none; a NUL is refused).

The tables whose values are floats (sequences.csv, steps.csv) keep C's "%.6f": a binary float's decimal rounding
is not worth imitating; `formatted` applies one format string to a block of rows instead of one per row.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Protocol, Sequence

import numpy as np

GROUP = 10**4           # digits per word: 4
BLOCK_TOKENS = 1 << 18  # rows rendered at once: about this many tokens (a few MB of scratch per array)
BLOCK_ROWS = 1 << 16    # rows formatted at once by `formatted`
TABLE_VALUES = 1 << 22  # numbers rendered once and looked up: at most this many values (tens of MB)


@dataclass(frozen=True)
class Tokens:
    """A block of rows of one column: row r's tokens are [offsets[r], offsets[r + 1]). A token is the number
    `number` (>= 0), or the string piece `pieces[piece[i]]` at the token `text[i]` (its number then unused);
    `after` is the byte that follows a token inside its cell (0: none)."""

    offsets: np.ndarray   # int64, rows + 1, from 0
    number: np.ndarray    # int64
    after: np.ndarray     # uint8
    text: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))   # the tokens that are string pieces
    piece: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # which piece each is, in `pieces`
    pieces: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))


class Cells(Protocol):
    """One column of a CSV table."""

    rows: int

    def most(self) -> np.ndarray:
        """An upper bound on each row's tokens (to cut the rows into blocks)."""

    def largest(self) -> int:
        """The largest number of any token."""

    def tokens(self, lo: int, hi: int) -> Tokens:
        """Rows [lo, hi) as tokens."""


class Numbers:
    """One integer per row, as "%d" writes it (a negative one as a "-" piece, then its magnitude)."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, np.int64)
        self.rows = self.values.size

    def most(self) -> np.ndarray:
        return np.full(self.rows, 2, np.int64)

    def largest(self) -> int:
        return int(np.abs(self.values).max(initial=0))

    def tokens(self, lo: int, hi: int) -> Tokens:
        values = self.values[lo:hi]
        negative = values < 0
        if not negative.any():
            return Tokens(np.arange(values.size + 1, dtype=np.int64), values, np.zeros(values.size, np.uint8))
        counts = 1 + negative
        offsets = _offsets(counts)
        signs = offsets[:-1][negative]
        return Tokens(offsets, np.repeat(np.abs(values), counts), np.zeros(int(offsets[-1]), np.uint8), signs,
                      np.zeros(signs.size, np.int64), _pieces([b"-"])[0])


class Strings:
    """One string per row, quoted as the csv module quotes it (`csv_field`)."""

    def __init__(self, values: Sequence[str]):
        table: dict[str, int] = {}
        self.code = np.fromiter((table.setdefault(v, len(table)) for v in values), np.int64, count=len(values))
        self.pieces, self.first, self.count = _pieces([csv_field(v).encode() for v in table])
        self.rows = self.code.size

    def most(self) -> np.ndarray:
        return self.count[self.code]

    def largest(self) -> int:
        return 0

    def tokens(self, lo: int, hi: int) -> Tokens:
        code = self.code[lo:hi]
        counts = self.count[code]
        offsets = _offsets(counts)
        n = int(offsets[-1])
        piece = np.repeat(self.first[code] - offsets[:-1], counts) + np.arange(n, dtype=np.int64)
        return Tokens(offsets, np.zeros(n, np.int64), np.zeros(n, np.uint8), np.arange(n, dtype=np.int64), piece,
                      self.pieces)


class Ranges:
    """Each row's sorted ids as runs, as `batchgen.decisions.ranges` writes them: (0, 1, 2, 5) -> "0-2 5"."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids, self.offsets = np.asarray(ids, np.int64), np.asarray(offsets, np.int64)
        if self.ids.size and self.ids.min() < 0:
            raise ValueError("ranges of negative ids")
        self.rows = self.offsets.size - 1

    def most(self) -> np.ndarray:
        return np.diff(self.offsets)

    def largest(self) -> int:
        return int(self.ids.max(initial=0))

    def tokens(self, lo: int, hi: int) -> Tokens:
        first = int(self.offsets[lo])
        offsets = self.offsets[lo:hi + 1] - first
        ids = self.ids[first:int(self.offsets[hi])]
        n = ids.size
        begins = np.ones(n, bool)                   # a run begins here: a row's first id, or a gap before it
        np.not_equal(ids[1:] - ids[:-1], 1, out=begins[1:])
        starts = offsets[:-1]
        begins[starts[starts < n]] = True
        ends = np.ones(n, bool)                     # a run ends here: the next id begins one
        ends[:-1] = begins[1:]
        at = np.flatnonzero(begins | ends)          # a run's first id, and its last where that is another
        after = np.where(ends[at], np.uint8(ord(" ")), np.uint8(ord("-")))
        return Tokens(np.searchsorted(at, offsets), ids[at], after)


def csv_field(value: str) -> str:
    """`value` as csv.writer (the excel dialect, which DictWriter uses) writes it in a row of several fields."""
    out = io.StringIO()
    csv.writer(out).writerow([value, ""])
    return out.getvalue()[:-3]  # less ",\r\n"


def write(path: Path, header: Sequence[str], columns: Sequence[Cells], line_end: bytes = b"\r\n") -> None:
    """The CSV file of `columns` under `header`, rendered a block of rows at a time."""
    rows = columns[0].rows
    if any(c.rows != rows for c in columns):
        raise ValueError("columns of different lengths")
    most = np.zeros(rows + 1, np.int64)  # tokens before each row, at most (an empty cell still takes one)
    np.cumsum(sum(np.maximum(c.most(), 1) for c in columns), out=most[1:])
    cuts = np.searchsorted(most, np.arange(0, int(most[-1]), BLOCK_TOKENS), side="right") - 1
    cuts = np.append(np.unique(cuts), rows).tolist()
    numbers = Digits(max((c.largest() for c in columns), default=0), int(most[-1]))
    with Path(path).open("wb") as fh:
        fh.write(",".join(csv_field(h) for h in header).encode() + line_end)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            fh.write(_render([c.tokens(lo, hi) for c in columns], hi - lo, numbers, _word(line_end)))


class Digits:
    """Numbers up to `largest` as text: `groups` words of 4 digits each, NUL where a number has fewer. With fewer
    values than tokens (ids recur at every boundary) and not too many, every value is rendered once and looked
    up."""

    def __init__(self, largest: int, tokens: int):
        self.groups = 1
        while largest >= GROUP**self.groups:
            self.groups += 1
        few = largest < min(tokens, TABLE_VALUES)
        self.table = self.render(np.arange(largest + 1, dtype=np.int64)) if few else None

    def __call__(self, number: np.ndarray) -> list[np.ndarray] | np.ndarray:
        """Each group's words (the most significant first), a word per number."""
        return [words[number] for words in self.table] if self.table is not None else self.render(number)

    def render(self, number: np.ndarray) -> np.ndarray:
        words = np.empty((self.groups, number.size), np.uint32)
        _digits(number, words)
        return words


def formatted(fh: IO[str], fmt: Sequence[str], columns: Sequence[np.ndarray], delimiter: str = ",") -> None:
    """Rows of `columns` as numpy.savetxt(fmt=fmt, delimiter=delimiter) writes them, byte for byte: one "%"
    over a block of rows rather than one per row (each column's values keep their type: "%d" of an int)."""
    rows = len(columns[0]) if columns else 0
    line = delimiter.join(fmt) + "\n"
    for lo in range(0, rows, BLOCK_ROWS):
        hi = min(lo + BLOCK_ROWS, rows)
        values = [c[lo:hi].tolist() for c in columns]
        fh.write(line * (hi - lo) % tuple(v for row in zip(*values) for v in row))


def _render(columns: Sequence[Tokens], rows: int, numbers: Digits, line_end: int) -> bytes:
    """A block of rows as CSV text: each token a row of words, its text's and its separator's, NUL-padded. Each
    word is written through a column view (numpy assigns uint32 items by index several times faster than wider
    ones)."""
    own = np.stack([np.diff(c.offsets) for c in columns], axis=1)
    taken = np.maximum(own, 1)  # tokens per cell (rows x columns): an empty cell takes one, of no text
    start = (np.cumsum(taken.ravel()) - taken.ravel()).reshape(taken.shape)
    groups = numbers.groups
    record = np.zeros((int(taken.sum()), groups + 1), np.uint32)
    words = [record[:, g] for g in range(groups + 1)]
    for j, c in enumerate(columns):
        at = np.arange(c.number.size, dtype=np.int64)
        at += np.repeat(start[:, j] - c.offsets[:-1], own[:, j])
        for word, digits in zip(words, numbers(c.number)):
            word[at] = digits
        words[groups][at] = c.after
        if c.text.size:  # a string piece: in the text's last word, nothing before it
            pieces = at[c.text]
            for word in words[:groups - 1]:
                word[pieces] = 0
            words[groups - 1][pieces] = c.pieces[c.piece]
    ends = start + taken - 1
    words[groups][ends[:, :-1]] = ord(",")
    words[groups][ends[:, -1]] = line_end
    return record.tobytes().translate(None, b"\0")


def _digits(number: np.ndarray, out: np.ndarray) -> None:
    """Each number's decimal digits into `out` (groups x numbers): one word per 4 digits, the most significant
    first, the places left of a number's first digit NUL."""
    table = _group_table()
    groups = out.shape[0]
    rest = number
    for k in range(groups):  # the k-th group from the right
        if k < groups - 1:
            left = rest // GROUP  # (numpy's division by a constant is fast, its divmod is not)
            group = rest - left * GROUP
            # zero-padded where digits come left of it; else its own digits ("0" for 0 in the last group only)
            out[groups - 1 - k] = table[group + (left == 0) * ((1 if k == 0 else 2) * GROUP)]
            rest = left
        else:
            out[0] = table[rest + (1 if k == 0 else 2) * GROUP]


@lru_cache(maxsize=1)
def _group_table() -> np.ndarray:
    """Every 4-digit group as a uint32 word of ASCII: zero-padded ("0042"), unpadded ("42", and "0" for 0),
    unpadded with nothing for 0; the places left of the digits as NUL bytes."""
    v = np.arange(GROUP)
    digits = np.stack([v // 1000 % 10, v // 100 % 10, v // 10 % 10, v % 10], axis=1).astype(np.uint8) + ord("0")
    width = 1 + (v >= 10) + (v >= 100) + (v >= 1000)
    unpadded = np.where(np.arange(4) >= 4 - width[:, None], digits, 0).astype(np.uint8)
    nothing = unpadded.copy()
    nothing[0] = 0
    return np.ascontiguousarray(np.concatenate([digits, unpadded, nothing])).view(np.uint32).ravel()


def _pieces(texts: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Strings as 4-byte pieces (uint32 words): the words, each string's first piece and its count of pieces."""
    if any(b"\0" in t for t in texts):
        raise ValueError("CSV text with a NUL byte")
    count = np.array([-(-len(t) // 4) for t in texts], np.int64)
    joined = b"".join(t.ljust(4 * int(k), b"\0") for t, k in zip(texts, count))
    return np.frombuffer(joined, np.uint32).copy(), _offsets(count)[:-1], count


def _word(text: bytes) -> int:
    """A separator of up to 4 bytes as the uint32 word that holds it."""
    if len(text) > 4 or b"\0" in text:
        raise ValueError(f"a separator of more than 4 bytes, or with a NUL: {text!r}")
    return int(np.frombuffer(text.ljust(4, b"\0"), np.uint32)[0])


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out
