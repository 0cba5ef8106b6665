"""Specs: derived sizes against published numbers, every shipped YAML loads, bad values fail clearly."""

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.specs import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    cluster_names,
    hardware_names,
    load_cluster,
    load_hardware,
    load_model,
    model_names,
)
from batchgen.specs.catalog import _conf_dir, cluster_from_config

# (model, published total params, published active params or None, relative tolerance)
PUBLISHED = [
    ("mixtral_8x7b", 46.7e9, 12.9e9, 0.02),
    ("mixtral_8x22b", 141e9, 39e9, 0.02),
    ("deepseek_v3", 671e9, 37e9, 0.02),
    ("deepseek_r1", 671e9, 37e9, 0.02),
    ("qwen3_30b_a3b", 30.5e9, 3.3e9, 0.03),
    ("qwen3_235b_a22b", 235e9, 22e9, 0.02),
    ("llama2_7b", 6.7e9, None, 0.02),
    ("llama3_70b", 70.6e9, None, 0.02),
    ("kimi_k2", 1.03e12, 32e9, 0.03),
]


@pytest.mark.parametrize("name,total,active,tol", PUBLISHED)
def test_param_counts_match_published_sizes(name, total, active, tol):
    m = load_model(name)
    assert m.total_params == pytest.approx(total, rel=tol)
    if active is not None:
        assert m.active_params_per_token == pytest.approx(active, rel=tol)
    else:
        assert m.active_params_per_token == m.total_params


def test_mixtral_layer_breakdown():
    m = load_model("mixtral_8x7b")
    assert m.attention_params_per_layer == 4096 * 4096 * 2 + 2 * 4096 * 1024
    assert m.expert_params == 3 * 4096 * 14336
    assert m.router_params == 4096 * 8
    assert (m.num_moe_layers, m.num_dense_layers) == (32, 0)


def test_deepseek_structure_and_weight_bytes():
    m = load_model("deepseek_v3")
    assert m.is_moe and (m.num_dense_layers, m.num_moe_layers) == (3, 58)
    assert m.weight_bytes == 1 and m.weight_bytes_total == pytest.approx(671e9, rel=0.02)
    # MLA projections: q_a + q_b, kv_a, kv_b, o
    assert m.attention_params_per_layer == (
        7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    )


def test_deepseek_r1_is_deepseek_v3():
    assert replace(load_model("deepseek_r1"), name="deepseek_v3") == load_model("deepseek_v3")


def test_kv_bytes_per_token():
    ds = load_model("deepseek_v3")
    assert ds.kv_bytes_per_token_per_layer == (512 + 64) * 2
    assert ds.kv_bytes_per_token == (512 + 64) * 2 * 61
    # The paper: a 2K-token DeepSeek-R1 sequence's MLA KV is 144 MB.
    assert load_model("deepseek_r1").kv_bytes_per_token * 2048 == pytest.approx(144e6, rel=0.01)
    llama = load_model("llama3_70b")
    assert llama.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert llama.kv_bytes_per_token == 320 * 1024


def test_attention_flops_per_pair():
    llama = load_model("llama3_70b")
    assert llama.attention_score_flops_decode == llama.attention_score_flops_prefill == 4 * 64 * 128
    ds = load_model("deepseek_v3")
    assert ds.attention_score_flops_decode == 2 * 128 * (2 * 512 + 64)
    assert ds.attention_score_flops_prefill == 2 * 128 * 192 + 2 * 128 * 128


def test_tiny_moe_is_small_fp32():
    m = load_model("tiny_moe")
    assert (m.num_layers, m.hidden_size, m.num_experts, m.top_k) == (4, 256, 8, 2)
    assert m.weight_bytes == m.kv_bytes == m.act_bytes == 4
    assert m.total_params < 20e6


# ---- every shipped YAML loads and is named after its file ----


@pytest.mark.parametrize("name", model_names())
def test_every_model_yaml_loads(name):
    assert load_model(name).name == name


@pytest.mark.parametrize("name", hardware_names())
def test_every_hardware_yaml_loads(name):
    hw = load_hardware(name)
    assert hw.name == name and hw.flops_bf16 > 0 and hw.hbm_bytes > 0 and hw.nvlink_bw > 0


@pytest.mark.parametrize("name", cluster_names())
def test_every_cluster_yaml_loads(name):
    c = load_cluster(name)
    assert c.name == name and c.num_instances * c.instance_size == c.num_gpus


def test_expected_files_are_shipped():
    assert {"mixtral_8x7b", "mixtral_8x22b", "deepseek_v3", "deepseek_r1", "kimi_k2", "qwen3_30b_a3b",
            "qwen3_235b_a22b", "tiny_moe", "llama2_7b", "llama3_70b"} <= set(model_names())
    assert {"h100", "h200", "h20", "a100_80g", "a5000", "rtx4090"} <= set(hardware_names())
    assert {"h100_8", "h200_8", "h20_8", "h20_16", "h20_128", "h100_64", "h100_128", "a5000_1",
            "a100_8"} <= set(cluster_names())


def test_every_yaml_names_its_source():
    root = _conf_dir(None)
    for group in ("model", "hardware", "cluster"):
        for path in (root / group).glob("*.yaml"):
            assert path.read_text().lstrip().startswith("#"), path


def test_hydra_composes_model_and_cluster_groups():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(_conf_dir(None).resolve()), version_base="1.3"):
        cfg = compose(config_name=None, overrides=["+model=deepseek_v3", "+cluster=h20_128", "cluster.num_gpus=8"])
    assert ModelSpec.from_dict(cfg.model) == load_model("deepseek_v3")
    c = cluster_from_config(cfg.cluster)
    assert (c.num_gpus, c.instance_size, c.num_instances, c.num_nodes) == (8, 8, 1, 1)


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match=r"unknown GPU 'h300': choose one of a100_80g, a5000, .*h100, h20, h200"):
        load_hardware("h300")
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'.*mixtral_8x7b"):
        load_model("gpt5")
    with pytest.raises(ValueError, match=r"unknown cluster 'nope'.*h20_128"):
        load_cluster("nope")


def test_conf_dir_argument_is_honoured(tmp_path: Path):
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "toy.yaml").write_text(
        "name: toy\nbf16_tflops: 1\nhbm_gb: 1\nhbm_gbs: 1\npcie_gbs: 1\n")
    assert hardware_names(tmp_path) == ["toy"]
    assert load_hardware("toy", tmp_path).nvlink_bw == 1e9  # no NVLink: PCIe
    assert model_names(tmp_path) == []


# ---- validation ----

TINY = load_model("tiny_moe").to_dict()


def bad_model(**changes) -> dict:
    return {**TINY, **changes}


@pytest.mark.parametrize("changes,message", [
    ({"num_layers": 0}, r"model.num_layers must be a positive integer, got 0"),
    ({"hidden_size": -1}, r"model.hidden_size must be a positive integer, got -1"),
    ({"num_layers": "four"}, r"model.num_layers must be an integer, got 'four' \(str\)"),
    ({"num_heads": True}, r"model.num_heads must be an integer, got True"),
    ({"weight_bytes": "2"}, r"model.weight_bytes must be a number"),
    ({"weight_bytes": 0}, r"model.weight_bytes must be positive, got 0: bytes per element"),
    ({"attention": "mha"}, r"model.attention must be 'gqa' or 'mla', got 'mha': MHA is 'gqa'"),
    ({"num_kv_heads": 3}, r"model.num_kv_heads must divide num_heads \(4\), got 3"),
    ({"top_k": 9}, r"model.top_k must be between 1 and num_experts \(8\), got 9"),
    ({"top_k": 0}, r"model.top_k must be between 1 and num_experts"),
    ({"num_experts": 0}, r"model.top_k must be 0 for a dense model"),
    ({"num_experts": 0, "top_k": 0, "intermediate_size": 0}, r"model.intermediate_size must be positive"),
    ({"first_dense_layers": 5}, r"model.first_dense_layers must be <= num_layers \(4\), got 5"),
    ({"attention": "mla"}, r"model.kv_lora_rank must be positive for attention='mla', got 0"),
    ({"attention": "mla", "kv_lora_rank": 64}, r"model.qk_rope_head_dim must be positive for attention='mla'"),
    ({"head_dim": 0}, r"model.head_dim must be positive for attention='gqa'"),
    ({"moe_intermediate_size": 0}, r"model.moe_intermediate_size must be positive for an MoE model"),
    ({"tie_embeddings": "no"}, r"model.tie_embeddings must be true or false"),
])
def test_model_validation_messages(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dict(bad_model(**changes))


def test_model_from_dict_rejects_unknown_and_missing_keys():
    message = r"unknown model field\(s\) n_experts; valid fields are: name, num_layers"
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dict(bad_model(n_experts=8))
    d = dict(TINY)
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"lacks required field\(s\) hidden_size"):
        ModelSpec.from_dict(d)


def test_dense_model_defaults():
    m = ModelSpec(name="d", num_layers=2, hidden_size=64, vocab_size=100, max_context=128, attention="gqa",
                  num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128, tie_embeddings=True)
    assert not m.is_moe and m.num_dense_layers == 2 and m.num_moe_layers == 0
    assert m.total_params == 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128)


H20 = load_hardware("h20")


@pytest.mark.parametrize("changes,message", [
    ({"bf16_tflops": 0}, r"hardware.bf16_tflops must be positive, got 0"),
    ({"hbm_gb": "96GB"}, r"hardware.hbm_gb must be a number, got '96GB'"),
    ({"fp8_tflops": -1}, r"hardware.fp8_tflops must be >= 0, got -1: use 0 if FP8 is unsupported"),
    ({"nvlink_gbs": -5}, r"hardware.nvlink_gbs must be >= 0"),
])
def test_hardware_validation_messages(changes, message):
    with pytest.raises(ValueError, match=message):
        HardwareSpec.from_dict({**H20.to_dict(), **changes})


def test_hardware_si_units():
    assert H20.flops_bf16 == 148e12 and H20.flops_fp8 == 296e12
    assert H20.hbm_bytes == 97871 * 2**20 and H20.hbm_bw == 4000e9
    assert H20.pcie_bw == 64e9 and H20.nvlink_bw == 450e9 and H20.network_bw == 25e9
    # without the driver's figure the data sheet's GB are read as GiB, as GPU memory is sold
    assert replace(H20, memory_mib=0.0).hbm_bytes == 96 * 2**30
    with pytest.raises(ValueError, match=r"unknown hardware field\(s\) tflops"):
        HardwareSpec.from_dict({**H20.to_dict(), "tflops": 1})


# ---- clusters ----


def cluster(**kw) -> ClusterSpec:
    base = dict(name="c", gpu="h20", num_gpus=16, gpus_per_node=8, gpus_per_instance=None,
                host_mem_gb_per_node=2000)
    return cluster_from_config({**base, **kw})


def test_h20_128_topology():
    c = load_cluster("h20_128")
    assert c.gpu == H20
    assert (c.num_nodes, c.node_size, c.instance_size, c.num_instances) == (16, 8, 64, 2)
    assert c.host_mem_bytes_per_node == 2e12
    assert [c.node_of(i) for i in (0, 7, 8, 127)] == [0, 0, 1, 15]
    assert [c.instance_of(i) for i in (0, 63, 64, 127)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"GPU index must be an integer in \[0, 128\), got 128"):
        c.node_of(128)


def test_instance_clamped_to_cluster_size():
    c = replace(load_cluster("h20_128"), num_gpus=8)
    assert (c.instance_size, c.num_instances, c.num_nodes) == (8, 1, 1)


def test_partial_node():
    c = cluster(num_gpus=4, gpus_per_instance=2)
    assert (c.num_nodes, c.node_size, c.instance_size, c.num_instances) == (1, 4, 2, 2)
    assert c.instance_of(3) == 1 and c.node_of(3) == 0


def test_single_gpu_rig():
    c = load_cluster("a5000_1")
    assert (c.num_gpus, c.num_nodes, c.num_instances) == (1, 1, 1) and c.host_mem_gb_per_node == 1000
    assert c.gpu.nvlink_bw == c.gpu.pcie_bw


@pytest.mark.parametrize("changes,message", [
    ({"num_gpus": 0}, r"cluster.num_gpus must be a positive integer, got 0"),
    ({"num_gpus": "8"}, r"cluster.num_gpus must be an integer, got '8'"),
    ({"num_gpus": 12}, r"cluster.num_gpus must be a multiple of gpus_per_node \(8\) when it spans nodes, got 12"),
    ({"num_gpus": 24, "gpus_per_instance": 16}, r"cluster.num_gpus must be divisible by the instance size \(16\)"),
    ({"num_gpus": 24, "gpus_per_instance": 12}, r"cluster.gpus_per_instance must be a whole number of nodes"),
    ({"num_gpus": 8, "gpus_per_instance": 3}, r"cluster.num_gpus must be divisible by the instance size \(3\)"),
    ({"gpus_per_instance": 0}, r"cluster.gpus_per_instance must be a positive integer or null, got 0"),
    ({"host_mem_gb_per_node": 0}, r"cluster.host_mem_gb_per_node must be positive, got 0"),
    ({"gpus_per_node": 0}, r"cluster.gpus_per_node must be a positive integer, got 0"),
    ({"gpu": "a5000", "gpus_per_node": 1, "num_gpus": 2}, r"cluster.gpu must have an inter-node network"),
    ({"gpu": "h300"}, r"unknown GPU 'h300': choose one of"),
    ({"gpus": 8}, r"unknown cluster field\(s\) gpus; valid fields are: name, gpu, num_gpus"),
])
def test_cluster_validation_messages(changes, message):
    with pytest.raises(ValueError, match=message):
        cluster(**changes)


def test_cluster_accepts_inline_hardware():
    c = cluster(gpu=H20.to_dict())
    assert c.gpu == H20 and c == cluster()


@given(nodes=st.integers(1, 16), node_size=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_node_and_instance_maps_are_consistent(nodes, node_size, data):
    num_gpus = nodes * node_size
    divisors = [s for s in range(1, num_gpus + 1)
                if num_gpus % s == 0 and (s % node_size == 0 or node_size % s == 0)]
    size = data.draw(st.sampled_from(divisors))
    c = cluster(gpu="h100", num_gpus=num_gpus, gpus_per_node=node_size, gpus_per_instance=size)
    assert c.num_nodes == nodes and c.num_instances * c.instance_size == num_gpus
    for g in range(num_gpus):
        assert 0 <= c.node_of(g) < c.num_nodes and 0 <= c.instance_of(g) < c.num_instances
    # an instance either lies inside one node or is made of whole nodes
    for inst in range(c.num_instances):
        gpus = [g for g in range(num_gpus) if c.instance_of(g) == inst]
        assert len(gpus) == c.instance_size
        node_ids = {c.node_of(g) for g in gpus}
        assert len(node_ids) == 1 or len(gpus) == len(node_ids) * node_size


def test_host_keeps_one_copy_of_replicated_weights_and_each_distinct_expert_shard():
    """A node's host memory is the source of truth for its GPUs' weights: replicated weights once, expert
    shards once each (two 4-GPU instances on one node share one copy of every expert)."""
    import dataclasses
    from batchgen.job import prepare
    from batchgen.memory import host_weight_bytes
    from conftest import make_job
    job = make_job("continuous", model="mixtral_8x7b", cluster="h100_8")
    lat = prepare(job).latency
    m = job.model
    experts = m.num_moe_layers * m.num_experts * m.expert_params * m.weight_bytes
    assert host_weight_bytes(m, lat, 8) == pytest.approx(m.weight_bytes_total, rel=1e-9)
    half = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_instance=4))
    lat4 = prepare(half).latency
    assert host_weight_bytes(m, lat4, 8) == pytest.approx(m.weight_bytes_total, rel=1e-9)
    assert host_weight_bytes(m, lat, 8) < lat.weight_bytes_per_rank() * 8 - 7 * (m.weight_bytes_total - experts) + 1
