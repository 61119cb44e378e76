"""The update at scale on CPU: micro-batches, PPO mini-batches, the old log-probs' source, every loss with every
correction, activation checkpointing and the memory layout of the weights (tiny model, Triton interpreter)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from workbench.kernels import mode
from workbench.models import RECOMPUTE, build, lora
from workbench.rl.config import TrainConfig
from workbench.rl.logprobs import completion_logprobs, score
from workbench.rl.losses import get_loss, group_advantages, importance_weights
from workbench.rl.rollout import RolloutBatch
from workbench.rl.update import UpdateInputs, update
from workbench.rl.weights import TrainWeights

TEMPERATURE = 0.9


def _batch(seed: int, n: int = 6, vocab: int = 512) -> RolloutBatch:
    """Sequences of fresh random lengths and tokens; behavior log-probs filled in by the caller."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    comps = [torch.randint(1, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    width = max(map(len, comps))
    mask = torch.zeros(n, width)
    for i, c in enumerate(comps):
        mask[i, : len(c)] = 1
    return RolloutBatch(prompts, comps, torch.zeros(n, width), mask, pad_id=0)


def _model(seed: int = 0):
    return build("tiny", device="cpu", dtype=torch.float32, seed=seed)


def _score(weights, batch, kernel_mode="standard"):
    with mode(kernel_mode):
        return score(weights.model, batch, 10_000, TEMPERATURE)[0]


def test_micro_batches_cover_every_sequence_once_under_the_budget():
    batch = _batch(1, n=9)
    for budget in (1, 17, 40, 10_000):
        mbs = batch.micro_batches(None, budget)
        rows = sorted(int(i) for mb in mbs for i in mb.index)
        assert rows == list(range(9))
        for mb in mbs:
            assert mb.ids.numel() <= budget or len(mb.index) == 1, "over budget only for a lone long sequence"
            assert int(mb.targets.numel()) == int(batch.mask[mb.index].sum())
    assert len(batch.micro_batches(None, 10_000)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kernel_mode", ["invariant", "standard"])
def test_logprobs_do_not_depend_on_the_micro_batch_split(kernel_mode):
    weights = TrainWeights(_model(), "float32", 1e-3, "cpu")
    batch = _batch(2)
    with mode(kernel_mode):
        full, ent = score(weights.model, batch, 10_000, TEMPERATURE, with_entropy=True)
        splits = [score(weights.model, batch, budget, TEMPERATURE)[0] for budget in (1, 25)]
    assert torch.isfinite(full).all() and (ent[batch.mask.bool()] > 0).all()
    assert (full[batch.mask == 0] == 0).all()
    for other in splits:
        if kernel_mode == "invariant":
            assert torch.equal(other, full), "a token's log-prob must not depend on its micro-batch"
        else:   # a smoke bound: this mismatch is what the project measures, not an error of the code's
            torch.testing.assert_close(other, full, atol=2e-2, rtol=0)


def _inputs(batch, logp, loss="grpo", correction="none", group=3):
    rewards = torch.arange(len(batch), dtype=torch.float32) % 2
    adv = group_advantages(rewards, group, scale=get_loss(loss).advantage_scale)
    w = None
    if correction != "none":
        kind, level = correction.split("-")
        w = importance_weights(logp, batch.behavior, batch.mask, level, "truncate" if kind == "tis" else "mask", 1.5)
    return UpdateInputs(adv, logp, w, None)


def _grads(cfg, batch, inputs, start_seed=0):
    """The masters' fp32 gradient of one update (lr tiny) and the update's stats."""
    weights = TrainWeights(_model(start_seed), cfg.optim.master_dtype, 1e-30, "cpu")
    captured = {}
    step = weights.step

    def capture():
        captured.update({k: v.grad.clone() for k, v in weights.masters.items()})
        return step()

    weights.step = capture
    with mode(cfg.kernel_mode):
        stats = update(cfg, get_loss(cfg.objective.loss), weights, batch, inputs, 1,
                       lambda loss: pytest.fail("bad loss"))
    return captured, stats


@pytest.fixture(scope="session")
def batch3_logprobs():
    """The invariant log-probs of `_batch(3)` under `_model()`: the same bits for every loss below (the model and the
    batch do not depend on the loss), scored once per worker (session scope: conftest.py's longest-first order puts
    other modules' tests between these, and pytest drops a module's fixtures at each such switch)."""
    return _score(TrainWeights(_model(), "float32", 1e-3, "cpu"), _batch(3), "invariant")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_micro_batched_gradient_is_the_whole_batch_gradient(loss, batch3_logprobs):
    # Invariant kernels: a token's log-prob is the same bits whatever the micro-batch, so the ratio is exactly 1 in
    # both updates. (Standard kernels may change with the micro-batch's rows: on an AMD EPYC, whose CPU BLAS
    # blocks by M differently from the Intel machines this test first ran on, the ratio left 1 by ~1e-3.)
    batch = _batch(3)
    logp = batch3_logprobs.clone()
    batch.behavior = logp.clone()
    cfg = TrainConfig(loss=loss, temperature=TEMPERATURE, group_size=3, prompts_per_step=2, max_new_tokens=6,
                      kernel_mode="invariant")
    whole, stats = _grads(dataclasses.replace(cfg, max_tokens_per_microbatch=10_000), batch, _inputs(batch, logp, loss))
    pieces, stats2 = _grads(dataclasses.replace(cfg, max_tokens_per_microbatch=12), batch, _inputs(batch, logp, loss))
    ratio = "seq_ratio_mean" if get_loss(loss).sequence_level else "ratio_mean"
    assert stats[ratio] == stats2[ratio] == 1.0
    assert stats2["loss"] == pytest.approx(stats["loss"], abs=1e-6)
    # Each micro-batch's bf16 gradient is rounded before the fp32 accumulation: equal up to bf16 rounding. A
    # per-micro-batch normalisation would be off by a factor of about the number of micro-batches.
    a, b = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (pieces, whole))
    assert float((a - b).norm() / b.norm()) < 1e-2 and float(b.norm()) > 0


class _Fp32Weights:
    """Stands in for TrainWeights: an fp32 model with fp32 gradients throughout (standard kernels), so two updates
    differ only where their losses do, up to fp32 summation order. The update's arithmetic (micro-batch
    normalisation, correction weights) is then checked to ~1e-6, where the bf16 model's rounding allows ~1e-2."""

    sharded = None

    def __init__(self):
        self.module = _model()
        self.grad = None

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)

    def before_backward(self, last):
        pass

    def step(self):
        self.grad = torch.cat([p.grad.flatten() for _, p in sorted(self.module.named_parameters())])
        return {"grad_norm": float(self.grad.norm())}


def _fp32_grad(cfg, batch, inputs):
    """The fp32 gradient (flat) of one update and the update's stats."""
    weights = _Fp32Weights()
    with mode("standard"):
        stats = update(cfg, get_loss(cfg.objective.loss), weights, batch, inputs, 1,
                       lambda loss: pytest.fail("bad loss"))
    return weights.grad, stats


def _fp32_batch(seed):
    batch = _batch(seed)
    with mode("standard"):
        logp = score(_model(), batch, 10_000, TEMPERATURE)[0]
    batch.behavior = logp.clone()
    return batch, logp


def _rel(a, b):
    return float((a - b).norm() / b.norm())


FP32 = dict(temperature=TEMPERATURE, group_size=3, prompts_per_step=2, max_new_tokens=6, kernel_mode="standard")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo", "blog"])
def test_micro_batched_gradient_is_the_whole_batch_gradient_at_fp32(loss):
    """fp32 throughout: the micro-batches' gradients add up to the whole batch's up to summation order (1e-6
    relative), which a token weighting off by a fraction of a percent would break."""
    batch, logp = _fp32_batch(3)
    cfg = TrainConfig(loss=loss, **FP32)
    assert len(batch.micro_batches(None, 12)) >= 3
    whole, stats = _fp32_grad(dataclasses.replace(cfg, max_tokens_per_microbatch=10_000), batch,
                              _inputs(batch, logp, loss))
    pieces, stats2 = _fp32_grad(dataclasses.replace(cfg, max_tokens_per_microbatch=12), batch,
                                _inputs(batch, logp, loss))
    assert float(whole.norm()) > 0 and _rel(pieces, whole) < 1e-6, _rel(pieces, whole)
    assert stats2["loss"] == pytest.approx(stats["loss"], abs=1e-6)


CORRECTIONS = ["tis-token", "tis-sequence", "mask-token", "mask-sequence"]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo", "blog"])
def test_corrections_cap_or_mask_the_mismatched_sequence(loss):
    """Sequence 0's sampler log-probs 2 nats below the trainer's on each token: its weight pi_old / mu is e^2 a token
    (e^(2 x length) a sequence), above the cap C = 1.5. TIS caps it at C, MIS masks it to 0, every other weight is 1,
    and the gradient is the uncorrected one with sequence 0's policy-gradient share g0 scaled by C or removed:
    g + (C - 1) g0, or g - g0. With sampler = trainer every weight is 1 and the gradient the same bits."""
    batch, logp = _fp32_batch(4)
    cfg = TrainConfig(loss=loss, **FP32)   # one micro-batch: the split is the test above's
    plain_inputs = _inputs(batch, logp, loss)
    plain, _ = _fp32_grad(cfg, batch, plain_inputs)
    first = (torch.arange(len(batch)) == 0).float()
    only0, _ = _fp32_grad(cfg, batch, dataclasses.replace(plain_inputs, advantages=plain_inputs.advantages * first))
    none, _ = _fp32_grad(cfg, batch, dataclasses.replace(plain_inputs, advantages=plain_inputs.advantages * 0))
    g0 = only0 - none   # blog's kl and entropy terms do not depend on the advantages: they cancel
    assert float(g0.norm()) > 0.05 * float(plain.norm()), "sequence 0's share must be large enough to see"
    real = batch.mask.bool()
    sampler = logp - 2.0 * first[:, None] * batch.mask
    for correction in CORRECTIONS:
        if get_loss(loss).sequence_level and correction.endswith("-token"):
            with pytest.raises(ValueError, match="use tis-sequence or mask-sequence"):
                TrainConfig(loss=loss, correction=correction)
            continue
        corrected = dataclasses.replace(cfg, correction=correction)
        batch.behavior = logp.clone()
        exact, _ = _fp32_grad(corrected, batch, _inputs(batch, logp, loss, correction))
        assert torch.equal(exact, plain), f"{correction}: sampler = trainer, the correction weighs 1"
        batch.behavior = sampler
        inputs = _inputs(batch, logp, loss, correction)
        cap = 1.5 if correction.startswith("tis") else 0.0
        assert (inputs.weights[0][real[0]] == cap).all() and (inputs.weights[1:][real[1:]] == 1).all(), correction
        got, _ = _fp32_grad(corrected, batch, inputs)
        want = plain + (cap - 1) * g0
        assert _rel(got, want) < 1e-5, f"{correction}: {_rel(got, want)} from g + (C - 1) g0; {_rel(got, plain)} from g"
    uncorrected, _ = _fp32_grad(cfg, batch, _inputs(batch, logp, loss))
    assert torch.equal(uncorrected, plain), "no correction: the sampler's log-probs play no part"


def test_clip_range_aggregation_and_kl_estimator_reach_the_update():
    """TrainConfig's clip_high and aggregation are the update's, and the KL in the loss is k2's unless set."""
    batch, logp = _fp32_batch(5)
    adv = _inputs(batch, logp).advantages
    cfg = TrainConfig(**FP32)
    # The old log-probs 0.05 below: a ratio of e^0.05 on every token, inside the published 0.2, outside 0.01.
    shifted = UpdateInputs(adv, logp - 0.05 * batch.mask, None, None)
    _, published = _fp32_grad(cfg, batch, shifted)
    _, tight = _fp32_grad(dataclasses.replace(cfg, clip_high=0.01), batch, shifted)
    positive = float((batch.mask * (adv > 0)[:, None]).sum() / batch.mask.sum())
    assert published["clip_high"] == 0 and tight["clip_high"] == pytest.approx(positive) and positive > 0
    # At ratio 1 the loss is -sum(A x weight): each group's advantages sum to 0, so GRPO's mean over sequences is 0,
    # and the token mean (ragged lengths) is -sum(A_i n_i) / N.
    on_policy = UpdateInputs(adv, logp, None, None)
    _, seq_mean = _fp32_grad(cfg, batch, on_policy)
    _, token_mean = _fp32_grad(dataclasses.replace(cfg, aggregation="token-mean"), batch, on_policy)
    lengths = batch.mask.sum(1)
    assert seq_mean["loss"] == pytest.approx(0.0, abs=1e-6)
    assert token_mean["loss"] == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), abs=1e-6)
    assert abs(token_mean["loss"]) > 1e-3
    # The KL to a reference 0.1 nats above on every token, the advantages 0 so that it is the whole loss: a token's
    # d/dlogp is -0.1 for k2, 1 - e^0.1 for k3, so k3's gradient is k2's times (e^0.1 - 1) / 0.1 ('auto' must be k2).
    # The logged kl is k3's value either way.
    kl_cfg = dataclasses.replace(cfg, kl_coef=0.1)
    with_ref = UpdateInputs(adv * 0, logp, None, logp + 0.1 * batch.mask)
    auto, auto_stats = _fp32_grad(kl_cfg, batch, with_ref)
    k3, k3_stats = _fp32_grad(dataclasses.replace(kl_cfg, kl_estimator="k3"), batch, with_ref)
    assert float(auto.norm()) > 0 and _rel(k3, auto * (math.exp(0.1) - 1) / 0.1) < 1e-5
    assert auto_stats["kl"] == k3_stats["kl"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-4)


def test_ppo_mini_batches_move_the_ratio_and_the_old_logprobs_source_matters():
    batch = _batch(5, n=6)
    weights = TrainWeights(_model(), "float32", 1e-3, "cpu")
    logp = _score(weights, batch)
    batch.behavior = logp.clone()
    cfg = TrainConfig(temperature=TEMPERATURE, group_size=3, prompts_per_step=2, kernel_mode="standard",
                      mini_batches=3, epochs=2, lr=3e-2)
    w = TrainWeights(_model(), "float32", cfg.optim.lr, "cpu")
    with mode("standard"):
        stats = update(cfg, get_loss("grpo"), w, batch, _inputs(batch, logp), 1, lambda loss: pytest.fail())
    assert stats["optimizer_steps"] == 6
    assert stats["ratio_mean"] != 1.0, "after the first mini-batch the ratio leaves 1"
    assert stats["clip_low"] + stats["clip_high"] > 0, "lr 3e-2 over 6 steps moves some tokens out of the clip"
    # old_logprobs='sampler': the sampler's log-probs are the denominator, so a mismatch enters the ratio at once.
    shifted = logp - 0.05 * batch.mask
    single = dataclasses.replace(cfg, mini_batches=1, epochs=1)
    _, recompute = _grads(single, batch, UpdateInputs(_inputs(batch, logp).advantages, logp, None, None))
    _, sampler = _grads(single, batch, UpdateInputs(_inputs(batch, logp).advantages, shifted, None, None))
    assert recompute["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert sampler["ratio_mean"] == pytest.approx(torch.exp(torch.tensor(0.05)).item(), rel=1e-4)
    with pytest.raises(ValueError, match="old_logprobs='sampler'"):
        TrainConfig(old_logprobs="sampler", correction="tis-token")
    with pytest.raises(ValueError, match="mini_batches=9 exceeds"):
        TrainConfig(mini_batches=9)


@pytest.mark.slow
@pytest.mark.parametrize("kernel_mode, adapters", [("invariant", False), ("standard", False), ("invariant", True)])
def test_activation_checkpointing_gives_the_same_gradient_bits(kernel_mode, adapters):
    """The trainer's own path: fp32 master gradients, dW accumulated into `main_grad` inside the products (also
    under recomputation, where autograd hands the backward other tensor objects than the parameters)."""
    batch = _batch(6, n=2)   # two ragged rows: each interpreted kernel runs a program per row
    lora_cfg = lora.LoraConfig(rank=4, alpha=8.0) if adapters else None
    weights = TrainWeights(build("tiny", device="cpu", dtype=torch.float32, seed=3), "float32", 1e-3, "cpu",
                           lora=lora_cfg)
    if adapters:  # nonzero B, so every adapter's gradient is nonzero
        with torch.no_grad():
            for k, m in weights.masters.items():
                m.copy_(torch.randn_like(m) * 0.1)
        weights.sync_model()
    mb = batch.micro_batches(None, 10_000)[0]
    grads = {}
    for recompute in RECOMPUTE:
        weights.zero_grad()
        with mode(kernel_mode):
            logp, _ = completion_logprobs(weights.model, mb, TEMPERATURE, recompute=recompute)
        # the backward outside the mode: the recomputation must still run the forward's kernels
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        assert all(p.grad is None for p in weights.model.parameters()), f"a bf16 gradient was left ({recompute})"
        grads[recompute] = {k: m.grad.clone() for k, m in weights.masters.items()}
    assert all(g.abs().sum() > 0 for g in grads["none"].values())
    for recompute in RECOMPUTE[1:]:
        for k in grads["none"]:
            assert torch.equal(grads["none"][k], grads[recompute][k]), \
                f"{k}: recompute={recompute} ran other kernels or rounded dW to bf16 ({kernel_mode})"


@pytest.mark.slow
def test_activation_checkpointing_keeps_less_for_the_backward():
    """What autograd keeps for the backward, by recompute setting: 'mlp' drops each MLP's three [T, I]
    activations, 'layers' keeps only the layers' inputs."""
    batch = _batch(6, n=3)
    model = build("tiny", device="cpu", dtype=torch.bfloat16, seed=3)
    lora.attach(model, lora.LoraConfig(rank=4, alpha=8.0))
    mb = batch.micro_batches(None, 10_000)[0]
    kept = {}
    for recompute in RECOMPUTE:
        saved = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = completion_logprobs(model, mb, TEMPERATURE, recompute=recompute)
        kept[recompute] = sum(saved.values())
        del logp
    cfg = model.config
    mlp = 3 * mb.ids.numel() * cfg.intermediate_size * 2 * cfg.num_hidden_layers   # gate, up, silu*up in bf16
    assert kept["none"] - kept["mlp"] >= mlp, kept
    assert kept["layers"] < kept["mlp"], kept
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, mlp, layers"):
        TrainConfig(activation_checkpointing=True)


# float32 masters under the default (invariant) kernels: dW goes into `main_grad` inside the products, the other
# gradients through the hook. bfloat16: AdamW on the bf16 weights themselves, no `main_grad` and no hook, so nothing
# here depends on the kernels: the standard ones (the invariant kernels' bf16 dW is checked against fp64 in
# test_kernels.py).
@pytest.mark.slow
@pytest.mark.parametrize("master_dtype, kernel_mode", [("float32", "invariant"), ("bfloat16", "standard")])
def test_weights_keep_one_copy_and_measure_the_exact_change(master_dtype, kernel_mode):
    start = _model(7)
    weights = TrainWeights(start, master_dtype, 1e-2, "cpu")
    if master_dtype == "float32":
        assert all(weights.masters[k].data_ptr() == v.data_ptr() for k, v in start.state_dict().items()), \
            "the starting model's fp32 tensors are the masters (no second copy)"
    before = {k: v.detach().float().clone() for k, v in weights.masters.items()}
    batch = _batch(8, n=3)
    mb = batch.micro_batches(None, 10_000)[0]
    for _ in range(2):  # two micro-batches' worth of gradient, accumulated
        with mode(kernel_mode):
            logp, _ = completion_logprobs(weights.model, mb, TEMPERATURE)
        logp.sum().backward()
    if master_dtype == "float32":
        assert all(p.grad is None for p in weights.model.parameters()), "no bf16 gradient stays resident"
        assert all(m.grad.dtype == torch.float32 for m in weights.masters.values())
    stats = weights.step()
    exact = sum(float(((weights.masters[k].detach().float() - before[k]).double() ** 2).sum()) for k in before)
    assert stats["weight_delta_l2"] == pytest.approx(exact ** 0.5, rel=1e-4) and exact > 0
    assert stats["grad_norm"] > 0
    model_w = dict(weights.model.named_parameters())
    assert all(torch.equal(model_w[k].detach(), weights.masters[k].detach().to(torch.bfloat16)) for k in before), \
        "the bf16 model is the cast of the updated weights"
    with pytest.raises(ValueError, match="master_dtype"):
        TrainConfig(master_dtype="float16")


def test_gradient_clipping_scales_the_gradient_adamw_sees():
    weights = TrainWeights(_model(), "float32", 1e-3, "cpu", weight_decay=0.01, max_grad_norm=0.5)
    seen = []
    step = weights.opt.step

    def record():
        seen.append(sum(float(p.grad.float().norm()) ** 2 for p in weights.params if p.grad is not None))
        step()

    weights.opt.step = record
    for p in weights.params:
        p.grad = torch.randn_like(p) * 3
    result = weights.step()
    assert result["grad_norm"] > 0.5, "the logged norm is the one before clipping"
    assert abs(sum(seen) ** 0.5 - 0.5) < 1e-4, "AdamW stepped on the gradient scaled to max_grad_norm"
    assert weights.opt.defaults["weight_decay"] == 0.01
