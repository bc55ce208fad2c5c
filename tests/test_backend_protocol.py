"""The Backend base class: hooks with no-op defaults, each backend building itself for training,
and a trainer that names no backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from seeupo_gym.agents.backends import Backend, HFBackend, TrainingSetup, backend_class
from seeupo_gym.agents.models import load_model


def setup(**changes) -> TrainingSetup:
    values = dict(model_name="tiny", dtype="float32", seed=3, lora_rank=None, max_context_tokens=2048, processes=1,
                  sharded=False, options={"prefix_cache_mib": 2, "sleep_level": 1, "tensor_parallel_size": 1,
                                          "gpu_memory_utilization": 0.3, "max_model_len": None, "enforce_eager": True,
                                          "vllm_kwargs": {"swap_space": 0}})
    values.update(changes)
    return TrainingSetup(**values)


def test_a_backend_needs_generate_and_update_weights_and_gets_the_rest():
    class Partial(Backend):
        def generate(self, prompts, sampling):
            return []

    with pytest.raises(TypeError, match="update_weights"):
        Partial()

    class Minimal(Partial):
        def update_weights(self, state_dict_or_model):
            pass

    backend = Minimal()
    assert backend.default_stop_token_ids == () and backend.release_memory() is None and backend.close() is None
    with pytest.raises(NotImplementedError, match="Minimal cannot serve a training run"):
        Minimal.for_training(None, None, setup())


def test_hf_backend_builds_itself_for_training_on_the_trained_module():
    model, tokenizer = load_model("tiny", seed=0)
    backend = backend_class("hf").for_training(model, tokenizer, setup())
    assert isinstance(backend, HFBackend) and backend.model is model
    assert backend.prefix_cache is not None and backend.prefix_cache.max_bytes == 2 << 20


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match=r"unknown generation backend 'sglang'; choose one of \('hf', 'vllm', 'openai'\)"):
        backend_class("sglang")


def test_vllm_for_training_with_the_engine_replaced_builds_its_engine_from_the_setup(monkeypatch):
    """vLLM is not installed here: the engine's constructor and weight push are replaced to test
    what `for_training` derives from the run's settings (the engine itself runs in the GPU tests)."""
    from seeupo_gym.agents.backends import vllm

    built, pushed = {}, []
    monkeypatch.setattr(vllm.VLLMBackend, "__init__", lambda self, model, **kwargs: built.update(model=model, **kwargs))
    monkeypatch.setattr(vllm.VLLMBackend, "update_weights", lambda self, source: pushed.append(source))
    monkeypatch.setattr(vllm.torch.cuda, "is_available", lambda: False)
    sentinel = object()
    backend = backend_class("vllm").for_training(sentinel, "tok", setup(lora_rank=8))
    assert isinstance(backend, vllm.VLLMBackend) and pushed == [sentinel]
    assert built == {
        "model": "tiny", "tokenizer": "tok", "seed": 3, "enable_lora": True, "max_lora_rank": 8,
        "sleep_level": 0,  # no sleep mode on CPU
        "dtype": "float32", "max_model_len": 2048, "tensor_parallel_size": 1, "enforce_eager": True,
        "distributed_executor_backend": "uni", "swap_space": 0,
    }
    with pytest.raises(ValueError, match="sharded training"):
        backend_class("vllm").for_training(sentinel, "tok", setup(sharded=True))
    with pytest.raises(ValueError, match="single training process"):
        backend_class("vllm").for_training(sentinel, "tok", setup(processes=2, options={"tensor_parallel_size": 2}))


def test_the_trainer_names_no_backend():
    import seeupo_gym.training.trainer as trainer

    source = Path(trainer.__file__).read_text().lower()
    assert "vllm" not in source and "hfbackend" not in source and "getattr(self.backend" not in source
