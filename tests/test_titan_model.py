"""torchtitan's own Qwen3 and Llama 3 models routed through the workbench's kernels (CPU, interpreter, tiny shapes):
the generator's sampled log-probs and the workbench trainer's gradients bit for bit, torchtitan's own forward as
the negative control, and weights through torchtitan's names and DCP checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import seed_for
from workbench.generation import SamplingParams, generate
from workbench.kernels import mode
from workbench.models import SIZES, RopeScaling, build, copy_weights, merge_gate_up
from workbench.rl.logprobs import completion_logprobs, parity_stats
from workbench.rl.rollout import RolloutBatch
from workbench.titan.model import build_titan_model, exact, titan_args, titan_model
from workbench.titan.weights import from_titan, load_dcp, save_dcp, to_titan

TINY = SIZES["tiny"]
# SmolLM2's flags at the tiny shape: a Llama with a tied head, head_dim = hidden / heads as torchtitan's Llama 3 takes.
LLAMA = dataclasses.replace(TINY, model_type="llama", qk_norm=False, rope_theta=10_000.0)
CONFIGS = {"qwen3": TINY, "llama": LLAMA}
TEMPERATURE = 0.8


def _titan_own(cfg, state: dict) -> torch.nn.Module:
    """torchtitan's model as torchtitan builds it (its class, its args, its init), holding `state`; not routed."""
    model = titan_model(cfg, "cpu", next(iter(state.values())).dtype)
    model.load_state_dict(to_titan(state, cfg))
    return model


def _rollouts(model, seed: int):
    """(the one micro-batch of the generator's samples of 3 prompts, their sampled log-probs and mask in its rows)"""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, TINY.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 3)]
    with mode("invariant"):
        out = generate(model, prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=seed))
    batch = RolloutBatch.from_generation(prompts, out.completions, 0, "cpu")
    mb = batch.micro_batches(None, 1 << 20)[0]
    return mb, batch.behavior[mb.index, : mb.width], batch.mask[mb.index, : mb.width]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_training_forward_is_the_generators_bits_and_gradients_the_trainers(family):
    """The routed torchtitan model's training forward (autograd recording) scores the workbench generator's samples
    with the bits the generator reported; its backward gives the workbench model's parameter gradients bit for
    bit, mapped through torchtitan's names (Llama's q/k rows permuted, the tied head's gradient in the embedding)."""
    cfg, seed = CONFIGS[family], seed_for()
    ours, titan = build(cfg, seed=seed), build_titan_model(cfg, "cpu", seed=seed)
    mb, behavior, mask = _rollouts(ours, seed)
    with mode("invariant"):
        got, _ = completion_logprobs(titan, mb, TEMPERATURE)
        want, _ = completion_logprobs(ours, mb, TEMPERATURE)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    stats = parity_stats(behavior, got.detach(), mask)
    assert stats["tokens"] == 18 and stats["tokens_differing"] == 0, f"seed {seed}: {stats}"
    assert torch.equal(got, want), f"seed {seed}"
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    grads = to_titan({k: p.grad for k, p in ours.named_parameters()}, cfg)
    for name, p in titan.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"seed {seed}: no gradient reaches {name}"
        assert torch.equal(p.grad, grads[name]), f"seed {seed}: {name}"


def test_routed_on_the_meta_device_then_allocated_as_torchtitans_trainer_does():
    """torchtitan's trainer builds on meta, parallelizes, then allocates (`to_empty`, which unties the Llama head)
    and loads: routed first, the model still gives the workbench's log-probs and the tied head's gradient."""
    cfg, seed = LLAMA, seed_for()
    with torch.device("meta"):
        titan = exact(titan_model(cfg, "meta"), cfg)
    titan = titan.to_empty(device="cpu")
    ours = build(cfg, seed=seed)
    titan.load_state_dict(to_titan(ours.state_dict(), cfg))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 7)]
    comps = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 5)]
    batch = RolloutBatch(prompts, comps, torch.zeros(2, 5), torch.tensor([[1.0] * 3 + [0.0] * 2, [1.0] * 5]), 0)
    mb = batch.micro_batches(None, 1 << 20)[0]
    with mode("invariant"):
        got, want = completion_logprobs(titan, mb, 1.0)[0], completion_logprobs(ours, mb, 1.0)[0]
    assert torch.equal(got, want), f"seed {seed}"
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(titan.tok_embeddings.weight.grad, ours.model.embed_tokens.weight.grad), f"seed {seed}"


def test_recompute_keeps_the_gradient_bits():
    cfg, seed = LLAMA, seed_for()
    titan = build_titan_model(dataclasses.replace(cfg, num_hidden_layers=1), "cpu", seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    lens = torch.tensor([7, 4], dtype=torch.int32)
    grads = {}
    for recompute in ("none", "mlp", "layers"):
        titan.zero_grad()
        with mode("invariant"):
            titan.hidden_states(ids, lens, recompute=recompute)[0, :4].float().square().sum().backward()
        grads[recompute] = [p.grad.clone() for p in titan.parameters()]
    for recompute in ("mlp", "layers"):
        assert all(map(torch.equal, grads["none"], grads[recompute])), f"seed {seed}: {recompute}"


def test_llama_qk_products_run_on_the_workbench_weights(monkeypatch):
    """Llama's q/k products, forward and backward, multiply by the workbench's q_proj/k_proj (halves rows) bit for
    bit, not torchtitan's interleaved rows: the backward's dx = dq @ W reduces over the q features, so their order
    sets dx's bits on the GPU (the CPU interpreter's fixed-order sum hides it; the GPU tests see it)."""
    from workbench.kernels import matmul as mm

    cfg, seed = dataclasses.replace(LLAMA, num_hidden_layers=1), seed_for()
    ours, titan = build(cfg, seed=seed), build_titan_model(cfg, "cpu", seed=seed)
    operands, matmul = [], mm.matmul
    monkeypatch.setattr(mm, "matmul", lambda a, b, *args, **kw: operands.append(b) or matmul(a, b, *args, **kw))
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with mode("invariant"):
        titan.hidden_states(ids).float().square().sum().backward()
    attn, own = ours.model.layers[0].self_attn, titan.layers["0"].attention
    for want, interleaved in ((attn.q_proj.weight, own.wq.weight), (attn.k_proj.weight, own.wk.weight)):
        assert not torch.equal(want, interleaved), f"seed {seed}"
        forward = [b for b in operands if b.t().shape == want.shape and torch.equal(b.t(), want)]
        backward = [b for b in operands if b.shape == want.shape and torch.equal(b, want)]
        assert len(forward) == len(backward) == 1, f"seed {seed}: y = x @ W.T, dx = dy @ W"
        assert not any(torch.equal(b, interleaved) or torch.equal(b.t(), interleaved) for b in operands
                       if b.numel() == want.numel()), f"seed {seed}"


@pytest.mark.parametrize("recompute", ["none", "layers"])
def test_llama_main_grads_are_the_workbench_models_bits(recompute):
    """With fp32 `main_grad`s holding earlier micro-batches' sums (the trainer's masters), the backward adds the
    workbench model's gradients into them bit for bit, also from a recomputed layer: Llama's q/k through the
    gathered weight's own buffer, added into the parameter's main_grad in torchtitan's rows with the kernel's one
    fp32 rounding."""
    cfg, seed = dataclasses.replace(LLAMA, num_hidden_layers=1), seed_for()
    ours, titan = build(cfg, seed=seed), build_titan_model(cfg, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed)
    old = {k: torch.randn(p.shape, generator=g) for k, p in ours.named_parameters()}
    for k, p in ours.named_parameters():
        p.main_grad = old[k].clone()
    titan_old = to_titan(old, cfg)
    for k, p in titan.named_parameters():
        p.main_grad = titan_old[k].clone()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    lens = torch.tensor([7, 4], dtype=torch.int32)
    with mode("invariant"):
        for model in (ours, titan):
            model.hidden_states(ids, lens, recompute=recompute)[0, :4].float().square().sum().backward()
    want = to_titan({k: p.main_grad for k, p in ours.named_parameters()}, cfg)
    grads = {k: p.grad for k, p in titan.named_parameters() if p.grad is not None}
    norms = {"norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}
    assert grads.keys() == norms, f"seed {seed}: the norms alone give bf16 gradients"
    ours_grads = to_titan({k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in ours.named_parameters()},
                          cfg)
    assert all(torch.equal(grads[k], ours_grads[k]) for k in norms), f"seed {seed}"
    for name, p in titan.named_parameters():
        assert torch.equal(p.main_grad, want[name]), f"seed {seed}: {name}"
        assert name in grads or not torch.equal(p.main_grad, titan_old[name]), f"seed {seed}: {name} got none"


def test_a_main_grad_dropped_before_the_backward_is_one_line():
    """The q/k gradient went into the gathered weight's buffer: with the parameter's main_grad gone it has nowhere
    to go, and the backward says so instead of dropping it."""
    cfg = dataclasses.replace(LLAMA, num_hidden_layers=1)
    titan = build_titan_model(cfg, "cpu", seed=0)
    for p in titan.parameters():
        p.main_grad = torch.zeros(p.shape)
    with mode("invariant"):
        loss = titan.hidden_states(torch.tensor([[1, 2, 3]])).float().sum()
    del titan.layers["0"].attention.wq.weight.main_grad
    with pytest.raises(RuntimeError, match="lost its main_grad between the forward and the backward"):
        loss.backward()


@pytest.mark.parametrize("cfg", [
    TINY, LLAMA, dataclasses.replace(LLAMA, model_type="mistral", tie_word_embeddings=False),
    dataclasses.replace(LLAMA, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
], ids=["qwen3", "llama", "mistral-untied", "llama3-rope-scaling"])
def test_torchtitans_own_forward_computes_the_same_function(cfg):
    """In fp32, to 1e-5: the names, the Llama q/k row layout, the tie, the MLP width and the RoPE scaling map."""
    seed = seed_for()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = build(cfg, dtype=torch.float32, seed=seed)
        ref, own = ours(ids), _titan_own(cfg, ours.state_dict())(ids)
    assert ((own - ref).norm() / ref.norm()).item() < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_torchtitans_own_forward_is_the_control(family):
    """torchtitan's own forward on the same weights does not give the generator's bits (bf16: tokens differ, by
    little); `exact` on that very model, built by torchtitan's own code, gives them."""
    cfg, seed = CONFIGS[family], seed_for()
    ours = build(cfg, seed=seed)
    mb, behavior, mask = _rollouts(ours, seed)
    titan = _titan_own(cfg, ours.state_dict())
    with torch.no_grad():
        logits = titan(mb.ids)[mb.rows, mb.positions].float() / TEMPERATURE
    lp = torch.log_softmax(logits, -1).gather(-1, mb.targets[:, None])[:, 0]
    control = torch.zeros_like(mask).index_put((mb.rows, mb.columns), lp)
    stats = parity_stats(behavior, control, mask)
    assert stats["tokens_differing"] > 0 and stats["max_abs_diff"] < 0.1, f"seed {seed}: {stats}"
    with mode("invariant"), torch.no_grad():
        routed, _ = completion_logprobs(exact(titan, cfg), mb, TEMPERATURE)
    assert parity_stats(behavior, routed, mask)["tokens_differing"] == 0, f"seed {seed}"


@pytest.mark.parametrize("cfg", [TINY, LLAMA, dataclasses.replace(LLAMA, tie_word_embeddings=False)],
                         ids=["qwen3-tied", "llama-tied", "llama-untied"])
def test_weights_round_trip(cfg):
    state = build(cfg, dtype=torch.float32, seed=seed_for()).state_dict()
    titan = to_titan(state, cfg)
    assert set(titan) == set(_titan_own(cfg, state).state_dict())
    back = from_titan(titan, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    merged = {k: v for k, v in state.items() if ".mlp.gate_proj." not in k and ".mlp.up_proj." not in k}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        merged[p + "gate_up_proj.weight"] = merge_gate_up(state[p + "gate_proj.weight"], state[p + "up_proj.weight"])
    assert all(torch.equal(v, titan[k]) for k, v in to_titan(merged, cfg).items())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_dcp_checkpoints_both_ways(family, tmp_path):
    """save_dcp -> load_dcp bitwise; torchtitan's CheckpointManager (model, optimizer, flattened) -> load_dcp -> the
    workbench's model; save_dcp -> torchtitan's CheckpointManager.load -> torchtitan's model."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.job_config import Checkpoint

    cfg, seed = CONFIGS[family], seed_for()
    state = build(cfg, dtype=torch.float32, seed=seed).state_dict()
    save_dcp(state, tmp_path / "ours", cfg)
    back = load_dcp(tmp_path / "ours", cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items()), f"seed {seed}"

    def manager(model, folder):
        return CheckpointManager(dataloader=None, model_parts=[model], lr_schedulers=None, states={},
                                 optimizers=OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-3}),
                                 checkpoint_config=Checkpoint(enable=True, folder=folder, last_save_model_only=False),
                                 sd_adapter=None, base_folder=str(tmp_path))

    titan = build_titan_model(cfg, "cpu", dtype=torch.float32, seed=seed)
    manager(titan, "titan").save(curr_step=5, last_step=True)
    ours = build(cfg, dtype=torch.bfloat16, seed=None)
    copy_weights(load_dcp(tmp_path / "titan" / "step-5", cfg), ours)
    assert all(torch.equal(p, state[k].bfloat16()) for k, p in ours.named_parameters()), f"seed {seed}"

    (tmp_path / "mine").mkdir()
    save_dcp(state, tmp_path / "mine" / "step-0", cfg)
    fresh = build_titan_model(cfg, "cpu", dtype=torch.float32, seed=None)
    assert manager(fresh, "mine").load(step=0)
    assert all(torch.equal(v, titan.state_dict()[k]) for k, v in fresh.state_dict().items()), f"seed {seed}"


def test_what_torchtitan_cannot_express_is_refused_in_one_line():
    cases = {
        "q/k/v biases": dataclasses.replace(TINY, model_type="qwen2", qk_norm=False, attention_bias=True),
        "no RoPE scaling": dataclasses.replace(TINY, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
        "only llama3 RoPE scaling": dataclasses.replace(LLAMA, rope_scaling=RopeScaling("linear", 2.0)),
        "head_dim = hidden_size / heads": dataclasses.replace(LLAMA, head_dim=32),
    }
    for words, cfg in cases.items():
        with pytest.raises(ValueError, match=words) as e:
            titan_args(cfg)
        assert "\n" not in str(e.value)
    model = build_titan_model(TINY, "meta", seed=None)
    with pytest.raises(ValueError, match="shape"):
        exact(model, dataclasses.replace(TINY, intermediate_size=256))
    with pytest.raises(TypeError, match="Transformer"):
        exact(model, LLAMA)
    with pytest.raises(ValueError, match="attention_masks"):
        model(torch.zeros(1, 3, dtype=torch.long, device="meta"), positions=torch.zeros(1, 3, device="meta"))
