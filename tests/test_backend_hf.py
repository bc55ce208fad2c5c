"""HFBackend on the tiny model: batched left-padded sampling, recorded logprobs, stops, seeds."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.agents.backends import Backend, HFBackend, SamplingParams
from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.scoring import response_logprobs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def backend(tiny):
    return HFBackend(*tiny)


def _prompts(lengths=(3, 11, 6, 1), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (n,), generator=generator).tolist() for n in lengths]


# Half the vocabulary stops: completions end at different steps, exercising the row pruning.
HALF_STOPS = tuple(range(0, 75_000))


def test_is_a_backend_with_the_contracts_hooks(tiny, backend):
    assert isinstance(backend, Backend)  # a subclass of the base class, not a structural match
    assert tiny[1].convert_tokens_to_ids("<|im_end|>") in backend.default_stop_token_ids
    backend.release_memory()  # the base class's no-ops: nothing to give back, nothing to close
    backend.close()
    completion = backend.generate(_prompts((3,)), SamplingParams(max_new_tokens=2, seed=0))[0]
    assert 1 <= len(completion.token_ids) <= 2


def test_recorded_logprobs_equal_teacher_forced_recomputation(tiny, backend):
    model, tokenizer = tiny
    prompts = _prompts()
    completions = backend.generate(prompts, SamplingParams(max_new_tokens=10, stop_token_ids=HALF_STOPS, seed=2))
    lengths = [len(c.token_ids) for c in completions]
    assert len(set(lengths)) > 1, "rows should finish at different steps"
    for completion in completions:
        assert len(completion.logprobs) == len(completion.token_ids)
        stopped = completion.token_ids[-1] in HALF_STOPS
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert all(t not in HALF_STOPS for t in completion.token_ids[:-1])
    recomputed, mask = response_logprobs(
        model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id
    )
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, : lengths[i]], torch.tensor(completion.logprobs), atol=1e-4)


def test_same_seed_same_completions_and_the_global_rng_is_untouched(backend):
    prompts = _prompts()
    sampling = SamplingParams(max_new_tokens=6, seed=7)
    state = torch.random.get_rng_state()
    first = backend.generate(prompts, sampling)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = backend.generate(prompts, sampling)
    other = backend.generate(prompts, SamplingParams(max_new_tokens=6, seed=8))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_greedy_picks_the_argmax_and_tiny_top_p_is_greedy(tiny, backend):
    model, _ = tiny
    prompt = _prompts((5,))[0]
    greedy = backend.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert greedy.token_ids[0] == int(logits.argmax())
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 4
    nucleus = backend.generate([prompt], SamplingParams(top_p=1e-6, max_new_tokens=4, seed=3))[0]
    assert nucleus.token_ids == greedy.token_ids


def test_temperature_logprobs_are_the_tempered_policy(tiny, backend):
    model, tokenizer = tiny
    prompts = _prompts((4, 7))
    completions = backend.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=5, seed=2))
    recomputed, _ = response_logprobs(
        model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id, temperature=0.7
    )
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, :5], torch.tensor(completion.logprobs), atol=1e-4)


def test_stop_strings_end_the_completion_at_the_token_that_completes_them(tiny, backend):
    _, tokenizer = tiny
    completions = backend.generate(_prompts(), SamplingParams(max_new_tokens=40, stop_strings=("e",), seed=5))
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    for completion in stopped:
        assert "e" in tokenizer.decode(completion.token_ids)
        assert "e" not in tokenizer.decode(completion.token_ids[:-1])


def test_update_weights_from_a_state_dict_changes_the_policy():
    model, tokenizer = load_model("tiny", seed=0)
    other, _ = load_model("tiny", seed=1)
    backend = HFBackend(model, tokenizer)
    prompts = _prompts((4,))
    sampling = SamplingParams(max_new_tokens=5, seed=4)
    reference = HFBackend(other, tokenizer).generate(prompts, sampling)[0]
    before = backend.generate(prompts, sampling)[0]
    backend.update_weights(model)  # the learner's own module: nothing to do
    assert backend.generate(prompts, sampling)[0] == before
    backend.update_weights(other.state_dict())
    after = backend.generate(prompts, sampling)[0]
    assert after.token_ids == reference.token_ids and after.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)


def test_sampling_in_eval_mode_and_restoring_train_mode(tiny):
    model, tokenizer = load_model("tiny", seed=0, lora={"r": 4, "alpha": 8, "dropout": 0.5})
    model.train()
    backend = HFBackend(model, tokenizer)
    prompts = _prompts((3, 5))
    completions = backend.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    assert model.training
    model.eval()
    recomputed, _ = response_logprobs(model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id)
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, :4], torch.tensor(completion.logprobs), atol=1e-4)


def test_bad_requests_are_refused(backend):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[1, 2], []], SamplingParams())
    assert backend.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_per_row_prefill_matches_the_padded_batch_prefill(tiny):
    model, tokenizer = tiny
    prompts = _prompts((30, 4, 17))
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=HALF_STOPS, seed=9)
    per_row = HFBackend(model, tokenizer, prefill_per_row=True).generate(prompts, sampling)
    padded = HFBackend(model, tokenizer, prefill_per_row=False).generate(prompts, sampling)
    for a, b in zip(per_row, padded):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


# ----------------------------------------------------------------------------- prefix reuse


def _episodes(backend, prompt, group_size=3, turns=3, seed=0):
    """G rollouts of one prompt over `turns` turns; each turn appends the response and a fixed delta."""
    deltas = _prompts((20,) * turns, seed=seed + 1)
    prompts = [list(prompt)] * group_size
    calls = []
    for turn in range(turns):
        completions = backend.generate(prompts, SamplingParams(max_new_tokens=8, stop_token_ids=HALF_STOPS, seed=turn))
        calls.append((prompts, completions))
        prompts = [p + c.token_ids + deltas[turn] for p, c in zip(prompts, completions)]
    return calls


@pytest.fixture
def count_fed_tokens(tiny):
    model, _ = tiny
    fed = []
    handle = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].numel()), with_kwargs=True)
    yield fed
    handle.remove()


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row prefill", "batched prefill"])
def test_prefix_cached_and_uncached_generation_give_identical_tokens_and_logprobs(tiny, per_row):
    model, tokenizer = tiny
    prompt = _prompts((64,))[0]
    cached = _episodes(HFBackend(model, tokenizer, prefill_per_row=per_row), prompt)
    uncached = _episodes(HFBackend(model, tokenizer, prefill_per_row=per_row, prefix_cache_bytes=0), prompt)
    for (prompts, with_cache), (_, without_cache) in zip(cached, uncached):
        assert [c.token_ids for c in with_cache] == [c.token_ids for c in without_cache]
        assert [c.finish_reason for c in with_cache] == [c.finish_reason for c in without_cache]
        for a, b in zip(with_cache, without_cache):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # same math, other chunking
        recomputed, _ = response_logprobs(model, prompts, [c.token_ids for c in with_cache], pad_token_id=tokenizer.pad_token_id)
        for i, completion in enumerate(with_cache):
            assert torch.allclose(recomputed[i, : len(completion.token_ids)], torch.tensor(completion.logprobs), atol=1e-5)


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row prefill", "batched prefill"])
def test_a_group_prefills_its_prompt_once_and_later_turns_feed_only_what_is_new(tiny, count_fed_tokens, per_row):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, prefill_per_row=per_row)
    deltas = _prompts((20, 20), seed=1)
    prompts = [_prompts((64,))[0]] * 3
    fed, new = [], []
    for turn in range(3):
        count_fed_tokens.clear()
        completions = backend.generate(prompts, SamplingParams(max_new_tokens=8, stop_token_ids=HALF_STOPS, seed=turn))
        fed.append(sum(count_fed_tokens))
        # Decoding feeds every sampled token but the last.
        new.append(sum(len(c.token_ids) - 1 for c in completions))
        prompts = [p + c.token_ids + deltas[turn] for p, c in zip(prompts, completions)] if turn < 2 else prompts
    # Turn 1: the prompt once, then only its last token for the two other rollouts. Later turns:
    # each rollout's last sampled token (never fed before) and the 20-token delta.
    assert fed == [64 + 2 + new[0], 3 * (1 + 20) + new[1], 3 * (1 + 20) + new[2]]


def test_the_prefix_cache_stays_within_its_bound_and_still_gives_the_same_samples(tiny):
    model, tokenizer = tiny
    per_token = 2 * 2 * 1 * 32 * 4  # layers x (keys, values) x kv heads x head_dim x fp32 bytes
    bound = 250 * per_token  # about two of the three rollouts' contexts
    backend = HFBackend(model, tokenizer, prefix_cache_bytes=bound)
    prompt = _prompts((64,))[0]
    bounded = _episodes(backend, prompt)
    assert backend.prefix_cache.peak_bytes <= bound
    assert 0 < backend.prefix_cache.nbytes <= bound
    unbounded = _episodes(HFBackend(model, tokenizer, prefix_cache_bytes=0), prompt)
    assert [[c.token_ids for c in completions] for _, completions in bounded] == [
        [c.token_ids for c in completions] for _, completions in unbounded
    ]


def test_a_prompt_one_token_off_a_cached_one_samples_as_without_the_cache(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    prompt = _prompts((64,))[0]
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    backend.generate([prompt], sampling)
    for position in (0, 17, 40, 62):
        near = list(prompt)
        near[position] = (near[position] + 1) % 150_000
        with_cache = backend.generate([near], sampling)[0]
        without_cache = HFBackend(model, tokenizer, prefix_cache_bytes=0).generate([near], sampling)[0]
        assert with_cache.token_ids == without_cache.token_ids
        assert with_cache.logprobs == pytest.approx(without_cache.logprobs, abs=1e-5)


def test_weight_changes_empty_the_prefix_cache():
    model, tokenizer = load_model("tiny", seed=0)
    backend = HFBackend(model, tokenizer)
    prompt = _prompts((64,))[0]
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    backend.generate([prompt], sampling)
    assert len(backend.prefix_cache) == 1
    backend.update_weights(model)  # the learner's own module, updated in place
    assert len(backend.prefix_cache) == 0
    backend.generate([prompt], sampling)
    # An in-place edit (as an optimizer step makes) the backend is not told about: the states
    # computed before it are not served.
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    after = backend.generate([prompt], sampling)[0]
    fresh = HFBackend(model, tokenizer, prefix_cache_bytes=0).generate([prompt], sampling)[0]
    assert after.token_ids == fresh.token_ids
    assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)


# ----------------------------------------------------------------------------- transformers releases


def test_generate_and_submit_continue_the_kv_cache_on_the_installed_transformers(tiny):
    """Under every transformers release in the declared range (the lowest-versions run installs
    5.17, where the KV cache is `past_key_values`; later 5.x call it `cache`): both paths return
    completions, and a later turn served from the prefix cache records the logprobs a fresh
    teacher-forced forward computes. A cache handed under a name the model ignores would decode
    without context, and these logprobs would differ."""
    import transformers

    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    first = _prompts((40,))[0]
    sampling = SamplingParams(max_new_tokens=5, seed=4)
    (turn1,) = backend.generate([first], sampling)
    second = first + turn1.token_ids + _prompts((7,), seed=5)[0]
    (turn2,) = backend.generate([second], sampling)
    submitted = [backend.submit(p, sampling).result(timeout=120) for p in (first, second)]
    backend._engine.close(timeout=60)
    for prompt, completion in [(first, turn1), (second, turn2), (first, submitted[0]), (second, submitted[1])]:
        assert 1 <= len(completion.token_ids) <= 5, transformers.__version__
        recomputed, _ = response_logprobs(model, [prompt], [completion.token_ids], pad_token_id=tokenizer.pad_token_id)
        assert torch.allclose(recomputed[0], torch.tensor(completion.logprobs), atol=1e-4), transformers.__version__
    assert submitted[0].token_ids == turn1.token_ids  # the same seed samples the same tokens on both paths


def test_inverse_cdf_picks_by_cumulative_mass_across_blocks_and_the_ragged_tail():
    from seeupo_gym.agents.backends.hf import inverse_cdf

    # vocab 2500 = two full blocks of 1024 and a tail of 452; unnormalized weights.
    probs = torch.zeros(4, 2500)
    probs[:, 1023] = 1.0  # last entry of block 0
    probs[:, 1024] = 1.0  # first entry of block 1
    probs[:, 2499] = 2.0  # last entry of the tail
    uniform = torch.tensor([[0.0], [0.2499], [0.2501], [0.9999]], dtype=torch.float64)
    # cumulative mass / total 4: 0.25 at 1023, 0.5 at 1024, 1.0 at 2499
    assert inverse_cdf(probs, uniform).tolist() == [1023, 1023, 1024, 2499]
    # A target at the very top (rounding) falls on the last entry with mass, never on a zero entry.
    assert inverse_cdf(probs[:1], torch.tensor([[1.0]], dtype=torch.float64)).tolist() == [2499]
    only_head = torch.zeros(1, 2500)
    only_head[0, 5] = 3.0
    assert inverse_cdf(only_head, torch.tensor([[1.0]], dtype=torch.float64)).tolist() == [5]
