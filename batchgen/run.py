"""Entry point of batch jobs:

    python -m batchgen.run +policy=coroutine model.path=DIR job.input=requests.jsonl job.output=results.jsonl

reads an OpenAI Batch API file, runs it on the executor and appends one OpenAI Batch output record per request
the moment it completes (an error record for each bad line). Run the same command again to resume after a crash.
`job.estimate=true` predicts the completion time on `cluster=...` under each policy instead, without loading any
weight. See conf/run.yaml for every setting.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig

from batchgen.cli import checked_main
from batchgen.confdir import conf_dir
from batchgen.memory import ConfigError
from batchgen.setup import plain as _plain

COMMAND = "batchgen.run"


def _instances_given(setup) -> None:
    """A batch job runs the instances its config gives: the planned size is for a simulated job's planner."""
    if setup.instances_planned:
        raise ConfigError("cluster.gpus_per_instance=auto is planned for a simulated job (python -m "
                          "batchgen.experiment); a batch job runs the instances it is given: set "
                          "cluster.gpus_per_instance to a number of GPUs, or null for one instance")


def run_job(cfg: DictConfig) -> None:
    from batchgen.batch.job import JobSettings, executor_cluster, model_dir, run_batch
    from batchgen.setup import build_setup, checked_calibration, model_path, model_spec
    from batchgen.job import Job

    name = cfg.backend.get("name")
    if name not in ("exec", "dist"):
        raise ConfigError(f"backend={name}: a batch job runs on the executor (backend=exec, the default, or "
                          "backend=dist backend.procs=N: one process per GPU); to predict its time on a simulated "
                          "cluster, add job.estimate=true")
    settings = JobSettings.from_config(_plain(cfg.job), seed=cfg.get("seed", 0))
    path = model_dir(model_path(cfg))
    setup = build_setup(cfg, command=COMMAND)
    _instances_given(setup)
    backend = _backend_settings(cfg, path)
    if backend.repeats != 1:
        raise ConfigError(f"backend.repeats={backend.repeats}: a batch job runs its requests once; drop it")
    spec = model_spec(cfg, backend.resolved_dtype().itemsize)
    checked_calibration(setup, spec)
    cluster = executor_cluster(setup.cluster, getattr(backend, "procs", 1))

    def build(workload) -> Job:
        return Job(model=spec, cluster=cluster, workload=workload, policy=setup.policy, memory=setup.memory,
                   efficiency=setup.efficiency, latency=setup.latency, page_tokens=setup.page_tokens,
                   check_invariants=setup.check_invariants)

    writes = name == "exec" or _rank() == 0  # a torchrun worker (rank > 0) serves; rank 0 writes the results
    summary = run_batch(settings, path, build, _run_exec(backend) if name == "exec" else _run_dist(backend),
                        writes=writes, page_tokens=setup.page_tokens)
    if not writes:
        return
    if summary.completed == 0 and summary.failed + summary.already_done == summary.requests:
        print(f"job already complete: every one of the {summary.requests:,} requests has a record in "
              f"{settings.output}; nothing to do")
    print(summary.format())


def _backend_settings(cfg: DictConfig, path: Path):
    from batchgen.exec.run import ExecSettings

    backend = {k: v for k, v in _plain(cfg.backend).items() if k != "name"}
    backend["model_path"] = str(path)
    if cfg.backend.get("name") == "dist":
        from batchgen.dist.settings import DistSettings as Settings
    else:
        Settings = ExecSettings
    try:
        return Settings(**backend)
    except TypeError as e:
        raise ConfigError(f"bad backend setting: {e}") from e


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise: the one-machine launcher starts its processes itself)."""
    from batchgen.dist.settings import under_torchrun

    return int(os.environ["RANK"]) if under_torchrun() else 0


def _run_exec(exec_settings):
    """The single-process executor, the sink opened here."""
    from batchgen.exec.run import execute

    def run(job, prompts, params, resumed, sink):
        with sink.open() as out:
            execute(job, exec_settings, prompts=prompts, params=params, on_finish=out.on_finish, resumed=resumed,
                    after_run=out.after_run)
        return out.counts
    return run


def _run_dist(dist_settings):
    """One process per GPU (batchgen.dist): rank 0 opens the sink in its own process and writes the records."""
    from batchgen.batch.job import JobStopped
    from batchgen.dist.run import DistRunFailed, execute_dist

    def run(job, prompts, params, resumed, sink):
        try:
            out = execute_dist(job, dist_settings, prompts=prompts, params=params, resumed=resumed, sink=sink)
        except DistRunFailed as e:  # the headline first, then every failed rank's error
            details = str(e).partition("\n")[2]
            raise JobStopped(f"{e.headline}\nthe results file keeps every request that finished: run the same "
                             f"command again to resume" + (f"\n{details}" if details else "")) from e
        return None if out is None else out.sink_counts
    return run


def estimate_job(cfg: DictConfig) -> None:
    """The input's prompt lengths and max_tokens, simulated on `cluster` under each policy; no weight is read.
    With model.path, lengths come from its tokenizer and its config.json gives the shape; else the `model`
    group's spec is used and text lengths are guessed (about 4 bytes a token), which the printout says."""
    from batchgen.batch.estimate import DEFAULT_OUTPUT, EstimateInput, estimate, format_estimate
    from batchgen.batch.job import model_dir
    from batchgen.batch.requests import ApproximateTokenizer, ModelInfo, read_requests
    from batchgen.setup import build_setup, checked_calibration, model_path, model_spec, policy_config
    from batchgen.policy import policy_names
    from batchgen.progress import enabled
    from batchgen.workload.prefixes import discover_prefixes

    job = _plain(cfg.job)
    src = Path(str(job.get("input") or "")).expanduser()
    if not job.get("input") or not src.is_file():
        raise ConfigError(f"job.input={job.get('input')}: no such file (an OpenAI batch file: one JSON request a line)")
    setup = build_setup(cfg, policy_required=False, command=COMMAND)
    _instances_given(setup)
    path = model_path(cfg)
    spec = model_spec(cfg)
    checked_calibration(setup, spec)
    if path:
        info = ModelInfo.from_dir(model_dir(path))
        if info.tokenizer is None:
            info = replace(info, tokenizer=ApproximateTokenizer())
    else:
        info = ModelInfo.approximate(spec.vocab_size, spec.max_context)
    requests, errors = read_requests(src, info, job_seed=cfg.get("seed", 0),
                                     default_max_tokens=job.get("default_max_tokens"))
    if not requests:
        raise ConfigError(f"job.input={src}: no valid request to estimate ({len(errors)} bad lines; run the job "
                          "to get an error record for each)")
    choices = np.array([r.n for r in requests])  # every choice of a request is a sequence of its own
    prompts = [r.prompt_ids for r in requests for _ in range(r.n)]
    # shared prefixes found in the prompts' tokens, as the run finds them (a request's choices, a system prompt)
    group, prefix_len, tree = discover_prefixes(prompts, setup.page_tokens)
    inp = EstimateInput(np.array([len(p) for p in prompts], np.int64),
                        np.repeat([r.params.max_tokens for r in requests], choices),
                        np.repeat([r.params.ignore_eos for r in requests], choices),
                        approximate_prompts=isinstance(info.tokenizer, ApproximateTokenizer), requests=len(requests),
                        prefix_group=group, prefix_len=prefix_len, prefix_tree=tree)
    names = list(job.get("estimate_policies") or [])
    unknown = [n for n in names if n not in policy_names()]
    if not names or unknown:
        raise ConfigError(f"job.estimate_policies={names}: give a list of policies from {', '.join(policy_names())}")
    chosen = _plain(cfg.policy) if cfg.get("policy") is not None else {}
    policies = [chosen if chosen.get("name") == n else policy_config(n, spec) for n in names]
    output = job.get("estimate_output") or DEFAULT_OUTPUT
    rows = estimate(spec, setup.cluster, inp, policies, output=output, seed=cfg.get("seed", 0),
                    efficiency=setup.efficiency, latency=setup.latency, memory=setup.memory,
                    progress=enabled(job.get("progress", "auto")), share=_share(job.get("estimate_share", "auto")))
    print(format_estimate(rows, inp, output, spec, setup.cluster))
    if errors:
        print("1 line of the input is bad and would get an error record (not estimated)" if len(errors) == 1 else
              f"{len(errors):,} lines of the input are bad and would get error records (not estimated)")


def _share(value) -> bool | None:
    if value == "auto" or isinstance(value, bool):
        return None if value == "auto" else value
    raise ConfigError(f"job.estimate_share must be auto, true or false, got {value!r}")


@checked_main(COMMAND)
@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="run")
def main(cfg: DictConfig) -> None:
    from batchgen.batch.job import JobStopped
    from batchgen.batch.output import OutputFileError
    from batchgen.overrides import check_known_keys

    try:
        check_known_keys(cfg, COMMAND)
        estimate_job(cfg) if cfg.job.get("estimate") else run_job(cfg)
    except (ConfigError, OutputFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except JobStopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
