"""The vLLM backend on a GPU (skipped without CUDA or without vLLM): in batch-invariant mode a
request gets the same tokens and log-probs alone and in a batch; weight syncs into the running
engine land bit for bit (checksums), in place and through disk.

Not yet here: bitwise parity of vLLM's log-probs with the trainer (issue 7; on an H100 every token
differs, by up to 0.11 at the 1.7B shape, see BENCHMARKS.md)."""

import pytest
import torch

from workbench.generation import SamplingParams
from workbench.models import Qwen3Config, build, save_pretrained

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here")

SMALL = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from workbench.generation.vllm_backend import VLLMGenerator

    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(build(SMALL, device="cuda", dtype=torch.bfloat16, seed=0), path)
    return VLLMGenerator(path, gpu_memory_utilization=0.3, batch_invariant=True, enforce_eager=True), path


def test_gpu_vllm_batch_invariant_request_alone_and_in_a_batch(engine):
    gen, _ = engine
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, SMALL.vocab_size, (24, 16), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    batch = gen.generate(prompts, params, request_ids=list(range(24)))
    alone = gen.generate(prompts[7:8], params, request_ids=[7])
    assert alone.completions[0].tokens == batch.completions[7].tokens
    assert torch.equal(alone.completions[0].logprobs, batch.completions[7].logprobs)
    assert all(len(c.tokens) == 24 for c in batch.completions)


def test_gpu_vllm_weight_sync_in_place_and_through_disk(engine, tmp_path):
    from workbench.generation.vllm_backend import VLLMGenerator

    gen, path = engine
    fresh = build(SMALL, device="cuda", dtype=torch.bfloat16, seed=9)
    state = {k: v.detach() for k, v in fresh.state_dict().items()}
    before = gen.weights_checksum()
    seconds = gen.load_weights(state)
    assert gen.weights_checksum() == VLLMGenerator.expected_checksum(state, SMALL.tie_word_embeddings) != before
    assert seconds < 0.5
    save_pretrained(build(SMALL, device="cpu", dtype=torch.bfloat16, seed=0), tmp_path / "back")
    gen.load_checkpoint(tmp_path / "back")
    assert gen.weights_checksum() == before, "through disk, back to the first weights"
