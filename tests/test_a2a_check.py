"""The expert all-to-all against DeepEP's published multi-node latencies (batchgen.calibrate.a2a_check)."""

from batchgen.calibrate.a2a_check import DEEPEP_LOW_LATENCY, predictions, summary
from batchgen.calibrate.check import load_efficiency_file


def test_a_many_node_all_to_all_is_priced_near_deepeps_published_latency():
    rows = predictions(load_efficiency_file("h100"))
    assert len(rows) == 2 * len(DEEPEP_LOW_LATENCY)
    # each remote peer is reached in parallel: 8 to 256 ranks stay within DeepEP's growth, never a per-peer
    # latency over every remote peer (which priced the 256-way dispatch at 6.5x the measured one)
    assert all(abs(p - m) / m < 0.3 for _, _, p, m in rows)
    dispatch = [p for r, phase, p, _ in rows if phase == "dispatch"]
    assert dispatch == sorted(dispatch)  # more ranks: more of the bytes cross the network
    assert set(summary(rows)) == {"one node", "across nodes"}
