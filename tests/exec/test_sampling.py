"""Sampling and stop conditions: a sequence's tokens must not depend on the batch it ran in."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.exec import sampling
from batchgen.exec.sampling import SamplingParams, filtered_scaled_logits, noise_key, sample
from batchgen.exec.stopping import EOS, LENGTH, STOP_STRING, STOP_TOKEN, StopChecker

V = 64


def random_logits(batch, vocab=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def repeat_rows(row, n):
    return row.expand(n, -1).clone()


def draws(logits_row, params, n, seq_id=0, start=0):
    """n successive draws of one sequence, as one batch of n rows (one per step)."""
    return sample(repeat_rows(logits_row[None], n), [params] * n, [seq_id] * n, torch.arange(start, start + n))


# ------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = random_logits(16)
    logits[3, [5, 9, 40]] = 100.0  # a three-way tie
    params = [SamplingParams(temperature=0)] * 16
    out = sample(logits, params, list(range(16)), [0] * 16)
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(dim=1).tolist()
    assert out[3] == 5


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(32, seed=1)
    logits[0, [7, 2]] = 50.0
    temps = [0.3, 1.0, 5.0, 100.0] * 8
    params = [SamplingParams(temperature=t, top_k=1, seed=s) for t, s in zip(temps, range(32))]
    greedy = sample(logits, [SamplingParams(temperature=0)] * 32, range(32), [0] * 32)
    assert sample(logits, params, range(32), torch.arange(32)).tolist() == greedy.tolist()
    assert greedy[0] == 2


# ------------------------------------------------------------------------------ batch independence

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 3, 20, V, 1000]),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(params_strategy, st.integers(0, 10**6), st.integers(0, 10**4)),
                     min_size=1, max_size=12),
       logits_seed=st.integers(0, 1000), data=st.data())
def test_each_row_is_independent_of_batch_composition_and_order(rows, logits_seed, data):
    logits = random_logits(len(rows), seed=logits_seed)
    params, ids, steps = (list(c) for c in zip(*rows))
    full = sample(logits, params, ids, torch.tensor(steps), job_seed=7)
    order = data.draw(st.permutations(range(len(rows))))
    subset = order[:data.draw(st.integers(1, len(rows)))]
    part = sample(logits[subset], [params[i] for i in subset], [ids[i] for i in subset],
                  [steps[i] for i in subset], job_seed=7)
    assert part.tolist() == [full[i].item() for i in subset]
    alone = [sample(logits[i:i + 1], [params[i]], [ids[i]], [steps[i]], job_seed=7).item() for i in subset]
    assert alone == part.tolist()


def test_same_key_same_token_and_seeded_draws_ignore_the_sequence_id():
    row = random_logits(1, seed=3)[0]
    p = SamplingParams(temperature=1.0, seed=1234)
    a = draws(row, p, 50, seq_id=1)
    b = draws(row, p, 50, seq_id=999)
    assert a.tolist() == b.tolist()  # an explicit seed reproduces the request under any id
    assert draws(row, p, 10, start=20).tolist() == a[20:30].tolist()  # resuming replays the same draws


def test_unseeded_sequences_use_job_seed_and_id():
    row = random_logits(1, seed=4, scale=0.1)[0]  # close to uniform: draws rarely agree by chance
    p = SamplingParams(temperature=1.0)
    base = draws(row, p, 200, seq_id=5)
    assert draws(row, p, 200, seq_id=5).tolist() == base.tolist()
    assert agreement(base, draws(row, p, 200, seq_id=6)) < 0.1
    job2 = sample(repeat_rows(row[None], 200), [p] * 200, [5] * 200, torch.arange(200), job_seed=1)
    assert agreement(base, job2) < 0.1


def agreement(a, b):
    return (a == b).float().mean().item()


def test_different_seeds_differ():
    row = random_logits(1, seed=5, scale=0.1)[0]
    runs = [draws(row, SamplingParams(seed=s), 300) for s in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert agreement(runs[i], runs[j]) < 0.1  # expected about 1/V
    assert len(set(runs[0].tolist())) > V // 2


def test_noise_keys_are_distinct_across_ids_steps_and_seeds():
    p = SamplingParams()
    keys = {noise_key(p, i, t) for i in range(50) for t in range(50)}
    keys |= {noise_key(SamplingParams(seed=s), 0, t) for s in range(50) for t in range(50)}
    assert len(keys) == 5000


# ------------------------------------------------------------------------------------------ support


def known_logits(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_stays_in_support(k):
    row = random_logits(1, seed=6, scale=1.0)[0]
    support = set(row.topk(k).indices.tolist())
    out = draws(row, SamplingParams(temperature=2.0, top_k=k, seed=0), 2000)
    assert set(out.tolist()) == support


@pytest.mark.parametrize("top_p, support", [(0.3, {0}), (0.5, {0, 1}), (0.65, {0, 1}), (0.8, {0, 1, 2}),
                                            (0.95, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, support):
    row = known_logits([0.4, 0.25, 0.2, 0.1, 0.05])
    out = draws(row, SamplingParams(top_p=top_p, seed=1), 3000)
    assert set(out.tolist()) == support


def test_top_p_applies_after_top_k_on_the_renormalised_distribution():
    row = known_logits([0.3, 0.3, 0.2, 0.1, 0.1])
    # after top_k=3: [0.375, 0.375, 0.25]; top_p=0.7 keeps the first two (0.375 < 0.7 <= 0.75)
    out = draws(row, SamplingParams(top_k=3, top_p=0.7, seed=2), 2000)
    assert set(out.tolist()) == {0, 1}


def test_filtering_is_per_row_in_a_mixed_batch():
    row = known_logits([0.4, 0.25, 0.2, 0.1, 0.05])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(), SamplingParams(top_k=1)]
    x = filtered_scaled_logits(repeat_rows(row[None], 4), params)
    kept = [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in x]
    assert kept == [{0, 1}, {0, 1}, {0, 1, 2, 3, 4}, {0}]


def test_ties_at_the_cut_are_kept():
    row = known_logits([0.3, 0.2, 0.2, 0.2, 0.1])
    x = filtered_scaled_logits(row[None], [SamplingParams(top_k=2)])
    assert torch.isfinite(x[0]).tolist() == [True, True, True, True, False]


# ------------------------------------------------------------------------------------ distribution


def chi_square(counts, probs):
    n = counts.sum().item()
    expected = torch.tensor(probs, dtype=torch.float64) * n
    return (((counts.double() - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_frequencies_match_softmax(temperature):
    probs = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01]
    row = known_logits(probs)
    n = 20000
    out = draws(row, SamplingParams(temperature=temperature, seed=11), n)
    target = torch.softmax(row / temperature, dim=0).tolist()
    stat = chi_square(torch.bincount(out, minlength=len(probs)), target)
    assert stat < 26.0, stat  # chi-square, 7 degrees of freedom: p = 0.0005


def test_empirical_frequencies_with_top_k_and_top_p():
    probs = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01]
    row = known_logits(probs)
    out = draws(row, SamplingParams(top_k=6, top_p=0.7, seed=12), 20000)
    # top_k=6 renormalises over 0.95; top_p=0.7 then keeps 0.3, 0.2, 0.15 (mass before: 0, .32, .53, .68)
    kept = torch.tensor(probs[:4]) / sum(probs[:4])
    stat = chi_square(torch.bincount(out, minlength=4), kept.tolist())
    assert stat < 17.7, stat  # 3 degrees of freedom: p = 0.0005


# ----------------------------------------------------------------------------------------- devices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_draw_the_same_tokens():
    n = 48
    logits = random_logits(n, vocab=32000, seed=13)
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[0, 50][i % 2],
                             top_p=[1.0, 0.9, 0.95][i % 3], seed=i if i % 5 else None) for i in range(n)]
    steps = torch.arange(n) * 3
    cpu = sample(logits, params, range(n), steps, job_seed=3)
    gpu = sample(logits.cuda(), params, range(n), steps.cuda(), job_seed=3)
    assert gpu.device.type == "cuda"
    assert gpu.cpu().tolist() == cpu.tolist()


# ------------------------------------------------------------------------------------------- stopping

PIECES = {0: "<eos>", 1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: "ST", 7: "O", 8: "P", 9: "x", 10: "<end>"}


def fake_decode(ids):
    return "".join("" if i in (0, 10) else PIECES[i] for i in ids)


def run(checker, tokens, decode=fake_decode):
    for step, t in enumerate(tokens):
        finish = checker.check(t, step, decode)
        if finish:
            return step, finish
    return None, None


def test_eos_stops_and_is_not_in_the_text():
    c = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=(0, 10))
    step, finish = run(c, [1, 2, 10, 3])
    assert (step, finish.reason, finish.text) == (2, EOS, "Hello")
    assert c.token_ids == [1, 2, 10]


def test_ignore_eos_keeps_going_until_length():
    c = StopChecker(SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(0,))
    step, finish = run(c, [1, 0, 2, 0, 5])
    assert (step, finish.reason, finish.text) == (3, LENGTH, "Hello")


def test_stop_token_even_with_ignore_eos():
    c = StopChecker(SamplingParams(max_tokens=10, stop_token_ids=(5,), ignore_eos=True), eos_token_ids=(0,))
    step, finish = run(c, [1, 2, 5, 3])
    assert (step, finish.reason, finish.text) == (2, STOP_TOKEN, "Hello")


def test_max_tokens_without_decode():
    c = StopChecker(SamplingParams(max_tokens=3), eos_token_ids=(0,))
    step, finish = run(c, [1, 2, 3, 4], decode=None)
    assert (step, finish.reason, finish.text) == (2, LENGTH, None)
    with pytest.raises(RuntimeError, match="already finished"):
        c.check(4, 3)


def test_eos_wins_over_length_on_the_same_token():
    c = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=(0,))
    assert run(c, [1, 0])[1].reason == EOS


def test_stop_string_over_three_tokens_is_cut_from_the_text():
    c = StopChecker(SamplingParams(max_tokens=20, stop=("STOP",)), eos_token_ids=(0,))
    step, finish = run(c, [1, 2, 6, 7, 8, 5])
    assert (step, finish.reason, finish.text) == (4, STOP_STRING, "Hello")


def test_text_after_the_stop_string_in_the_same_token_is_dropped():
    c = StopChecker(SamplingParams(max_tokens=20, stop=("lo w", "xyz")))
    step, finish = run(c, [1, 2, 3, 4])
    assert (step, finish.reason, finish.text) == (2, STOP_STRING, "Hel")


def test_earliest_stop_string_wins():
    c = StopChecker(SamplingParams(stop=("rld", "o wo")))
    assert run(c, [1, 2, 3, 4])[1].text == "Hell"


def test_stop_string_on_the_last_allowed_token_reports_stop_string():
    step, finish = run(StopChecker(SamplingParams(max_tokens=3, stop=("o wo",))), [1, 2, 3, 4])
    assert (step, finish.reason, finish.text) == (2, STOP_STRING, "Hell")


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9]), min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="HelowrdSTOPx! ", min_size=1, max_size=6), min_size=1, max_size=3))
def test_stop_strings_match_a_full_text_search(tokens, stops):
    c = StopChecker(SamplingParams(max_tokens=100, stop=tuple(stops)))
    step, finish = run(c, tokens)
    for i in range(len(tokens)):  # reference: search the whole text after every token
        text = fake_decode(tokens[:i + 1])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            assert (step, finish.reason, finish.text) == (i, STOP_STRING, text[:min(hits)])
            return
    assert finish is None and c.text == fake_decode(tokens)


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_incomplete_characters_wait_for_their_last_byte():
    word = list("café!".encode())  # é is two bytes, one token each
    c = StopChecker(SamplingParams(max_tokens=20, stop=("é!",)))
    texts = []
    for step, t in enumerate(word):
        finish = c.check(t, step, byte_decode)
        texts.append(c.text)
    assert "\ufffd" not in "".join(texts)
    assert (finish.reason, finish.text) == (STOP_STRING, "caf")


def test_length_flushes_a_partial_character():
    c = StopChecker(SamplingParams(max_tokens=4))
    _, finish = run(c, list("caf".encode()) + [0xC3], decode=byte_decode)
    assert (finish.reason, finish.text) == (LENGTH, "caf\ufffd")


def test_checker_rejects_misuse():
    c = StopChecker(SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="decode function is required"):
        c.check(1, 0)
    c = StopChecker(SamplingParams())
    c.check(1, 0, fake_decode)
    with pytest.raises(ValueError, match="expected step 1"):
        c.check(2, 0, fake_decode)
    with pytest.raises(ValueError, match="every call or on none"):
        c.check(2, 1)


# ----------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature must be >= 0 (0 = greedy), got -1"),
    ({"temperature": math.nan}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1] (1.0 = off), got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be an integer >= 0 (0 = off), got -2"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"seed": "abc"}, "seed must be an integer or None, got 'abc'"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"stop_token_ids": (3, -1)}, "stop_token_ids must be integers >= 0, got [-1]"),
    ({"stop": ("ok", "")}, "stop strings must be non-empty strings, got ['']"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
])
def test_invalid_params_are_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_params_normalise_sequences_to_tuples():
    p = SamplingParams(stop="END", stop_token_ids=[1, 2])
    assert p.stop == ("END",) and p.stop_token_ids == (1, 2)
    hash(p)


def test_sample_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(3), [SamplingParams()], [0], [0])
    with pytest.raises(ValueError, match="params has 1 entries but logits has 2 rows"):
        sample(torch.zeros(2, 4), [SamplingParams()], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="steps has 1 entries"):
        sample(torch.zeros(2, 4), [SamplingParams()] * 2, [0, 1], [0])


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat rows need the full sort, peaked ones do not
def test_top_p_head_shortcut_matches_a_full_sort(monkeypatch, scale):
    logits = random_logits(6, vocab=300, seed=14, scale=scale)
    params = [SamplingParams(top_p=p, top_k=k) for p, k in zip([0.3, 0.9, 0.99, 0.5, 0.95, 1.0],
                                                               [0, 0, 0, 100, 10, 0])]
    full = filtered_scaled_logits(logits, params)
    monkeypatch.setattr(sampling, "_TOP_P_HEAD", 16)
    assert torch.equal(filtered_scaled_logits(logits, params), full)
