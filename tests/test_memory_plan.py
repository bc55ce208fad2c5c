"""The memory plan at start (seeupo_gym/training/memory_plan.py): its counts against the real
models, its estimates against what an H200 measured, and the one-line refusals of runs that
cannot fit or whose device is missing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seeupo_gym.training import memory_plan
from seeupo_gym.training.cli import train_main
from seeupo_gym.training.config import ConfigError, load_config
from seeupo_gym.training.memory_plan import (
    GIB,
    KNOWN_SHAPES,
    DeviceError,
    ModelShape,
    activation_bytes,
    device_check,
    model_shape,
    plan_memory,
    suggestion,
)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


# --------------------------------------------------------------------------- counts


def test_the_tiny_shape_counts_the_real_tiny_models_parameters():
    from seeupo_gym.agents.models import build_tiny

    model, _ = build_tiny()
    real = sum(p.numel() for p in model.parameters())
    assert KNOWN_SHAPES["tiny"].num_parameters() == real
    assert ModelShape.from_hf_config(model.config.to_dict()) == KNOWN_SHAPES["tiny"]


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B", "Qwen/Qwen3-14B", "embedded"])
def test_known_shapes_count_what_transformers_builds(name):
    # An independent count: transformers builds the architecture on the meta device (no memory).
    from transformers import AutoConfig, AutoModelForCausalLM

    s = KNOWN_SHAPES[name]
    config = AutoConfig.for_model(
        "qwen3" if s.qk_norm else "qwen2", vocab_size=s.vocab_size, hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size, num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, tie_word_embeddings=s.tied_embeddings,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert s.num_parameters() == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(config.to_dict()) == s


@pytest.mark.parametrize("lora", [{"r": 4}, {"r": 8, "target_modules": ["q_proj", "v_proj"]}, {"r": 4, "last_layers": 1}])
def test_lora_trainable_parameters_match_peft(lora):
    from seeupo_gym.agents.models import load_model

    model, _ = load_model("tiny", lora={"alpha": 8, **lora})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = KNOWN_SHAPES["tiny"]
    assert shape.lora_parameters(lora["r"], lora.get("target_modules", "all-linear"), lora.get("last_layers")) == trainable


def test_a_local_folders_config_json_is_read_and_a_moe_is_not_guessed(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}))
    shape, source = model_shape(str(tmp_path))
    assert shape == ModelShape(256, 512, 3, 4, 2, 64, 1000, True) and source.endswith("config.json")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_experts": 8}))
    shape, source = model_shape(str(tmp_path))
    assert shape is None and "mixture-of-experts" in source


# --------------------------------------------------------------------------- calibration
# Tolerance: every estimate within 20% of an H200 figure, on the side that matters for a refusal
# (a run measured out of memory is estimated above the card).


def _bench_plan(shape: str, lora: int, checkpointing: bool) -> float:
    """GiB the plan gives the GPU probe's update bench (docs/training.md, "Memory plan"): bf16, 16k-token
    micro-batches, plus the bench's own snapshot of the trainable weights (it restores them per run)."""
    overrides = ["model.dtype=bfloat16", f"model.gradient_checkpointing={checkpointing}",
                 "model.max_tokens_per_microbatch=16384", "env.max_context_tokens=4096"]
    if lora:
        overrides.append(f"model.lora={{r: {lora}, alpha: {2 * lora}}}")
    s = KNOWN_SHAPES[shape]
    plan = plan_memory(load_config(None, overrides), s, device="cuda")
    snapshot = 2 * (s.lora_parameters(lora) if lora else s.num_parameters())
    return (plan.total + snapshot) / GIB


@pytest.mark.parametrize("shape, lora, checkpointing, low, high", [
    ("Qwen/Qwen2.5-1.5B", 0, False, 85, 85),  # full fine-tuning, 32 trajectories: 85 GiB peak
    ("Qwen/Qwen2.5-1.5B", 0, True, 22, 28),  # + gradient checkpointing: 22-28 GiB
    ("Qwen/Qwen2.5-7B", 32, True, 25, 27),  # LoRA r=32 + checkpointing, 8 trajectories: 25-27 GiB
])
def test_the_plan_meets_the_h200_update_peaks_within_20_percent(shape, lora, checkpointing, low, high):
    estimate = _bench_plan(shape, lora, checkpointing)
    assert 0.8 * low <= estimate <= 1.2 * high, estimate


def test_the_plan_puts_7b_lora_without_checkpointing_above_the_card_it_ran_out_of():
    assert _bench_plan("Qwen/Qwen2.5-7B", 32, False) > 139  # measured: out of memory at 139 GiB


# scripts/memory_calibration.py on one H200 (torch 2.11, transformers 5.17, bf16): one packed micro-batch's
# forward + backward, peak above the weights (GiB), gradients included.
MEASURED_MICROBATCHES = [
    # shape, LoRA r, checkpointing, tokens, sequences packed, peak GiB
    ("Qwen/Qwen2.5-1.5B", 0, False, 2048, 1, 7.75),
    ("Qwen/Qwen2.5-1.5B", 0, False, 8192, 4, 28.82),
    ("Qwen/Qwen2.5-1.5B", 0, False, 16384, 7, 62.62),
    ("Qwen/Qwen2.5-1.5B", 0, True, 8192, 4, 4.16),
    ("Qwen/Qwen2.5-1.5B", 0, True, 16384, 7, 5.87),
    ("Qwen/Qwen2.5-7B", 32, False, 2048, 1, 17.83),
    ("Qwen/Qwen2.5-7B", 32, False, 8192, 4, 75.56),
    ("Qwen/Qwen2.5-7B", 32, True, 8192, 4, 5.24),
    ("Qwen/Qwen2.5-7B", 32, True, 16384, 7, 10.73),
]


@pytest.mark.parametrize("shape, lora, checkpointing, tokens, sequences, measured", MEASURED_MICROBATCHES)
def test_activation_estimates_meet_measured_microbatches(shape, lora, checkpointing, tokens, sequences, measured):
    s = KNOWN_SHAPES[shape]
    gradients = 2 * (s.lora_parameters(lora) if lora else s.num_parameters())
    estimate = (activation_bytes(s, tokens, gradient_checkpointing=checkpointing, dtype_bytes=2, lora_r=lora or None,
                                 packed=sequences > 1, head_trains=not lora) + gradients) / GIB
    # Never under by more than 10%; over by up to 50% where full fine-tuning's gradients are not
    # all allocated yet at the peak (small micro-batches, checkpointing).
    assert 0.9 * measured <= estimate <= 1.5 * measured, estimate


def test_checkpointing_and_a_smaller_budget_shrink_the_activations():
    s = KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    full = activation_bytes(s, 16384, gradient_checkpointing=False, dtype_bytes=2)
    assert activation_bytes(s, 16384, gradient_checkpointing=True, dtype_bytes=2) < full / 8
    assert activation_bytes(s, 8192, gradient_checkpointing=False, dtype_bytes=2) < full / 2


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", ["paper-bfcl", "paper-appworld", "bfcl-seeupo", "appworld-seeupo"])
def test_gpu_presets_load_with_gradient_checkpointing_on(preset):
    assert load_config(preset).model.gradient_checkpointing is True


@pytest.mark.parametrize("preset", ["paper-bfcl", "paper-appworld"])
def test_paper_presets_need_cuda_and_vllm_and_fit_eight_sharded_gpus(preset):
    config = load_config(preset)
    assert (config.train.device, config.generation.backend) == ("cuda", "vllm")
    shape = model_shape(config.model.name_or_path)[0]
    one = plan_memory(config, shape, device="cuda")
    assert one.total > 139 * GIB  # full fine-tuning of 14B on one H200: no
    assert "LoRA" in suggestion(config, shape, 132 * GIB, device="cuda")
    assert plan_memory(config, shape, device="cuda", processes=8, sharded=True).total < 80 * GIB


# --------------------------------------------------------------------------- refusals


def test_a_run_beyond_its_budget_is_refused_in_one_line_naming_what_would_fit():
    config = load_config("tiny-cpu", ["model.memory_budget_gib=0.05"])
    with pytest.raises(DeviceError) as refused:
        device_check(config, device="cpu")
    line = str(refused.value)
    assert "\n" not in line and "does not fit" in line and "of 0.05 GiB" in line
    assert "model.memory_budget_gib" in line
    # The control: the same run with room passes and logs its plan.
    roomy = dataclasses.replace(config, model=dataclasses.replace(config.model, memory_budget_gib=8.0))
    assert device_check(roomy, device="cpu").fits


def _between(config, shape, change, device="cuda"):
    """A budget the config misses and the changed config meets."""
    before = plan_memory(config, shape, device=device).total
    after = plan_memory(change(config), shape, device=device).total
    assert after < before
    return (before + after) // 2


def _with(config, **model):
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model))


def test_the_suggestion_is_a_setting_under_which_the_plan_fits():
    shape = KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    config = load_config(None, ["model.dtype=bfloat16", "model.max_tokens_per_microbatch=16384", "env.max_context_tokens=2048"])
    budget = _between(config, shape, lambda c: _with(c, gradient_checkpointing=True))
    assert suggestion(config, shape, budget, device="cuda") == "turn on model.gradient_checkpointing"
    checkpointed = _with(config, gradient_checkpointing=True)
    budget = _between(checkpointed, shape, lambda c: _with(c, max_tokens_per_microbatch=4096))
    fix = suggestion(checkpointed, shape, budget, device="cuda")
    tokens = int(fix.rsplit("<= ", 1)[1])
    assert fix.startswith("set model.max_tokens_per_microbatch <= ") and 4096 <= tokens < 16384
    assert plan_memory(_with(checkpointed, max_tokens_per_microbatch=tokens), shape, device="cuda").total <= budget


def test_the_budget_comes_from_the_environment_when_the_config_names_none(monkeypatch):
    config = load_config("tiny-cpu")
    monkeypatch.setenv(memory_plan.BUDGET_ENV, "0.05")
    with pytest.raises(DeviceError, match=r"\$SEEUPO_MEMORY_BUDGET_GIB"):
        device_check(config, device="cpu")
    monkeypatch.setenv(memory_plan.BUDGET_ENV, "lots")
    with pytest.raises(ConfigError, match="GiB as a number"):
        device_check(config, device="cpu")
    monkeypatch.delenv(memory_plan.BUDGET_ENV)
    assert device_check(_with(config, memory_check="off", memory_budget_gib=0.05), device="cpu") is None


def test_the_trainer_refuses_before_it_makes_a_run_folder(tmp_path):
    from seeupo_gym.training.trainer import Trainer

    out = tmp_path / "run"
    config = load_config("smoke", ["model.memory_budget_gib=0.05", f"log.output_dir={out}", "log.trackers=[]"])
    with pytest.raises(DeviceError, match="does not fit"):
        Trainer(config)
    assert not out.exists()


def _one_line_refusal(capsys, argv):
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("seeupo-train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_seeupo_train_refuses_a_run_that_cannot_fit_in_one_line(capsys, tmp_path):
    line = _one_line_refusal(capsys, ["--config", "smoke", "--out", str(tmp_path / "run"), "model.memory_budget_gib=0.05"])
    assert line.startswith("seeupo-train: memory plan: tiny (full fine-tuning, float32) needs")
    assert not (tmp_path / "run").exists()


@no_cuda
def test_seeupo_train_refuses_a_14b_model_beyond_this_machines_memory_in_one_line(capsys, tmp_path, monkeypatch):
    # The paper's model with the CPU-side settings: the plan counts it before anything is fetched.
    monkeypatch.setenv(memory_plan.BUDGET_ENV, "24")  # a 24 GiB machine
    line = _one_line_refusal(capsys, ["--config", "paper-bfcl", "--out", str(tmp_path / "run"), "train.device=auto",
                                      "generation.backend=hf"])
    assert "Qwen/Qwen3-14B (full fine-tuning, bfloat16) needs" in line and "on cpu" in line
    assert "GPU machine" in line


@no_cuda
def test_seeupo_train_refuses_cuda_on_a_machine_without_it_in_one_line(capsys, tmp_path):
    line = _one_line_refusal(capsys, ["--config", "paper-bfcl", "--out", str(tmp_path / "run")])
    assert "train.device is cuda but this machine has no CUDA GPU" in line


def test_seeupo_train_refuses_the_vllm_backend_without_vllm_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(memory_plan, "vllm_installed", lambda: False)  # replaces the real lookup
    line = _one_line_refusal(capsys, ["--config", "smoke", "--out", str(tmp_path / "run"), "generation.backend=vllm"])
    assert "generation.backend is vllm but vLLM is not installed" in line and "generation.backend=hf" in line


@no_cuda
def test_seeupo_train_refuses_a_cuda_build_of_vllm_on_a_cpu_machine_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(memory_plan, "vllm_installed", lambda: True)  # replaces the real lookup
    monkeypatch.setattr(memory_plan, "_vllm_is_cpu_build", lambda: False)
    line = _one_line_refusal(capsys, ["--config", "smoke", "--out", str(tmp_path / "run"), "generation.backend=vllm"])
    assert "no CUDA GPU and the installed vLLM is a CUDA build" in line


def test_the_cuda_budget_is_the_free_memory_less_a_reserve_and_an_awake_vllms_share(monkeypatch):
    # torch.cuda.mem_get_info replaced by a fake 100 GiB device with 90 GiB free (no GPU needed).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (90 * GIB, 100 * GIB))
    budget, source = memory_plan.device_budget(load_config("tiny-cpu"), "cuda")
    assert budget == 85 * GIB and "free on the GPU" in source
    awake = load_config("tiny-cpu", ["generation.backend=vllm", "generation.sleep_level=0",
                                     "generation.gpu_memory_utilization=0.3"])
    assert memory_plan.device_budget(awake, "cuda")[0] == 55 * GIB


# --------------------------------------------------------------------------- the colocated vLLM, --plan-only


def _plan_only(capsys, *args):
    code = train_main(["--plan-only", *args])
    return code, capsys.readouterr().out


def test_plan_only_names_vllms_share_against_the_weights_of_paper_bfcl_on_one_80_gib_gpu(capsys):
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "1", "--gpu-memory", "80")
    assert code == 2 and out.splitlines()[-1] == "plan: does not fit"
    engine = next(line for line in out.splitlines() if "vLLM's share" in line)
    # 0.3 x 80 GiB against Qwen3-14B's 14.77e9 bf16 parameters (27.5 GiB) and one 18000-token sequence
    # of KV cache: 2 (k, v) x 40 layers x 8 KV heads x 128 x 2 bytes = 160 KiB a token, 2.7 GiB
    assert "vLLM's share 0.3 x 80.0 GiB = 24.0 GiB per GPU against the weights 27.5 GiB" in engine
    assert "KV cache of one 18000-token sequence 2.7 GiB" in engine
    assert engine.endswith("does not fit; set generation.gpu_memory_utilization=0.45")
    assert "learner: ~154.8 GiB" in out and "use LoRA" in out


def test_the_utilization_the_plan_names_fits_with_lora(capsys):
    lora = "model.lora={r: 16, alpha: 32}"
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "1", "--gpu-memory", "80", lora)
    assert code == 2 and "learner: ~44.0 GiB" in out and ": fits" in out  # the learner fits; vLLM's share does not
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "1", "--gpu-memory", "80", lora,
                           "generation.gpu_memory_utilization=0.45")
    assert code == 0 and out.splitlines()[-1] == "plan: fits"


def test_the_engine_counts_weights_and_kv_cache_per_tensor_parallel_rank():
    config = load_config("paper-bfcl")
    shape = KNOWN_SHAPES["Qwen/Qwen3-14B"]
    one = memory_plan.engine_plan(config, shape, 80 * GIB)
    assert one.weights == shape.num_parameters() * 2 and one.kv_cache == 2 * 40 * 8 * 128 * 2 * 18000
    two = memory_plan.engine_plan(config, shape, 80 * GIB, tensor_parallel=2)
    assert two.weights == one.weights // 2 and two.kv_cache == one.kv_cache // 2
    # 16 ranks over 8 KV heads: each rank keeps a whole head
    assert memory_plan.engine_plan(config, shape, 80 * GIB, tensor_parallel=16).kv_cache == one.kv_cache // 8


def test_where_no_utilization_fits_beside_the_learner_the_plan_names_tensor_parallelism(capsys):
    # 48 GiB GPUs: LoRA's resident 27.7 GiB leaves no share that holds 27.5 GiB of weights; four ranks do
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "4", "--gpu-memory", "48", "model.lora={r: 16, alpha: 32}")
    assert code == 2
    assert "set generation.tensor_parallel_size=4 (one training process over 4 GPUs) with generation.gpu_memory_utilization=0.3" in out
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "4", "--gpu-memory", "48", "model.lora={r: 16, alpha: 32}",
                           "generation.tensor_parallel_size=4")
    assert code == 0, out


def test_an_awake_engine_that_crowds_out_the_learner_is_told_to_sleep(capsys):
    code, out = _plan_only(capsys, "--config", "paper-bfcl", "--gpus", "1", "--gpu-memory", "80", "model.lora={r: 16, alpha: 32}",
                           "generation.gpu_memory_utilization=0.45", "generation.sleep_level=0")
    assert code == 2 and "set generation.sleep_level=1 (vLLM gives its memory back while the learner trains)" in out


def test_plan_only_refuses_tensor_parallelism_beyond_its_gpus_in_one_line(capsys):
    code = train_main(["--plan-only", "--config", "paper-bfcl", "--gpus", "1", "generation.tensor_parallel_size=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "seeupo-train: bad config: generation.tensor_parallel_size=2 needs that many GPUs; --gpus is 1"


def test_plan_only_needs_no_gpu_and_loads_no_weights(capsys, monkeypatch):
    def no_cuda_call(*args):
        raise AssertionError("--plan-only asked the GPU")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda_call)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_cuda_call)
    code, out = _plan_only(capsys, "--config", "smoke", "--gpus", "2", "--gpu-memory", "24")
    assert code == 0 and out.startswith("memory plan: tiny (full fine-tuning, float32; shape from the table of known shapes)")


def test_on_cuda_the_check_at_start_refuses_a_share_that_cannot_hold_the_weights(monkeypatch):
    # torch.cuda replaced by a fake 80 GiB device, all free (no GPU needed)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (80 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = load_config("paper-bfcl", ["model.lora={r: 16, alpha: 32}"])
    with pytest.raises(DeviceError) as refused:
        device_check(config, device="cuda")
    line = str(refused.value)
    assert "\n" not in line and "vLLM's share 0.3 x 80.0 GiB = 24.0 GiB per GPU against the weights 27.5 GiB" in line
    assert "set generation.gpu_memory_utilization=0.45" in line
    roomy = load_config("paper-bfcl", ["model.lora={r: 16, alpha: 32}", "generation.gpu_memory_utilization=0.45"])
    assert device_check(roomy, device="cuda").fits  # the control
