"""experiments/figure_style.py draws a 3-row table without error, with labelled axes, the ratio and the paper's
number written on the bars, and no scientific notation."""

import matplotlib

matplotlib.use("Agg")

from experiments import figure_style as fs  # noqa: E402

ROWS = [{"variant": "coroutine", "bct_s": 3159.0, "gpu_busy_frac": 0.5, "gpu_comm_frac": 0.4, "gpu_idle_frac": 0.1},
        {"variant": "sglang_opt", "bct_s": 5603.0, "gpu_busy_frac": 0.45, "gpu_comm_frac": 0.05, "gpu_idle_frac": 0.5},
        {"variant": "static", "bct_s": 38781.0, "gpu_comm_frac": 0.2, "gpu_idle_frac": 0.6}]


def test_ratio_bars_and_share_stack_label_what_they_draw():
    fig, (bct, shares) = fs.figure(2)
    names = [r["variant"] for r in ROWS]
    fs.ratio_bars(bct, names, [r["bct_s"] for r in ROWS], 0, "s", paper={1: "1.71-1.82x"})
    bct.set_xlabel("batch completion time (s)")
    fs.share_stack(shares, names, ROWS)
    fig.canvas.draw()
    texts = [t.get_text() for t in bct.texts]
    assert any("5,603 s, 1.77x" in t for t in texts)
    assert any("paper: 1.71-1.82x" in t for t in texts)
    assert [t.get_text() for t in bct.get_yticklabels()] == names
    assert all("e+" not in t.get_text() for t in bct.get_xticklabels())
    assert shares.get_xlabel() == "share of GPU time"
    assert [t.get_text() for t in shares.get_legend().get_texts()] == ["compute", "communication", "idle"]
    assert "20%" in [t.get_text() for t in shares.texts]  # static's compute: the rest of its GPU time


def test_names_and_title_read_as_words():
    assert fs.cluster_name("h20_8") == "8 x H20"
    assert fs.workload_name("longbench_8k_2k") == "LongBench 8K->2K"
    assert fs.title("deepseek_r1", "h20_128", "longbench_12k_4k", 10000) == \
        "DeepSeek-R1 on 128 x H20, LongBench 12K->4K, 10,000 requests (simulated)"
