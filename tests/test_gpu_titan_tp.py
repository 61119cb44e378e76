"""Tensor parallelism of the routed torchtitan model (workbench/titan/tp.py) on 2 GPUs (NCCL) at the Qwen3-1.7B shape
and a Llama 3 layout of the Qwen3-0.6B shape (SmolLM2-135M's 9 heads do not split over 2), random weights: the TP=2
training forward scores the workbench generator's samples with the sampled bits (0 differing tokens) and the
one-GPU routed model's; the gradients, gathered, are the one-GPU ones up to the ranks' sum of partial dx (the
measured difference is printed for BENCHMARKS.md); torchtitan's RowwiseParallel wo/w2 differs (the control). And
`train` at tensor_parallel=2 (trainer_backend='torchtitan') on a random Qwen3-1.7B-shaped policy: 0 differing tokens
every step."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from helpers import random_gpu_model

from workbench.distributed import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")]
pytest.importorskip("torchtitan")


def _shape(name: str):
    from workbench.models import config

    if name == "llama-0.6B":   # torchtitan's Llama 3 takes head_dim = hidden / heads
        return dataclasses.replace(config("qwen3-0.6B"), model_type="llama", qk_norm=False, head_dim=64,
                                   tie_word_embeddings=False)
    return config(name)


def _logprobs(model, batch, upstream=None):
    """The batch's log-probs [B, T] (the training forward, per micro-batch) and, given `upstream`, the backward of
    sum(lp * upstream)."""
    from workbench.kernels import mode
    from workbench.rl.logprobs import completion_logprobs

    out = torch.zeros_like(batch.mask)
    for mb in batch.micro_batches(None, 4096):
        with mode("invariant"):
            lp, _ = completion_logprobs(model, mb, 1.0)
        if upstream is not None:
            (lp * upstream[mb.index, : mb.width]).sum().backward()
        out[mb.index, : mb.width] = lp.detach()
    return out


def _worker(name: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.generation import SamplingParams, generate
    from workbench.kernels import mode
    from workbench.rl.logprobs import parity_stats
    from workbench.rl.rollout import RolloutBatch
    from workbench.titan.model import exact, titan_model
    from workbench.titan.tp import apply_tp, rowwise_plan
    from workbench.titan.weights import to_titan

    d = launch.init("cuda")
    cfg = _shape(name)
    ours = random_gpu_model(cfg, seed=1)   # the same draws on both ranks (and apply_tp cuts rank 0's)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 48, (16,), generator=g)]
    with mode("invariant"):
        gen = generate(ours, prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=3))
    batch = RolloutBatch.from_generation(prompts, gen.completions, 0, d.device)
    behavior = batch.behavior.clone()
    dist.broadcast(behavior, 0)
    assert torch.equal(behavior, batch.behavior), "the two GPUs sampled different rollouts"
    upstream = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(4)).to(d.device)
    state = to_titan(ours.state_dict(), cfg)
    del ours, gen

    def routed():
        model = titan_model(cfg, d.device)
        model.load_state_dict(state)
        return exact(model, cfg)

    one = routed()
    lp_one = _logprobs(one, batch, upstream)
    grads_one = {k: p.grad for k, p in one.named_parameters()}
    del one
    mesh = init_device_mesh("cuda", (2,))
    tp = apply_tp(routed(), mesh)
    lp_tp = _logprobs(tp, batch, upstream)
    grads = {k: p.grad.full_tensor() for k, p in tp.named_parameters()}
    del tp
    control = _logprobs(apply_tp(routed(), mesh, rowwise_plan()), batch)
    rel = {k: float((grads[k].float() - grads_one[k].float()).abs().max() / grads_one[k].float().abs().max())
           for k in grads_one}
    last = f"layers.{cfg.num_hidden_layers - 1}.feed_forward.w2.weight"
    if dist.get_rank() == 0:
        torch.save({"parity": parity_stats(batch.behavior, lp_tp, batch.mask), "same": torch.equal(lp_tp, lp_one),
                    "control": parity_stats(batch.behavior, control, batch.mask), "rel": rel,
                    "exact": [k for k in (last, "norm.weight") if torch.equal(grads[k], grads_one[k])]}, out)
    dist.barrier()


@pytest.mark.parametrize("name", ["qwen3-1.7B", "llama-0.6B"])
def test_tp2_forward_is_the_generators_bits(name, tmp_path):
    launch.spawn(_worker, 2, name, str(tmp_path / "out.pt"))
    r = torch.load(tmp_path / "out.pt")
    worst = sorted(r["rel"].items(), key=lambda kv: -kv[1])[:3]
    print(f"{name}: TP=2 parity {r['parity']}; gradient max |diff| / max |g|, worst 3: {worst}; "
          f"bit-exact: {r['exact']}; rowwise control {r['control']}")
    assert r["parity"]["tokens_differing"] == 0 and r["same"], r["parity"]
    assert r["control"]["tokens_differing"] > 0, r["control"]
    assert max(r["rel"].values()) <= 2**-5, worst
    assert len(r["exact"]) == 2, r["exact"]


def _odd_length(self, completion: str, problem) -> float:
    """A reward a random policy's completions vary in (whether the text's length is odd): the task's exact match
    gives every random completion 0, hence zero advantages and no gradient to check."""
    return float(len(completion) % 2)


def _train_worker(policy: str, out: str) -> None:
    from workbench.rl.config import TrainConfig
    from workbench.tasks import Arithmetic
    from workbench.rl.trainer import train

    launch.init("cuda")
    Arithmetic.reward = _odd_length
    train(TrainConfig(policy=policy, chat_template=False, out_dir=out, steps=3, prompts_per_step=8, group_size=4,
                      max_new_tokens=32, lr=1e-5, kernel_mode="invariant", trainer_backend="torchtitan",
                      tensor_parallel=2, checkpoint_every=3, device="cuda", progress=False))


def test_tp2_train_holds_parity_every_step(tmp_path):
    """`train` at tensor_parallel=2 on 2 GPUs, a random Qwen3-1.7B-shaped policy (the arithmetic task's tokenizer, as
    bench/bench_distributed.py's): both ranks sample the same rollouts with whole generators, the sharded titan model
    scores and trains them, the generators get the gathered weights; 0 differing tokens at every step, the weights
    move, and the DCP checkpoint of the sharded masters is written."""
    from workbench.models import config, save_pretrained
    from workbench.rl.checkpoint import latest_checkpoint
    from workbench.policies.selftrained import train_tokenizer
    from workbench.tasks import Arithmetic

    # The arithmetic tokenizer's 17 tokens in a vocabulary of 32 (not 151,936, of which a random policy would sample
    # ids that decode to nothing): completions of text whose rewards vary.
    model = random_gpu_model(dataclasses.replace(config("qwen3-1.7B"), vocab_size=32, max_position_embeddings=4096),
                             seed=1)
    save_pretrained(model, tmp_path / "policy", tokenizer=train_tokenizer(Arithmetic(seed=0)))
    del model
    torch.cuda.empty_cache()
    launch.spawn(_train_worker, 2, str(tmp_path / "policy"), str(tmp_path / "run"))
    t = pd.read_csv(tmp_path / "run" / "metrics.csv").pivot(index="step", columns="metric", values="value")
    print(t[["parity_tokens_differing", "loss", "grad_norm", "weight_delta_l2", "response_length", "time_step"]])
    assert list(t.index) == [1, 2, 3] and (t["parity_tokens_differing"] == 0).all(), t["parity_tokens_differing"]
    assert (t["reward_std"] > 0).all() and (t["weight_delta_l2"] > 0).all(), t[["reward_std", "weight_delta_l2"]]
    assert latest_checkpoint(tmp_path / "run") is not None
