"""An offloading schedule's FFN calls: one per micro-batch, as the simulator prices them, however attention was
cut into calls of similar contexts."""

from batchgen.exec.runner import _ffn_rows, _Piece


def piece(kind, rank, lo, hi, seqs=None):
    return _Piece(kind, rank, slice(lo, hi), None, None, list(range(hi - lo)) if seqs is None else seqs)


def test_decode_attention_calls_join_into_micro_batches_of_the_plan():
    calls = [piece("device", 0, 0, 5), piece("device", 0, 5, 12), piece("device", 0, 12, 20)]
    assert _ffn_rows(calls, 16) == [slice(0, 16), slice(16, 20)]
    assert _ffn_rows(calls, 0) == [slice(0, 20)]  # no micro-batch: the whole block
    # another rank's rows, and a prompt piece (rows are its tokens), are calls of their own
    mixed = [piece("device", 0, 0, 30, seqs=[1, 2]), piece("device", 0, 30, 35), piece("device", 0, 35, 42),
             piece("device", 1, 42, 46)]
    assert _ffn_rows(mixed, 16) == [slice(0, 30), slice(30, 42), slice(42, 46)]
    staged = [piece("staged", 0, 0, 4), piece("staged", 0, 4, 8)]
    assert _ffn_rows(staged, 16) == [slice(0, 4), slice(4, 8)]  # each fits a staging buffer: as cut
