"""Fault injection for backend=dist: does a run finish with the right outputs when a worker dies or stalls?

    python benchmarks/dist_faults.py [--trials 20] [--procs 3] [--seqs 150] [--hogs 1] [--undisturbed-every 4]
        [--batch-invariant] [--seed 0] [--workdir DIR]

Each trial runs one small job (the tiny_moe model with random weights, `--seqs` greedy requests, the coroutine
policy, a KV budget small enough to force yields and migrations between processes) with `backend=dist` over
`--procs` processes, while `--hogs` CPU-bound processes compete for the cores (more processes than this
machine's cores: the load under which gloo's timed waits used to break transfers). Every `--undisturbed-every`-th
trial is left alone; each other one picks a random rank other than 0 and, at a random moment of the run
(uniform over `--window`, fractions of an undisturbed run's wall time measured by trial 0 under the same load),
sends it SIGKILL (a dead worker) or SIGSTOP (a stalled one, alive and silent: the heartbeat must declare it lost
after backend.lost_after_s and rank 0 must fence it). The default window starts at 30%, after the processes'
start (about 15% of the run here): a loss at start-up is a different path (the run starts again without the
lost process: batchgen/dist/startup.py, tests/distributed/test_startup_loss.py). A fault that still lands
before the first step (a start slowed by the load) takes that path: the trial counts as recovered when its
tokens are equal, without a recovery_s (the restart's moment is not recorded).

Each outcome is checked against the single-process executor's run of the same job (computed first): every
sequence's tokens equal. A trial that has not ended within `--hang-s` is a hang (its processes are killed).
The recovery time is from the signal to the moment rank 0's engine started again over the survivors
(`Recovery.at_unix + regroup_s`). The last line:

    undisturbed_ok=a/A recovered=b/B max_recovery_s=<s> hangs=<n>

Both runs use the loop expert kernel, which makes the expert-parallel layer's logits bit-identical to the
single-process layer's (tests/distributed/test_dist_backend.py), so any difference is the run's fault, not a
rounding tie.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---- one job (run in its own process: `--one exec|dist`) ------------------------------------------------------
def job_of(procs: int, seqs: int, seed: int):
    import numpy as np

    from batchgen.job import Job
    from batchgen.policy import make_policy
    from batchgen.specs import load_cluster, load_model
    from batchgen.workload import Workload
    import dataclasses

    rng = np.random.default_rng(seed)
    inputs, outputs = rng.integers(8, 64, seqs), rng.integers(8, 64, seqs)
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=procs)
    return Job(model=load_model("tiny_moe"), cluster=cluster, workload=Workload("faults", inputs, outputs),
               policy=make_policy({"name": "coroutine", "b_moe": 16}), page_tokens=8)


def run_one(args) -> None:
    """One job; its outcome as JSON on `args.out` (tokens, recoveries, the error's first line)."""
    import torch

    from batchgen.exec.models import moe as moe_module

    torch.set_num_threads(1)
    moe_module._GROUPED[("cpu", torch.float32)] = False  # the loop expert kernel (bit-identical over procs)
    result: dict = {"pid": os.getpid()}
    t0 = time.time()
    try:
        if args.one == "exec":
            from batchgen.exec.run import ExecSettings, execute
            out = execute(job_of(1, args.seqs, args.seed), ExecSettings(device="cpu", kv_budget_mb=args.kv_mb,
                                                                       threads=1,
                                                                       batch_invariant=args.batch_invariant))
        else:
            from batchgen.dist.run import DistSettings, execute_dist
            out = execute_dist(job_of(args.procs, args.seqs, args.seed),
                               DistSettings(device="cpu", kv_budget_mb=args.kv_mb, procs=args.procs,
                                            lost_after_s=args.lost_after_s,
                                            batch_invariant=args.batch_invariant))
            result["recoveries"] = [{"lost": r.lost, "fenced": r.fenced, "survivors": r.survivors,
                                     "at_unix": r.at_unix, "regroup_s": r.regroup_s, "cause": r.cause}
                                    for r in out.recoveries]
            result["restarts"] = out.restarts  # a loss before the first step: started again without it
        result["tokens"] = [list(map(int, t)) for t in out.tokens.generated]
    except Exception as e:  # noqa: BLE001 (the outcome is the report)
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    result["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result))


# ---- the harness ----------------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """The launcher's worker processes (forked: the same command line as their parent), in start order: launch
    rank order."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                parent_cmd = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and cmd == parent_cmd:
            out.append((int(fields[19]), int(entry)))
    return [p for _, p in sorted(out)]


def start_job(args, mode: str, out: Path) -> subprocess.Popen:
    out.unlink(missing_ok=True)  # a stale outcome must not pass for this run's
    cmd = [sys.executable, __file__, "--one", mode, "--out", str(out), "--procs", str(args.procs), "--seqs",
           str(args.seqs), "--seed", str(args.seed), "--kv-mb", str(args.kv_mb), "--lost-after-s",
           str(args.lost_after_s)] + (["--batch-invariant"] if args.batch_invariant else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(out.with_suffix(".log"), "w"))


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_job(proc: subprocess.Popen, out: Path, hang_s: float) -> dict | None:
    """The job's outcome, or None when it did not end within hang_s (then every process of it is killed)."""
    try:
        proc.wait(timeout=hang_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        return None
    kill_group(proc)  # a worker left behind (a stopped one) must not outlive its trial
    return json.loads(out.read_text()) if out.exists() else {"error": f"no outcome (exit {proc.returncode})"}


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def trial(args, rng: random.Random, i: int, ref: list, span_s: float | None, workdir: Path) -> dict:
    out = workdir / f"trial{i}.json"
    disturb = span_s is not None and i % args.undisturbed_every != 0
    proc = start_job(args, "dist", out)
    fault = None
    if disturb:
        sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
        victim = rng.randrange(1, args.procs)
        delay = rng.uniform(*args.window) * span_s
        time.sleep(delay)
        pids = children(proc.pid)
        if len(pids) == args.procs and proc.poll() is None:
            os.kill(pids[victim], sig)
            fault = {"rank": victim, "signal": signal.Signals(sig).name, "at_unix": time.time(), "delay_s": delay}
    result = wait_job(proc, out, args.hang_s) or {"hang": True}
    result["fault"] = fault
    tokens = result.pop("tokens", None)
    result["equal"] = tokens == ref
    if tokens is not None and tokens != ref:
        result["differing"] = [s for s, (a, b) in enumerate(zip(tokens, ref)) if a != b][:10]
    recs = result.get("recoveries") or []
    if fault and recs:
        result["recovery_s"] = recs[0]["at_unix"] + recs[-1]["regroup_s"] - fault["at_unix"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--seqs", type=int, default=150)
    p.add_argument("--hogs", type=int, default=1, help="CPU-bound processes competing for the cores")
    p.add_argument("--undisturbed-every", type=int, default=4, help="every n-th trial runs without a fault")
    p.add_argument("--kv-mb", type=float, default=1.0, help="KV budget per process (small: yields, migrations)")
    p.add_argument("--lost-after-s", type=float, default=10.0, help="backend.lost_after_s")
    p.add_argument("--hang-s", type=float, default=None, help="a trial not ended by then is a hang "
                   "(default: 3 x an undisturbed run + 60 s)")
    p.add_argument("--window", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.3, 0.85),
                   help="the fault's moment: fractions of an undisturbed run's wall time, FROM,TO")
    p.add_argument("--batch-invariant", action="store_true",
                   help="backend.batch_invariant=true in every run, the single-process reference's too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--one", choices=["exec", "dist"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return run_one(args)
    if args.procs < 2:
        p.error("--procs must be at least 2 (a fault needs a rank other than 0)")
    workdir = args.workdir or Path(f"/tmp/dist_faults-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref_out = workdir / "reference.json"
    ref = wait_job(start_job(args, "exec", ref_out), ref_out, 600)
    if ref is None or "error" in ref:
        sys.exit(f"the single-process reference run failed: {ref}")
    ref = ref["tokens"]
    print(f"reference: single process, {len(ref)} sequences", flush=True)
    hogs = start_hogs(args.hogs)
    try:
        first = trial(args, rng, 0, ref, None, workdir)  # undisturbed: how long a run takes here, under load
        span = first.get("wall_s")
        if args.hang_s is None:
            args.hang_s = 3 * (span or 60) + 60
        results = [first]
        print(f"trial 0: {json.dumps(first)}", flush=True)
        for i in range(1, args.trials):
            r = trial(args, rng, i, ref, span, workdir)
            results.append(r)
            print(f"trial {i}: {json.dumps(r)}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    calm = [r for r in results if r["fault"] is None]
    hit = [r for r in results if r["fault"] is not None]
    ok = lambda r: r["equal"] and not r.get("error") and not r.get("hang")  # noqa: E731
    times = [r["recovery_s"] for r in hit if ok(r) and "recovery_s" in r]
    recovered = [r for r in hit if ok(r) and (r.get("recoveries") or r.get("restarts"))]
    print(f"procs={args.procs} seqs={args.seqs} hogs={args.hogs} cores={os.cpu_count()} window={args.window} "
          f"undisturbed_run_s={span:.1f} workdir={workdir}")
    print(f"undisturbed_ok={sum(map(ok, calm))}/{len(calm)} recovered={len(recovered)}/{len(hit)} "
          f"max_recovery_s={max(times) if times else float('nan'):.1f} hangs={sum(bool(r.get('hang')) for r in results)}")


if __name__ == "__main__":
    main()
