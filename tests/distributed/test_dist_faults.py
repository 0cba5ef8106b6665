"""The fault-injection harness (benchmarks/dist_faults.py) end to end, with few trials: an undisturbed run and
one with a random non-zero rank killed (or stopped) at a random moment, three processes and a CPU hog on this
machine's cores, each checked token for token against the single-process executor. The fault comes late in the
run (60-90% of an undisturbed one): the processes' start takes about half of so short a run, and a loss during
it stops the run (within seconds) rather than being recovered from."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_harness_recovers_a_random_fault_and_reports_its_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "dist_faults.py"), "--trials", "2", "--undisturbed-every", "2",
           "--seqs", "60", "--procs", "3", "--seed", "1", "--window", "0.6,0.9", "--workdir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={"PYTHONPATH": str(ROOT),
                                                                                 "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"undisturbed_ok=(\d+)/(\d+) recovered=(\d+)/(\d+) max_recovery_s=(\S+) hangs=(\d+)", last)
    assert m, last
    calm_ok, calm, rec, hit, max_s, hangs = m.groups()
    assert (calm_ok, calm, rec, hit, hangs) == ("1", "1", "1", "1", "0"), done.stdout[-3000:]
    assert float(max_s) < 30, last
