"""Rebuild every experiment figure: run each experiment script at the settings experiments/README.md documents,
and copy its figure (PNG) and CSV into one folder under stable names.

    python experiments/make_figures.py [--out experiments/figures] [--quick] [--jobs N] [--only NAME,...]

Each step is its script run as a subprocess (its own run directory under --work; its output in <step>.log
there), so nothing of an experiment's logic lives here. Prints each step, its wall time and the lines where the
script sets its numbers beside the paper's. `--quick` runs every step at a small size (a smoke check of the
whole chain in a minute or two) into outputs/figures_quick unless --out is given, so the committed figures are
not overwritten by small runs. `--jobs N` runs N steps at once. Exits 1 if a step failed (the others still run).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class Step:
    """One script run: its arguments at full size and at --quick size, and the files it writes that are copied
    (file in its run directory -> name in the figures folder)."""

    name: str
    script: str
    args: list[str]
    quick: list[str]
    copies: dict[str, str] = field(default_factory=dict)
    est_s: float = 60.0  # full-size wall time on a 2-core machine, so that --jobs starts the longest first


# experiments/ablations.py's experiments and their full-size wall seconds on a 2-core machine
ABLATIONS = {"scale_12k_4k": 300, "scale_6_5k_2_8k": 150, "pd_disagg": 240, "longbench_h20_8": 30,
             "longbench_h20_16": 30, "longbench_h200_8": 30, "memory_limited": 120, "rl_rollout": 120}


def steps() -> list[Step]:
    out = []
    for shape in ("12k_4k", "6_5k_2_8k"):
        out.append(Step(f"paper_scale_{shape}", "paper_scale.py", ["--shape", shape, "--num-sequences", "10000"],
                        ["--shape", shape, "--num-sequences", "300"],
                        {f"paper_scale_{shape}.png": f"paper_scale_{shape}.png",
                         f"paper_scale_{shape}.csv": f"paper_scale_{shape}.csv"}, 130))
    for name, est in ABLATIONS.items():
        out.append(Step(f"ablations_{name}", "ablations.py", ["--experiment", name],
                        ["--experiment", name, "--num-sequences", "60"],
                        {f"ablations_{name}.png": f"ablations_{name}.png",
                         f"ablations_{name}.csv": f"ablations_{name}.csv"}, est))
    out.append(Step("pd_disagg", "pd_disagg.py", ["--num-sequences", "10000"], ["--num-sequences", "300"],
                    {"pd_disagg.png": "pd_disagg.png", "pd_disagg.csv": "pd_disagg.csv"}, 480))
    out.append(Step("offline_longbench_500", "offline_longbench.py",
                    ["--num-sequences", "500", "--policies", "coroutine,sglang_opt"],
                    ["--num-sequences", "60", "--policies", "coroutine,sglang_opt"],
                    {"offline_longbench.png": "offline_longbench_500.png", "sweep.csv": "offline_longbench_500.csv"}))
    out.append(Step("offload_baselines_gsm8k", "offload_baselines.py", ["--workloads", "gsm8k_512_256"],
                    ["--workloads", "gsm8k_512_256", "--num-sequences", "200"],
                    {"offload_baselines.png": "offload_baselines_gsm8k.png",
                     "offload_baselines.csv": "offload_baselines_gsm8k.csv"}, 240))
    out.append(Step("offload_baselines_chatbotarena_8500", "offload_baselines.py",
                    ["--workloads", "chatbotarena_256_512", "--num-sequences", "8500"],
                    ["--workloads", "chatbotarena_256_512", "--num-sequences", "200"],
                    {"offload_baselines.png": "offload_baselines_chatbotarena_8500.png",
                     "offload_baselines.csv": "offload_baselines_chatbotarena_8500.csv"}, 330))
    out.append(Step("long_tail", "long_tail.py", [], ["--problems", "8"],
                    {"long_tail.png": "long_tail.png", "rl_rollout.csv": "rl_rollout.csv", "tts.csv": "tts.csv"}))
    return out


def headline(log: str) -> list[str]:
    """The lines where a script puts its numbers beside the paper's."""
    keys = ("paper", "lower BCT", "decode iteration in the tail", "in 30 min", "in 60 min", "tail share")
    return [line.rstrip() for line in log.splitlines()
            if (any(k in line for k in keys) or line.startswith("| ")) and not line.startswith("wrote")]


def run(step: Step, work: Path, out: Path, quick: bool) -> tuple[Step, bool, float]:
    run_dir = work / step.name
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / step.script), *(step.quick if quick else step.args), "--out", str(run_dir)]
    print(f"[{step.name}] start: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    env = {**__import__("os").environ}
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(work / f"{step.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - start
    text = (work / f"{step.name}.log").read_text()
    missing = [src for src in step.copies if not (run_dir / src).is_file()]
    for src, dst in step.copies.items():
        if (run_dir / src).is_file():
            shutil.copyfile(run_dir / src, out / dst)
    ok = not missing and (rc == 0 or step.script == "offline_longbench.py")  # a sweep exits 2 if one run failed
    lines = headline(text) if ok else text.splitlines()[-15:]
    status = "done" if ok else f"FAILED (exit {rc}{', missing ' + ', '.join(missing) if missing else ''})"
    print(f"[{step.name}] {status} in {wall:,.0f} s; copied {', '.join(d for s, d in step.copies.items() if s not in missing)}"
          + "".join(f"\n    {line}" for line in lines), flush=True)
    return step, ok, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="the figures folder (default experiments/figures; outputs/figures_quick with --quick)")
    ap.add_argument("--quick", action="store_true", help="every step at a small size: a smoke check")
    ap.add_argument("--jobs", type=int, default=1, help="steps run at once")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all): "
                                               + ",".join(s.name for s in steps()))
    ap.add_argument("--work", type=Path, default=None,
                    help="the scripts' run directories and logs (default outputs/make_figures/<time>)")
    args = ap.parse_args()
    chosen = [s for s in steps() if not args.only or s.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {s.name for s in steps()}
    if unknown:
        raise SystemExit(f"unknown step(s): {', '.join(sorted(unknown))}")
    out = args.out or (ROOT / "outputs" / "figures_quick" if args.quick else HERE / "figures")
    work = (args.work or ROOT / "outputs" / "make_figures" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{len(chosen)} steps{' (quick)' if args.quick else ''}, {args.jobs} at a time; figures -> {out}; "
          f"run directories and logs -> {work}", flush=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        order = sorted(chosen, key=lambda s: -s.est_s) if args.jobs > 1 else chosen
        done = {r[0].name: r for r in pool.map(lambda s: run(s, work, out, args.quick), order)}
    results = [done[s.name] for s in chosen]
    print(f"\nall steps in {time.perf_counter() - start:,.0f} s wall:")
    for step, ok, wall in results:
        print(f"  {step.name:<38} {'ok' if ok else 'FAILED':<6} {wall:>7,.0f} s")
    if not all(ok for _, ok, _ in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
