"""The paper's long-tail experiments in simulation (DeepSeek-R1 on 16 H20, one 16-GPU instance).

    python experiments/long_tail.py [--part rl|tts|both] [--out DIR] [extra Hydra overrides...]

RL rollout (`+experiment=rl_rollout`): 256 prompts of a reasoning model, outputs long-tailed to 64K tokens;
coroutine with and without PARTITION, both with data-parallel attention (`policy.attention_tp=1`: PARTITION splits
a straggler's heads over data-parallel ranks; a plan of tensor-parallel attention groups, which `auto` may pick,
has no PARTITION). It reports the share of the rollout spent in the tail (at most 0.5 running
sequences per GPU), the decode iteration time there, and the partitions taken. The paper: the tail takes 30-80%
of rollout time; PARTITION with FP8 decode cuts iteration time 5-10%.

Test-time scaling by recursive self-aggregation (RSA): a population of candidate answers per problem, each round
asks the model to aggregate K candidates of the previous round into a new one (8K decode per round at most), so a
round's prompts hold the previous round's outputs and start when it ends. It counts the sequences finished within
30 and 60 minutes under coroutine and a baseline (`--baseline`: sglang_opt, the paper's tuned SGLang, by default;
continuous for plain serving), and the prompt tokens each policy's rounds submit and how many are distinct with
each problem's shared prefix counted once (a round's prompts of one problem are one prefix group), and how many
the prefills computed (both policies share prefixes as their engines do: `policy.prefix_cache`). The paper:
1.25-1.57x more sequences than its tuned SGLang in 30 minutes, 1.66-1.75x in 60 minutes.

Writes rl_rollout.csv / tts.csv and a figure of each (PNG and PDF) into the run directory
(outputs/experiments/long_tail/<time> unless --out), and prints the paper's numbers beside ours.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.job import Job
from batchgen.results.metrics import step_arrays
from batchgen.sim.run import simulate
from batchgen.workload import Workload
from batchgen.workload.distributions import make_distribution

try:
    import figure_style as fs  # run as a script: experiments/ is on the path
except ImportError:
    from experiments import figure_style as fs

TAIL_RUNNING_PER_GPU = 0.5  # the paper's tail: at most this many active sequences per GPU
RSA_PROBLEM_TOKENS = 1024
RSA_OUTPUT = {"kind": "longtail", "mean": 4096, "p99_over_p95": 3.78, "max_over_p95": 9.2, "max": 8192}


def compose_job(overrides: list[str]) -> Job:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return build_job(compose("config", overrides=overrides))


def tail_stats(out) -> dict:
    """Share of the run spent in the tail, and the decode time per iteration there and before it."""
    s = step_arrays(out)
    gpus = out.prepared.cluster.instance_size
    bct = float(out.prepared.state.table.finish_time.max())
    # the tail: from the run after the last one with more running sequences than that (a short run between
    # prefill forwards, with few running, is not the tail)
    bulk = np.flatnonzero(s.running > TAIL_RUNNING_PER_GPU * gpus)
    tail = np.arange(s.running.size) > (bulk[-1] if bulk.size else -1)
    decode = s.phase == "decode"

    def per_iteration(mask):
        its = s.iterations[mask].sum()
        return float(s.duration[mask].sum() / its) if its else float("nan")

    first_tail = float(s.start[tail].min()) if tail.any() else bct
    return {"bct_s": bct, "tail_share": (bct - first_tail) / bct,
            "tail_iteration_ms": 1e3 * per_iteration(decode & tail),
            "bulk_iteration_ms": 1e3 * per_iteration(decode & ~tail),
            "partitions": int(out.prepared.state.table.partitions.sum()),
            "comm_share": float(s.comm.sum() / max(s.busy.sum() + s.comm.sum(), 1e-12))}


def rl_rollout(extra: list[str]) -> list[dict]:
    rows = []
    for partition in (True, False):
        job = compose_job(["+experiment=rl_rollout", "+policy=coroutine", "policy.attention_tp=1",
                           f"policy.partition={partition}", *extra])
        start = time.perf_counter()
        out = simulate(job)
        rows.append({"policy": "coroutine", "partition": partition, **tail_stats(out), "requests": len(job.workload),
                     "longest_output": int(job.workload.output_lens.max()), "wall_s": time.perf_counter() - start})
        print(f"done: rl_rollout partition={partition} BCT {rows[-1]['bct_s']:.0f} s", flush=True)
    return rows


def rsa_workload(name: str, prompts: np.ndarray, outputs: np.ndarray, population: int) -> Workload:
    """One RSA round, a prefix group per problem sharing what its prompts truly share: in the first round the
    whole prompt (the problem, sampled `population` times); later the aggregation prompt's head, the problem
    statement, which comes before its K candidates (members can also share a first candidate by chance: a one-
    level group leaves that out, so the distinct count is an upper bound on what a prefix tree prefills)."""
    group = np.arange(prompts.size) // population
    return Workload(name, prompts, outputs, prefix_group=group,
                    prefix_len=np.full(prompts.size, RSA_PROBLEM_TOKENS, dtype=np.int64))


def rsa_rounds(policy: str, problems: int, population: int, k: int, horizon_s: float, seed: int,
               extra: list[str]) -> tuple[list[dict], np.ndarray]:
    """Rounds of recursive self-aggregation until `horizon_s`; each round's prompts are a problem plus K
    candidates (outputs) of the previous round. Returns one row per round and every sequence's finish time."""
    rng = np.random.default_rng(seed)
    n = problems * population
    base = compose_job(["+experiment=rl_rollout", f"+policy={policy}", *extra])
    answers = make_distribution(RSA_OUTPUT)
    problem_tokens = np.full(n, RSA_PROBLEM_TOKENS, dtype=np.int64)
    prompts, outputs = problem_tokens, answers.sample(n, rng)
    clock, rounds, finishes = 0.0, [], []
    while clock < horizon_s:
        job = Job(**{**base.__dict__, "workload": rsa_workload(f"rsa_round_{len(rounds)}", prompts, outputs,
                                                                population)})
        out = simulate(job)
        finish = out.prepared.state.table.finish_time + clock
        finishes.append(finish)
        rounds.append({"policy": policy, "round": len(rounds), "start_s": clock, "bct_s": float(finish.max() - clock),
                       "sequences": n, "mean_prompt": float(prompts.mean()),
                       "finished_30min": int((finish <= 1800).sum()),
                       "finished_60min": int((finish <= 3600).sum()), **job.workload.prefill_tokens(),
                       "prefill_tokens_computed": int(out.prepared.state.prefill_computed)})
        print(f"done: tts {policy} round {len(rounds) - 1} ({clock:.0f} s -> {finish.max():.0f} s)", flush=True)
        clock = float(finish.max())
        # the next round: each sequence aggregates K random candidates of its problem's population
        members = rng.integers(0, population, size=(n, k)) + (np.arange(n) // population * population)[:, None]
        prompts = problem_tokens + outputs[members].sum(axis=1)
        outputs = answers.sample(n, rng)
    return rounds, np.concatenate(finishes)


def write(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


PAPER = {"tail_share": "30-80%", "tail_iteration": "-5 to -10% with FP8 decode", 30: "1.25-1.57x", 60: "1.66-1.75x"}


def plot(run_dir: Path, rl: list[dict], tts: list[dict], finishes: dict[str, np.ndarray]) -> list[Path]:
    """(e1) the paper's metric, the decode iteration time in the tail with and without PARTITION, beside the
    rollout split into bulk and tail; (e2) sequences finished over time, the counts at 30 and 60 minutes and
    their ratio marked beside the paper's ranges."""
    panels = (2 if rl else 0) + (1 if tts else 0)
    fig, axes = fs.figure(panels, width=5.0, height=4.4)
    parts = []
    if rl:
        off = next(r for r in rl if not r["partition"])
        on = next(r for r in rl if r["partition"])
        labels = ["without PARTITION", "with PARTITION"]
        ax = axes.pop(0)
        bars = ax.bar(labels, [off["tail_iteration_ms"], on["tail_iteration_ms"]], color=[fs.OTHERS, fs.OURS])
        change = on["tail_iteration_ms"] / off["tail_iteration_ms"] - 1
        for bar, text in zip(bars, (f"{off['tail_iteration_ms']:.1f} ms", f"{on['tail_iteration_ms']:.1f} ms\n"
                                                                            f"({100 * change:+.0f}%)")):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.45 * off["tail_iteration_ms"])
        ax.set_ylabel("decode iteration time in the tail (ms)")
        ax.set_title(f"RL rollout: the tail's decode iteration\n(<= {TAIL_RUNNING_PER_GPU} running sequences per GPU)",
                     fontsize=9)
        fs.paper_note(ax, f"paper: PARTITION {PAPER['tail_iteration']}", loc="upper right")
        ax = axes.pop(0)
        bulk = [r["bct_s"] * (1 - r["tail_share"]) for r in (off, on)]
        tail = [r["bct_s"] * r["tail_share"] for r in (off, on)]
        ax.bar(labels, bulk, color="tab:blue", label="before the tail")
        ax.bar(labels, tail, bottom=bulk, color="tab:orange", label="the tail")
        for i, r in enumerate((off, on)):
            ax.text(i, r["bct_s"], f"{r['bct_s']:,.0f} s\ntail {r['tail_share']:.0%}", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylim(0, 1.45 * max(off["bct_s"], on["bct_s"]))
        ax.set_ylabel("rollout time (s)")
        fs.plain(ax.yaxis)
        ax.set_title(f"RL rollout: bulk and tail; {on['partitions']} partitions", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        fs.paper_note(ax, f"paper: the tail takes\n{PAPER['tail_share']} of the rollout", loc="upper right")
        parts.append(f"RL rollout: {on['requests']:,} requests")
        headline = (f"PARTITION: tail iteration {off['tail_iteration_ms']:.1f} -> {on['tail_iteration_ms']:.1f} ms "
                    f"({100 * change:+.0f}%; paper {PAPER['tail_iteration']})")
    if tts:
        ax = axes.pop(0)
        policies = ["coroutine"] + sorted(p for p in finishes if p != "coroutine")
        counts = {}
        for policy in policies:
            t = np.sort(finishes[policy]) / 60
            ax.step(np.r_[0, t], np.arange(t.size + 1), where="post", label=policy,
                    color=fs.OURS if policy == "coroutine" else fs.OTHERS)
            for minute in (30, 60):
                counts[policy, minute] = int((t <= minute).sum())
                ax.plot(minute, counts[policy, minute], "o", color=fs.OURS if policy == "coroutine" else fs.OTHERS)
                ax.annotate(f"{counts[policy, minute]:,}", (minute, counts[policy, minute]), fontsize=7,
                            xytext=(-4, 4 if policy == "coroutine" else -10), textcoords="offset points", ha="right")
        base = policies[1] if len(policies) > 1 else None
        top = max(counts.values()) if counts else 1
        for minute in (30, 60):
            ax.axvline(minute, color="grey", linestyle=":", linewidth=1)
            if base:
                ratio = counts["coroutine", minute] / max(counts[base, minute], 1)
                ax.text(minute + 0.5, 1.12 * top, f"{minute} min: {ratio:.2f}x\npaper: {PAPER[minute]}", fontsize=8,
                        va="bottom", ha="left" if minute == 30 else "right", color="black")
        ax.set_ylim(0, 1.45 * top)
        ax.set_xlim(0, 62)
        ax.set_xlabel("simulated time (min)")
        ax.set_ylabel("sequences finished")
        fs.plain(ax.yaxis)
        ax.set_title(f"test-time scaling (RSA): sequences finished, coroutine / {base}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        per_round = tts[0]["sequences"]
        parts.append(f"RSA: {per_round:,} requests a round")
        if base:
            tts_line = (f"RSA: {counts['coroutine', 30] / max(counts[base, 30], 1):.2f}x in 30 min "
                        f"(paper {PAPER[30]}), {counts['coroutine', 60] / max(counts[base, 60], 1):.2f}x in 60 min "
                        f"(paper {PAPER[60]})")
            headline = f"{headline}; {tts_line}" if rl else tts_line
    fig.suptitle(f"DeepSeek-R1 on 16 x H20, {'; '.join(parts)} (simulated)\n{headline}", fontsize=10)
    return fs.save(fig, run_dir, "long_tail")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="both", choices=["rl", "tts", "both"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--population", type=int, default=16)
    ap.add_argument("--baseline", default="sglang_opt", help="the policy coroutine is compared with (RSA)")
    ap.add_argument("--k", type=int, default=4, help="candidates aggregated per RSA prompt")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    run_dir = args.out or Path("outputs/experiments/long_tail") / time.strftime("%Y-%m-%d_%H-%M-%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    rl = rl_rollout(args.overrides) if args.part in ("rl", "both") else []
    tts, finishes = [], {}
    if args.part in ("tts", "both"):
        for policy in ("coroutine", args.baseline):
            rows, finishes[policy] = rsa_rounds(policy, args.problems, args.population, args.k, 3600.0, seed=0,
                                                extra=args.overrides)
            tts += rows
    written = [write(run_dir / "rl_rollout.csv", rl)] if rl else []
    written += [write(run_dir / "tts.csv", tts)] if tts else []
    written += plot(run_dir, rl, tts, finishes)
    if rl:
        on, off = rl
        print("\nRL rollout (coroutine, DeepSeek-R1, 16 x H20, 256 prompts):")
        print(f"  tail share of the rollout: {100 * off['tail_share']:.0f}% without PARTITION "
              f"(paper: 30-80%)")
        change = on["tail_iteration_ms"] / off["tail_iteration_ms"] - 1
        print(f"  decode iteration in the tail: {off['tail_iteration_ms']:.1f} ms -> {on['tail_iteration_ms']:.1f} ms "
              f"with PARTITION ({100 * change:+.1f}%; paper: -5 to -10% with FP8 decode), BCT {off['bct_s']:.0f} s -> "
              f"{on['bct_s']:.0f} s, {on['partitions']} partitions")
    if tts:
        print("\nRecursive self-aggregation (sequences finished):")
        for minutes in (30, 60):
            key = f"finished_{minutes}min"
            got = {p: sum(r[key] for r in tts if r["policy"] == p) for p in ("coroutine", args.baseline)}
            ratio = got["coroutine"] / max(got[args.baseline], 1)
            paper = "1.25-1.57x" if minutes == 30 else "1.66-1.75x"
            print(f"  in {minutes} min: coroutine {got['coroutine']:,}, {args.baseline} {got[args.baseline]:,}: "
                  f"{ratio:.2f}x (paper, against SGLang-Opt: {paper})")
        for p in ("coroutine", args.baseline):
            mine = [r for r in tts if r["policy"] == p]
            submitted, distinct, computed = (sum(r[f"prefill_tokens_{c}"] for r in mine)
                                             for c in ("submitted", "distinct", "computed"))
            print(f"  prefill tokens, {p}'s {len(mine)} rounds: {submitted:,} submitted, {distinct:,} distinct with "
                  f"each problem's shared prefix once, {computed:,} computed")
    print("written: " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
