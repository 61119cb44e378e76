"""The vLLM backend on a GPU (skipped without CUDA or without vLLM).

- vLLM running the workbench model (`model_impl='workbench'`, decode steps in CUDA graphs): every sampled token's
  log-prob is the trainer's, bit for bit, on a small random Qwen3 and at the Qwen3-1.7B shape; a request gets the
  same tokens alone and in a batch; a short GRPO run with this backend holds parity every step.
- The negative control, in a subprocess (vLLM reads its batch-invariant switch once per process):
  vLLM's own Qwen3 without batch-invariant mode differs from the trainer.
- Weight syncs into the running engine land bit for bit (checksums), in place and through disk.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from workbench.generation import SamplingParams, parity_summary, parity_table, trainer_logprobs
from workbench.kernels import mode
from workbench.models import ModelConfig, build, save_pretrained

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here")

SMALL = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def _parity(gen, model, prompts, params):
    out = gen.generate(prompts, params, request_ids=list(range(len(prompts))))
    tokens = [c.tokens for c in out.completions]
    with mode("invariant"):
        ref = trainer_logprobs(model, prompts, tokens, None if params.temperature == 1 else params)
    got = [c.logprobs if params.temperature == 1 else c.sampled_logprobs for c in out.completions]
    return out, parity_summary(parity_table(got, ref, tokens))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from workbench.generation.vllm_backend import VLLMGenerator

    path = tmp_path_factory.mktemp("ckpt")
    model = build(SMALL, device="cuda", dtype=torch.bfloat16, seed=0)
    save_pretrained(model, path)
    with mode("invariant"):
        gen = VLLMGenerator(path, gpu_memory_utilization=0.2)
    return gen, model, path


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_vllm_runs_the_trainer_bitwise(engine, temperature):
    gen, model, _ = engine
    assert gen.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"
    prompts = _prompts(48, SMALL.vocab_size, seed=1)
    out, s = _parity(gen, model, prompts, SamplingParams(temperature=temperature, max_new_tokens=40, seed=2))
    assert s["tokens"] == 48 * 40 and s["bitwise_identical"], s
    alone = gen.generate(prompts[7:8], SamplingParams(temperature=temperature, max_new_tokens=40, seed=2),
                         request_ids=[7])
    assert alone.completions[0].tokens == out.completions[7].tokens
    assert torch.equal(alone.completions[0].sampled_logprobs, out.completions[7].sampled_logprobs)


def test_gpu_vllm_weight_sync_in_place_and_through_disk(engine, tmp_path):
    gen, _, _ = engine
    fresh = build(SMALL, device="cuda", dtype=torch.bfloat16, seed=9)
    state = {k: v.detach() for k, v in fresh.state_dict().items()}
    before = gen.weights_checksum()
    gen.load_weights(state)
    assert gen.weights_checksum() == gen.expected_checksum(state) != before
    prompts = _prompts(8, SMALL.vocab_size, seed=3)
    assert _parity(gen, fresh, prompts, SamplingParams(max_new_tokens=16))[1]["bitwise_identical"]
    save_pretrained(build(SMALL, device="cpu", dtype=torch.bfloat16, seed=0), tmp_path / "back")
    gen.load_checkpoint(tmp_path / "back")
    assert gen.weights_checksum() == before, "through disk, back to the first weights"


@pytest.mark.slow
def test_gpu_vllm_grpo_run_holds_parity_every_step(tmp_path):
    """`python -m workbench train --generator vllm`, in its own process (its own engine)."""
    import pandas as pd

    args = ["train", "--generator", "vllm", "--sync", "copy", "--steps", "4", "--device", "cuda", "--no-progress",
            "--prompts-per-step", "8", "--group-size", "4", "--max-new-tokens", "8", "--vllm-memory", "0.15",
            "--out-dir", str(tmp_path / "run")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, timeout=540,
                         env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    table = pd.read_csv(tmp_path / "run" / "metrics.csv")
    differing = table[table.metric == "parity_tokens_differing"]
    assert len(differing) == 4 and (differing.value == 0).all()
    assert (table[table.metric == "sampler_trainer_kl"].value == 0).all()


_CONTROL = """
import json, sys, torch
from workbench.generation import SamplingParams, parity_summary, parity_table, trainer_logprobs
from workbench.generation.vllm_backend import VLLMGenerator
from workbench.kernels import mode
from workbench.models import load_pretrained
path, impl, bi, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
model = load_pretrained(path, dtype=torch.bfloat16, device="cuda")
gen = VLLMGenerator(path, gpu_memory_utilization=0.2, batch_invariant=bi, model_impl=impl, enforce_eager=eager)
graphs = gen.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
g = torch.Generator().manual_seed(1)
prompts = torch.randint(0, model.config.vocab_size, (32, 24), generator=g).tolist()
out = gen.generate(prompts, SamplingParams(max_new_tokens=32, seed=3))
tokens = [c.tokens for c in out.completions]
with mode("invariant"):
    s = parity_summary(parity_table([c.logprobs for c in out.completions], trainer_logprobs(model, prompts, tokens),
                                    tokens))
print("RESULT", json.dumps({**{k: float(v) for k, v in s.items()}, "graphs": graphs}))
"""


def _control(path, impl, bi, eager=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _CONTROL, str(path), impl, "1" if bi else "0", "1" if eager else "0"],
                         capture_output=True, text=True, timeout=540, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[0][7:])


@pytest.mark.slow
def test_gpu_vllm_own_model_without_batch_invariance_differs(engine):
    _, _, path = engine
    s = _control(path, "vllm", bi=False)
    assert s["tokens_differing"] > 0, "the control must differ: otherwise the parity test proves nothing"


@pytest.mark.slow
def test_gpu_vllm_parity_at_the_1p7b_shape(tmp_path):
    """Qwen3-1.7B's shape, random weights, in its own process (another engine, its own memory)."""
    save_pretrained(build("qwen3-1.7B", device="cpu", dtype=torch.bfloat16, seed=0), tmp_path / "ckpt")
    s = _control(tmp_path / "ckpt", "workbench", bi=True, eager=False)
    assert s["graphs"] == "FULL_DECODE_ONLY", s
    assert s["tokens"] == 32 * 32 and s["tokens_differing"] == 0 and s["max_abs_diff"] == 0, s
