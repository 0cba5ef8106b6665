"""Vidur (microsoft/vidur) on exactly the requests of a batchgen workload, timed in its event loop: the side of
`python benchmarks/sim_scale.py --policies --vidur-dir DIR --vidur-python PY` that runs Vidur, so that the
ratio it prints is measured beside batchgen's runs instead of against a number from another day.

Vidur is no dependency of batchgen and none of its code is here. To prepare it once (about 20 minutes, most of
it Vidur training its predictors):

    # a checkout of microsoft/vidur (the recorded runs used 7d47513) in DIR, then
    python3.11 -m venv VENV && VENV/bin/pip install numpy==1.26.4 pandas==2.2.3 scikit-learn==1.9.1 scipy wandb \
        fasteners plotly plotly_express matplotlib seaborn kaleido ddsketch pyyaml tqdm
    VENV/bin/pip install --no-deps -e DIR
    python benchmarks/vidur_standin.py DIR   # its A100 Llama-2-7B attention profile, where a Git LFS pointer stands

and pass `--vidur-dir DIR --vidur-python VENV/bin/python`. Vidur reads `data/profiling/` relative to DIR (the
attention stand-in's formula and grid: benchmarks/vidur_standin.py); WANDB_MODE is set to disabled. Its
random-forest predictors are trained on the first run (10-20 minutes on a 2-core machine) and cached in DIR/cache;
later runs read them.

What runs: Llama-2-7B on one A100 (TP 1, one replica), Vidur's vLLM scheduler at its defaults (batch cap 128,
4,096 tokens per batch), every request at t=0 (`static` intervals), the lengths from a trace CSV written from
the workload (`num_prefill_tokens`, `num_decode_tokens`; Vidur shuffles their order with its seed), default
metrics (chrome trace on). The seconds are Simulator.run's alone, without start-up or the output Vidur writes
at exit.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np

import vidur_standin  # beside this script

# Builds Vidur's config from the command line, runs its simulator, prints the loop's seconds (our glue).
_RUNNER = """
import time
from vidur.config import SimulationConfig
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
simulator = Simulator(config)
start = time.perf_counter()
simulator.run()
print(f"VIDUR run_s={time.perf_counter() - start:.4f} end_s={simulator._time:.4f}", flush=True)
"""


def checkout_problem(vidur_dir: str | Path) -> str | None:
    """What is wrong with `vidur_dir` as a Vidur checkout, or None."""
    if not (Path(vidur_dir) / "vidur" / "simulator.py").is_file():
        return f"{vidur_dir} is not a Vidur checkout (no vidur/simulator.py): pass --vidur-dir a clone of microsoft/vidur"
    profile = Path(vidur_dir) / vidur_standin.PROFILE
    if not profile.is_file() or vidur_standin.is_lfs_pointer(profile):
        return (f"{profile} is {'missing' if not profile.is_file() else 'a Git LFS pointer'}: write the stand-in "
                f"with `python benchmarks/vidur_standin.py {vidur_dir}` (and delete {vidur_dir}/cache/attn_* if "
                "that exists)")
    return None


def write_trace(input_lens: np.ndarray, output_lens: np.ndarray, path: Path) -> Path:
    """The requests as Vidur's trace length generator reads them."""
    with open(path, "w") as f:
        f.write("num_prefill_tokens,num_decode_tokens\n")
        f.writelines(f"{p},{d}\n" for p, d in zip(input_lens.tolist(), output_lens.tolist()))
    return path


def vidur_args(trace: Path, requests: int, out_dir: Path, cache_dir: Path) -> list[str]:
    return ["--replica_config_model_name", "meta-llama/Llama-2-7b-hf", "--replica_config_device", "a100",
            "--replica_config_tensor_parallel_size", "1", "--replica_config_num_pipeline_stages", "1",
            "--cluster_config_num_replicas", "1", "--replica_scheduler_config_type", "vllm",
            "--request_generator_config_type", "synthetic",
            "--synthetic_request_generator_config_num_requests", str(requests),
            "--length_generator_config_type", "trace", "--trace_request_length_generator_config_trace_file",
            str(trace), "--trace_request_length_generator_config_max_tokens", "4096",
            "--interval_generator_config_type", "static", "--execution_time_predictor_config_type",
            "random_forrest", "--metrics_config_output_dir", str(out_dir), "--metrics_config_cache_dir",
            str(cache_dir)]


def run_vidur(python: str, vidur_dir: str, input_lens: np.ndarray, output_lens: np.ndarray, work: Path,
              timeout_s: float = 1800.0) -> tuple[float, float]:
    """(seconds in Vidur's event loop, its simulated end) for these requests. Raises RuntimeError with Vidur's
    last output lines when it fails."""
    root = Path(vidur_dir).resolve()
    problem = checkout_problem(root)
    if problem:
        raise RuntimeError(problem)
    trace = write_trace(input_lens, output_lens, work / "vidur_trace.csv")
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(root))
    cmd = [python, "-c", _RUNNER, *vidur_args(trace, len(input_lens), work / "vidur_out", root / "cache")]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    found = re.search(r"VIDUR run_s=([\d.]+) end_s=([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"Vidur failed (exit {done.returncode}) with {python}:\n{tail}")
    return float(found.group(1)), float(found.group(2))
