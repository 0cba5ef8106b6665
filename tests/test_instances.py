"""cluster.gpus_per_instance=auto: every instance size planned, its batch predicted (prefill forwards, then decode
at the plan's throughput), and the shortest prediction run; refused where nothing is planned."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.instances import instance_sizes, plan_instances, predict
from batchgen.job import planned, prepare
from batchgen.memory import ConfigError
from batchgen.plan.planner import TIE
from batchgen.pricing.batch import batch_time, prefill_forward_s
from batchgen.run import _instances_given
from batchgen.setup import build_setup
from batchgen.specs import load_cluster
from conftest import make_job

PLANNED = {"b_attn": "auto", "b_moe": "auto"}


def _qwen_job(n=300, **kw):
    return make_job(model="qwen3_30b_a3b", cluster="h20_16", n=n, policy_overrides=PLANNED, **kw)


def test_sizes_are_whole_nodes_or_divide_a_node():
    assert instance_sizes(load_cluster("h20_128")) == [1, 2, 4, 8, 16, 32, 64, 128]
    three_nodes = dataclasses.replace(load_cluster("h20_16"), num_gpus=24)
    assert instance_sizes(three_nodes) == [1, 2, 4, 8, 24]  # 12 is neither whole nodes nor within one


def test_batch_time_counts_whole_prompts_per_forward_and_decodes_at_the_plans_rate():
    lat = planned(_qwen_job())[1]
    one = prefill_forward_s(lat, 4, 3, 300.0, 64)
    t = batch_time(lat, sequences=100, mean_input=300.0, mean_output=50.0, ranks=4, instances=2, chunk=1000,
                   micro_batch=64, decode_tokens_per_s=1000.0)
    assert t.prefill_s == pytest.approx(5 * one)  # 3 prompts a rank, 24 a forward: 5 forwards for 100
    assert t.decode_s == pytest.approx(100 * 50 / (1000.0 * 2))
    # a chunk smaller than a prompt still prefills one prompt per rank
    small = batch_time(lat, sequences=100, mean_input=300.0, mean_output=50.0, ranks=4, instances=2, chunk=100,
                       micro_batch=64, decode_tokens_per_s=1000.0)
    assert small.prefill_s == pytest.approx(13 * prefill_forward_s(lat, 4, 1, 300.0, 64))


def test_the_shortest_prediction_runs_or_a_smaller_size_within_the_tie():
    job = _qwen_job()
    chosen = plan_instances(job)
    rows = chosen.instance_plan
    assert [r[0] for r in rows] == instance_sizes(job.cluster)
    total = {size: p + d for size, p, d in rows}
    size = chosen.cluster.gpus_per_instance
    best = min(total.values())
    assert total[size] <= best * (1 + TIE)
    assert all(total[s] > best * (1 + TIE) for s in total if s < size)
    for s, p, d in rows:  # each row is that size's own prediction
        t = predict(dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_instance=s)))
        assert (t.prefill_s, t.decode_s) == (p, d)
    plan = prepare(chosen).plan
    assert plan.instance_sizes == rows and "instance size planned" in plan.describe()


def test_an_instance_across_nodes_pays_its_wider_all_to_all_in_prefill():
    rows = {size: p for size, p, _ in plan_instances(_qwen_job()).instance_plan}
    assert rows[16] > 1.5 * rows[8]  # two nodes: the network, not NVLink, carries the prompts' tokens


def test_refused_for_a_policy_with_nothing_to_plan():
    job = make_job(policy="continuous", model="qwen3_30b_a3b", cluster="h20_16", n=50)
    with pytest.raises(ConfigError, match="gpus_per_instance to a number"):
        plan_instances(job)


def test_a_dense_model_keeps_its_replicas():
    job = make_job(model="llama2_7b", cluster="h100_8", n=20, policy_overrides=PLANNED)
    assert plan_instances(job) is job


def test_the_config_plans_it_and_a_batch_job_refuses_it():
    overrides = ["+policy=coroutine", "model=qwen3_30b_a3b", "cluster=h20_16", "cluster.gpus_per_instance=auto",
                 "workload.num_sequences=50"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    job = build_job(cfg)
    assert job.cluster.gpus_per_instance in instance_sizes(job.cluster) and job.instance_plan
    with pytest.raises(ConfigError, match="a batch job runs the instances it is given"):
        _instances_given(build_setup(cfg))
