"""The HF continuous engine's shape discipline, its one thread per process, and its diagnosis.

Real tiny model throughout. The padded shapes are CUDA's default; here they are switched on by
hand on the CPU (`padded_shapes=True`), the same code.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.backends.hf_engine import PREFILL_BLOCK, WIDTH_BLOCK, HFEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, sizes):
    return [tokenizer("story " * k)["input_ids"] for k in sizes]


def _engine(backend, **kwargs):
    backend._engine = HFEngine(backend, **kwargs)
    return backend._engine


@pytest.mark.parametrize("padded, width_block", [(True, WIDTH_BLOCK), (False, WIDTH_BLOCK), (False, 1)])
def test_padded_and_exact_shapes_sample_what_each_request_samples_alone(tiny, padded, width_block):
    """Rows of several lengths and temperatures that finish at different steps, a long prompt
    past one buffer block, and later turns served from the prefix cache: every request samples
    the tokens (and logprobs) a single-prompt `generate` samples with its seed."""
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, (3, 70, 11, 30, 5))
    samplings = [SamplingParams(max_new_tokens=n, seed=20 + i, temperature=t)
                 for i, (n, t) in enumerate(zip((9, 3, 17, 6, 12), (1.0, 0.7, 1.0, 0.0, 1.0)))]
    alone = [HFBackend(model, tokenizer).generate([p], s)[0] for p, s in zip(prompts, samplings)]
    backend = HFBackend(model, tokenizer)
    engine = _engine(backend, padded_shapes=padded, width_block=width_block)
    together = [f.result(timeout=120) for f in [engine.submit(p, s) for p, s in zip(prompts, samplings)]]
    for joined, single in zip(together, alone):
        assert joined.token_ids == single.token_ids
        assert joined.logprobs == pytest.approx(single.logprobs, abs=1e-5)
    assert engine.peak_rows == len(prompts)
    # A second turn of each: its prompt extends the first turn's context, served from the cache.
    later = [p + c.token_ids + [7, 8, 9] for p, c in zip(prompts, together)]
    again = [f.result(timeout=120) for f in [engine.submit(p, s) for p, s in zip(later, samplings)]]
    fresh = [HFBackend(model, tokenizer, prefix_cache_bytes=0).generate([p], s)[0] for p, s in zip(later, samplings)]
    assert [c.token_ids for c in again] == [c.token_ids for c in fresh]
    engine.close(timeout=60)


def test_padded_shapes_give_the_attention_a_bounded_set_of_shapes(tiny, monkeypatch):
    """With padded shapes every attention call (prefill or decode) has a power-of-two batch and
    a key width of whole blocks: a handful of shapes where exact ones make a new shape per step."""
    import torch.nn.functional as F

    model, tokenizer = tiny
    sdpa = F.scaled_dot_product_attention

    def shapes(padded):
        seen = []

        def recorded(query, key, value, *args, **kwargs):
            seen.append((query.shape[0], query.shape[-2], key.shape[-2]))
            return sdpa(query, key, value, *args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
        engine = _engine(HFBackend(model, tokenizer), padded_shapes=padded)
        prompts = _prompts(tokenizer, (3, 40, 9))
        futures = [engine.submit(p, SamplingParams(max_new_tokens=n, seed=n)) for p, n in zip(prompts, (70, 5, 20))]
        [f.result(timeout=120) for f in futures]
        engine.close(timeout=60)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        return set(seen)

    padded = shapes(True)
    assert all(rows & (rows - 1) == 0 and width % WIDTH_BLOCK == 0 for rows, _, width in padded), padded
    assert {fed for _, fed, _ in padded} & {PREFILL_BLOCK}  # prefills fed whole blocks
    exact = shapes(False)
    assert len(padded) < len(exact)  # exact: one prefill shape per prompt length, one decode shape per row count


def test_every_backend_and_round_is_served_by_the_processs_one_generation_thread(tiny):
    model, tokenizer = tiny
    threads = set()
    for round_ in range(3):
        backend = HFBackend(model, tokenizer)  # a fresh backend per collect, as after a weight update
        completion = backend.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=3, seed=round_)).result(timeout=60)
        assert len(completion.token_ids) == 3
        threads |= {t.ident for t in threading.enumerate() if t.name == "hf-engine" and t.is_alive()}
        backend._engine.close(timeout=60)
    assert len(threads) == 1


def test_an_engine_stepped_in_the_calling_thread_samples_what_the_threaded_one_samples(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, (4, 12))
    samplings = [SamplingParams(max_new_tokens=n, seed=n) for n in (5, 8)]
    threaded = HFBackend(model, tokenizer)
    expected = [f.result(timeout=60) for f in [threaded.submit(p, s) for p, s in zip(prompts, samplings)]]
    engine = HFEngine(HFBackend(model, tokenizer), worker="caller")
    futures = [engine.submit(p, s) for p, s in zip(prompts, samplings)]
    while engine.step():
        pass
    assert [f.result(timeout=0).token_ids for f in futures] == [c.token_ids for c in expected]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(prompts[0], samplings[0])


def test_an_unknown_worker_is_refused_in_one_line(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="worker must be one of"):
        HFEngine(HFBackend(model, tokenizer), worker="pool")


def test_the_generation_diagnosis_runs_on_cpu_and_prints_its_verdict_line():
    done = subprocess.run(
        [sys.executable, "scripts/bench_generate.py", "--diagnose", "--quick", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("| fresh-thread | own | allowed | no |") for line in lines)
    assert "top 12 ops by own CPU time:" in lines
    verdict = [line for line in lines if line.startswith("verdict: ")]
    assert len(verdict) == 1 and " on cpu" in verdict[0], done.stdout[-2000:]


def test_on_cuda_the_engine_leaves_cudnn_attention_out_unless_asked_and_restores_torchs_choice():
    """The kernel choice is torch's global flags (settable without a GPU): cuDNN's attention is off
    inside the engine's context on CUDA, the other kernels on, and torch's own choice comes back."""
    from seeupo_gym.agents.backends.kv_rows import attention_backends

    backends = torch.backends.cuda
    before = backends.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda"), cudnn=False):
        assert not backends.cudnn_sdp_enabled()
        assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()
    assert backends.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cuda"), cudnn=True), attention_backends(torch.device("cpu"), cudnn=False):
        assert backends.cudnn_sdp_enabled() == before
