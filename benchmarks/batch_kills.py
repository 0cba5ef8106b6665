"""A batch job killed whole with SIGKILL at random moments and rerun: does it lose nothing and write the records
of an uninterrupted single-process job?

    python benchmarks/batch_kills.py [--requests 2000] [--procs 4] [--kills 5] [--trials 1]
        [--mode invariant|default] [--input FILE] [--points records|time] [--window 0.15 0.85 | --window-s 3 6]
        [--checkpoint-s 1] [--kv-mb 8] [--seed 0] [--workdir DIR]

It writes the demo model (`python -m batchgen.batch.demo`: random weights, a real tokenizer), and `--requests`
requests (completions and chats, half greedy and half sampled, some with stop strings or ignore_eos, short
outputs), or reads `--input`. It runs the single-process job (`python -m batchgen.run`, backend=exec) once: the
reference; and the `backend=dist backend.procs=N` job once undisturbed (`--procs 1`: the killed job is the
single-process one). Then each of `--trials` trials starts the job on a fresh output and SIGKILLs its whole
process group (launcher and workers, as a lost node or `kill -9 -PGID` would) `--kills` times, each start
resuming from the results file and the checkpoint the last one left, and finally lets it run to the end. Where
each kill lands:

- `--points records` (default): random points of the job's progress: K record counts drawn uniformly from
  5-95% of the requests (sorted); each run is killed a random 0-2 x `--checkpoint-s` seconds after its results
  file reached the next one, or one more record than it started with (so that every resumed run gets further);
- `--points time`: a moment drawn uniformly from `--window` (fractions of the undisturbed dist run's wall
  time) or `--window-s` (seconds after the start).

A kill that would come after the run ended is not sent (that run finished the job); those are counted apart.

Each trial's output is checked against the reference: every custom_id exactly once, and each record equal to the
reference's (all fields but the wall-clock `created`). `--mode invariant` runs every job with
`backend.batch_invariant=true`, the mode in which docs/batch-jobs.md says a resumed job writes exactly the
uninterrupted records; `--mode default` shows what the default mode does. The last line:

    kills=<k> ids_once=<bool> records_equal=<a>/<b>

(summed over the trials; a line before it gives `trials_equal=<t>/<T>` and the kills that came too late).
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
ENV = {**os.environ, "BATCHGEN_PROGRESS": "0", "PYTHONPATH": str(ROOT)}


def mixed_requests(n: int, seed: int) -> list[dict]:
    """Completions and chats; even ids greedy, odd ids sampled (seeded, or not: then the job's seed decides)."""
    rng = random.Random(seed)
    lines = []
    for k in range(n):
        body: dict = {"max_tokens": rng.randint(8, 64), "temperature": 0}
        if k % 2:
            body.update(temperature=0.8, top_p=0.95)
            if k % 4 == 1:
                body["seed"] = k
        if k % 3 == 0:
            body["ignore_eos"] = True
        elif k % 5 == 0:
            body["stop"] = ["."]
        text = f"Request {k}: tell me about the sea and the {rng.choice(['fox', 'engine', 'gulls', 'dog'])}"
        if k % 4 == 3:
            line = {"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": text}], **body}}
        else:
            line = {"url": "/v1/completions", "body": {"prompt": text, **body}}
        lines.append({"custom_id": f"r{k}", "method": "POST", **line})
    return lines


def command(args, model: Path, requests: Path, output: Path, dist: bool) -> list[str]:
    cmd = [sys.executable, "-m", "batchgen.run", "+policy=coroutine", "backend.device=cpu", "backend.threads=1",
           f"model.path={model}", f"job.input={requests}", f"job.output={output}",
           f"job.checkpoint_s={args.checkpoint_s}"]
    if args.kv_mb:
        cmd.append(f"backend.kv_budget_mb={args.kv_mb}")
    if dist and args.procs > 1:
        cmd[3:3] = ["backend=dist", f"backend.procs={args.procs}", f"backend.lost_after_s={args.lost_after_s}"]
    if args.mode == "invariant":
        cmd.append("backend.batch_invariant=true")
    return cmd


def comparable(path: Path) -> tuple[dict, list[str]]:
    """custom_id -> record without `created`, and every custom_id in file order (to count repeats)."""
    out, ids = {}, []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        key = r["custom_id"] if r["response"] else f"line {r['error']['line']}"
        ids.append(key)
        if r["response"]:
            r["response"]["body"].pop("created", None)
        out[key] = r
    return out, ids


def run_to_end(cmd: list[str], log: Path, timeout: float) -> float:
    t0 = time.monotonic()
    with log.open("a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, timeout=timeout)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}); see {log}")
    return time.monotonic() - t0


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for row in out.splitlines():
        p, pp = map(int, row.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def alive(pids: list[int]) -> list[int]:
    left = []
    for p in pids:
        try:
            os.kill(p, 0)
            left.append(p)
        except ProcessLookupError:
            pass
    return left


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def saved_tokens(output: Path) -> int:
    """Tokens the checkpoint holds (of choices still decoding), 0 when there is none or it is torn."""
    try:
        saved = json.loads(output.with_name(output.name + ".partial").read_text())["requests"]
        return sum(len(c["tokens"]) for e in saved.values() for c in _choices(e) if "finish_reason" not in c)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _choices(entry: dict) -> list[dict]:
    """An entry's choices (batchgen.batch.checkpoint: format 2 keeps them per index; format 1 held choice 0)."""
    return list(entry["choices"].values()) if "choices" in entry else [entry]


def killed_run(cmd: list[str], output: Path, log: Path, at_s: float | None, at_records: int = 0,
               jitter_s: float = 0.0) -> dict | None:
    """Start the job in a session of its own and SIGKILL the whole group `at_s` seconds in (or `jitter_s` after
    the results file reached `at_records` records); None when the run ended first (no kill sent)."""
    with log.open("a") as out:
        out.write(f"\n--- start, kill at {at_s:.2f} s\n" if at_s is not None else
                  f"\n--- start, kill {jitter_s:.2f} s after record {at_records}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    t0 = time.monotonic()
    try:
        if at_s is None:  # and at least one record later than the last run's
            at_records = max(at_records, lines_in(output) + 1)
            while lines_in(output) < at_records and proc.poll() is None:
                time.sleep(0.02)
            at_s = time.monotonic() - t0 + jitter_s
        proc.wait(timeout=max(0.0, at_s - (time.monotonic() - t0)))
        if proc.returncode:
            sys.exit(f"a run failed ({proc.returncode}) before its kill; see {log}")
        return None
    except subprocess.TimeoutExpired:
        pass
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    at = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(workers)
    if left:
        sys.exit(f"processes {left} outlived the SIGKILL of their group")
    return {"at_s": round(at, 2), "records": lines_in(output), "workers": len(workers),
            "tokens": saved_tokens(output)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="requests to generate (ignored with --input)")
    p.add_argument("--input", type=Path, help="a requests file to use instead")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per trial, each followed by a rerun")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--mode", choices=("invariant", "default"), default="invariant")
    p.add_argument("--window", type=float, nargs=2, default=(0.15, 0.85),
                   help="kill moments, as fractions of the undisturbed dist run's wall time")
    p.add_argument("--window-s", type=float, nargs=2, help="kill moments in seconds after the start instead")
    p.add_argument("--points", choices=("records", "time"), default="records",
                   help="records: each kill a random time after a random record count; time: a random moment of "
                        "the window")
    p.add_argument("--checkpoint-s", type=float, default=1.0)
    p.add_argument("--kv-mb", type=int, default=8,
                   help="KV budget per process (small: yields and migrations; 0: the backend's default)")
    p.add_argument("--lost-after-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path("outputs/batch_kills"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from batchgen.batch.demo import write_demo_model

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = write_demo_model(work / "demo-model", requests=False)
    requests = args.input.resolve() if args.input else work / "requests.jsonl"
    if not args.input:
        requests.write_text("".join(json.dumps(r) + "\n" for r in mixed_requests(args.requests, args.seed)))
    log = work / "runs.log"
    log.write_text("")
    for f in work.glob("*.jsonl*"):
        if f != requests:
            f.unlink()

    reference = work / "reference.jsonl"
    ref_s = run_to_end(command(args, model, requests, reference, dist=False), log, 3600)
    ref, _ = comparable(reference)
    if args.procs > 1:
        undisturbed = work / "undisturbed.jsonl"
        dist_s = run_to_end(command(args, model, requests, undisturbed, dist=True), log, 3600)
        und, _ = comparable(undisturbed)
        print(f"{len(ref)} records; reference (1 process) {ref_s:.1f} s; dist undisturbed ({args.procs} processes) "
              f"{dist_s:.1f} s, equal {sum(und.get(k) == v for k, v in ref.items())}/{len(ref)}; mode {args.mode}",
              flush=True)
    else:  # the killed job is the single-process one itself
        dist_s = ref_s
        print(f"{len(ref)} records; reference (1 process) {ref_s:.1f} s; killed job: the same; mode {args.mode}",
              flush=True)

    rng = random.Random(args.seed)
    kills = late = trials_equal = equal = total = 0
    ids_once = True
    for t in range(args.trials):
        output = work / f"trial{t}.jsonl"
        cmd = command(args, model, requests, output, dist=True)
        landed = []
        targets = sorted(rng.randint(len(ref) // 20, len(ref) * 19 // 20) for _ in range(args.kills))
        for target in targets:
            if args.points == "records":
                k = killed_run(cmd, output, log, None, target, rng.uniform(0, 2 * args.checkpoint_s))
            else:
                lo, hi = args.window_s or (f * dist_s for f in args.window)
                k = killed_run(cmd, output, log, rng.uniform(lo, hi))
            if k is None:
                late += 1
                break
            landed.append(k)
        kills += len(landed)
        if lines_in(output) < len(ref):
            run_to_end(cmd, log, 3600)
        got, ids = comparable(output)
        once = len(ids) == len(set(ids)) and set(ids) == set(ref)
        same = sum(got.get(k) == v for k, v in ref.items())
        ids_once &= once
        equal += same
        total += len(ref)
        trials_equal += same == len(ref) and once
        points = ", ".join(f"{k['at_s']} s ({k['records']} records, {k['tokens']} tokens saved)" for k in landed)
        diff = [k for k, v in ref.items() if got.get(k) != v][:5]
        print(f"trial {t}: kills at {points or 'none'}; ids_once={once} equal={same}/{len(ref)}"
              + (f" first differing: {diff}" if diff else ""), flush=True)
    print(f"trials_equal={trials_equal}/{args.trials} kills_after_the_end={late}")
    print(f"kills={kills} ids_once={ids_once} records_equal={equal}/{total}")


if __name__ == "__main__":
    main()
