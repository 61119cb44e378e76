"""The GRPO-family losses against hand-computed numbers."""

import math

import pytest
import torch

from helpers import seed_for
from workbench.rl.config import TrainConfig
from workbench.rl.losses import (
    LossConfig,
    Totals,
    aggregate,
    get_loss,
    group_advantages,
    importance_weights,
    kl_estimate,
    sequence_ppo_loss,
    token_ppo_loss,
)
from workbench.sweep.grid import parse_grid

LN = math.log


def test_group_advantages():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    a = group_advantages(r, 4)
    s = 0.5 / math.sqrt(1 / 3)  # sample std of (1, 0, 0, 1) is sqrt(1/3)
    assert torch.allclose(a, torch.tensor([s, -s, -s, s, 0, 0, 0, 0]), atol=1e-5)
    assert torch.equal(group_advantages(r, 4, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # 'batch' (the blog's): normalise the batch, then centre each group = (r - group mean) / batch std.
    batch = group_advantages(r, 4, scale="batch")
    normed = (r - r.mean()) / r.std()
    assert torch.allclose(batch, (normed.view(2, 4) - normed.view(2, 4).mean(1, keepdim=True)).flatten(), atol=1e-6)
    assert torch.equal(group_advantages(torch.ones(8), 4, scale="batch"), torch.zeros(8))  # std 0: no division
    with pytest.raises(ValueError, match="advantage scale"):
        group_advantages(r, 4, scale="rank")
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        group_advantages(r, 1)
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(r, 3)


def test_kl_penalty_is_subtracted_after_the_task_rewards_scaling():
    """The KL in the reward with GRPO's group scaling (issue 42): a group whose task rewards are all equal gets
    advantages of the KL penalty's size, not +-1; a group with a success keeps its task advantage, moved by the
    centred penalty alone; less KL, more advantage."""
    rewards = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0])
    kl = torch.tensor([0.010, 0.012, 0.011, 0.013, 0.010, 0.012, 0.011, 0.013])
    penalty = 0.05 * kl
    folded = group_advantages(rewards - penalty, 4)   # the penalty inside the reward, then the scaling: the old way
    assert folded[:4].abs().max() > 1, "the failure this guards against: KL differences blown up to a success's size"
    a = group_advantages(rewards, 4, penalty=penalty)
    centred = penalty.view(2, 4) - penalty.view(2, 4).mean(1, keepdim=True)
    assert torch.allclose(a[:4], -centred[0], atol=1e-9) and a[:4].abs().max() < 1e-4
    assert torch.allclose(a[4:], group_advantages(rewards[4:], 4) - centred[1], atol=1e-7)
    assert a[0] > a[2] > a[1] > a[3], "the sequence with the least KL gets the largest advantage"
    # Unscaled (Dr.GRPO), the two orders are one.
    assert torch.allclose(group_advantages(rewards, 4, "none", penalty=penalty),
                          group_advantages(rewards - penalty, 4, "none"), atol=1e-7)
    assert torch.equal(group_advantages(rewards, 4, penalty=torch.zeros(8)), group_advantages(rewards, 4))
    with pytest.raises(ValueError, match="penalty must have the rewards' shape"):
        group_advantages(rewards, 4, penalty=penalty[:4])


def test_aggregations():
    x = torch.tensor([[1.0, 2, 3], [4, 5, 99]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert aggregate(x, m, "token-mean").item() == 3.0
    assert aggregate(x, m, "seq-mean-token-mean").item() == 3.25
    assert aggregate(x, m, "seq-mean-token-sum-norm", norm=3).item() == 2.5
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x, m, "mean")
    with pytest.raises(ValueError, match="positive constant"):
        aggregate(x, m, "seq-mean-token-sum-norm")


def test_kl_estimators():
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * LN(2) ** 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN(2))
    assert kl_estimate(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_gradients_in_the_loss():
    """Each estimator's gradient as a loss term, in expectation over tokens of pi (a categorical of 6), against the
    analytic gradients: k2's is that of KL(pi || ref), k3's that of KL(ref || pi), k1's is 0. The expectation
    exactly (each token's gradient weighted by its probability, the weights detached) and by Monte Carlo."""
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=g, dtype=torch.float64) * 0.7
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64) * 0.7, 0)

    def grad(f):
        t = theta.clone().requires_grad_(True)
        f(torch.log_softmax(t, 0)).backward()
        return t.grad

    forward = grad(lambda logp: (logp.exp() * (logp - ref)).sum())    # KL(pi || ref)
    reverse = grad(lambda logp: (ref.exp() * (ref - logp)).sum())     # KL(ref || pi)
    assert (forward - reverse).abs().max() > 1e-3, f"seed {seed}: the two KLs' gradients must differ to tell k2 from k3"
    tokens = torch.multinomial(torch.softmax(theta, 0), 400_000, replacement=True, generator=g)
    for estimator, want in (("k1", torch.zeros(6, dtype=torch.float64)), ("k2", forward), ("k3", reverse)):
        exact = grad(lambda logp: (logp.exp().detach() * kl_estimate(logp, ref, estimator)).sum())
        sampled = grad(lambda logp: kl_estimate(logp[tokens], ref[tokens], estimator).mean())
        assert torch.allclose(exact, want, atol=1e-12), f"seed {seed}: {estimator} {exact} vs {want}"
        assert (sampled - want).abs().max() < 0.01, f"seed {seed}: {estimator} Monte Carlo {sampled} vs {want}"


def test_kl_estimator_of_each_path():
    """k1 in the loss is refused (its gradient's expectation is 0); 'auto' is k2 in the loss, k3 in the reward."""
    assert TrainConfig(kl_coef=0.1).objective.kl_estimator_used == "k2"
    assert TrainConfig(kl_coef=0.1, kl_in_reward=True).objective.kl_estimator_used == "k3"
    assert TrainConfig(kl_coef=0.1, kl_estimator="k3").objective.kl_estimator_used == "k3"
    assert TrainConfig(kl_coef=0.1, kl_in_reward=True, kl_estimator="k1").objective.kl_estimator_used == "k1"
    with pytest.raises(ValueError, match="kl_estimator='k1' in the loss has a gradient of expectation 0"):
        TrainConfig(kl_coef=0.1, kl_estimator="k1")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        TrainConfig(kl_estimator="k4")


def test_clip_range_and_aggregation_are_settable_and_checked():
    """TrainConfig's clip_low / clip_high / aggregation over the loss's published settings (0 and empty keep them);
    the sweep grid reaches them by name; a sequence-level loss refuses an aggregation it would ignore."""
    assert TrainConfig(loss="grpo").loss_config() == LossConfig(0.2, 0.2, "seq-mean-token-mean", None)
    assert TrainConfig(loss="grpo", clip_high=0.28, aggregation="token-mean").loss_config() == \
        LossConfig(0.2, 0.28, "token-mean", None)
    assert TrainConfig(loss="dr_grpo", max_new_tokens=7).loss_config().norm == 7
    assert TrainConfig(loss="dapo", aggregation="seq-mean-token-sum-norm", max_new_tokens=5).loss_config() == \
        LossConfig(0.2, 0.28, "seq-mean-token-sum-norm", 5)
    assert TrainConfig(loss="gspo", clip_low=1e-3).loss_config() == LossConfig(1e-3, 4e-4, "seq-mean-token-mean")
    axes = parse_grid(["clip_low=0.1,0.2", "clip_high=0.28", "aggregation=token-mean,seq-mean-token-mean"],
                      TrainConfig, "out_dir")
    assert axes == {"clip_low": [0.1, 0.2], "clip_high": [0.28],
                    "aggregation": ["token-mean", "seq-mean-token-mean"]}
    for loss in ("gspo", "blog"):
        with pytest.raises(ValueError, match=f"loss '{loss}' averages one term per sequence and takes no aggregation"):
            TrainConfig(loss=loss, aggregation="token-mean")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        TrainConfig(aggregation="mean")
    with pytest.raises(ValueError, match=r"clip_low must lie in \[0, 1\)"):
        TrainConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high must be a finite number >= 0"):
        TrainConfig(clip_high=float("inf"))


def _batch():
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, torch.ones(2, 2)


def test_grpo_and_dapo_clipping():
    logp, old, adv, mask = _batch()
    # seq 0 (A=+1): ratio 1.5 -> clipped at 1.2 -> -1.2; ratio 0.5 -> -0.5.
    # seq 1 (A=-1): ratio 1.5 -> 1.5 (pessimistic branch); ratio 0.5 -> clipped at 0.8 -> 0.8.
    loss, stats = token_ppo_loss(logp, old, adv, mask, LossConfig(0.2, 0.2, "seq-mean-token-mean"))
    assert loss.item() == pytest.approx(((-1.2 - 0.5) / 2 + (1.5 + 0.8) / 2) / 2)
    assert stats["clip_high"].item() == 0.25 and stats["clip_low"].item() == 0.25
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    dapo = get_loss("dapo")
    loss, _ = dapo.fn(logp, old, adv, mask, dapo.defaults)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4)


def test_on_policy_gradient_is_the_plain_policy_gradient():
    """At ratio 1 (bitwise parity), d loss / d logp = -A / (B * tokens of the sequence) for GRPO."""
    old = torch.randn(2, 3)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([0.7, -1.3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    grpo = get_loss("grpo")
    loss, stats = grpo.fn(logp, old, adv, mask, grpo.defaults)
    loss.backward()
    want = -adv[:, None] * mask / (2 * mask.sum(1, keepdim=True))
    assert torch.allclose(logp.grad, want) and stats["ratio_mean"].item() == 1.0


def test_gspo_sequence_ratio():
    logp, old, adv, mask = _batch()
    ratio = math.sqrt(1.5 * 0.5)  # exp(mean(log 1.5, log 0.5))
    loss, stats = sequence_ppo_loss(logp, old, adv, mask, get_loss("gspo").defaults)
    assert stats["seq_ratio_mean"].item() == pytest.approx(ratio)
    # A=+1: min(0.866, 0.9997) = 0.866; A=-1: min(-0.866, -0.9997) = -0.9997.
    assert loss.item() == pytest.approx((-ratio + (1 - 3e-4)) / 2, rel=1e-5)


def test_gspo_reads_sequence_weights_at_the_completion_tokens():
    """The trainer's layout: [B, T] over prompt + completion, the mask on the completion only. A sequence-level
    weight (constant over the row's completion, as `importance_weights` gives it) scales that sequence's loss;
    what sits at prompt positions (column 0 included) plays no part."""
    logp, old, adv, mask = _batch()
    pad = lambda t, v: torch.cat([torch.full((t.shape[0], 2), v, dtype=t.dtype), t], 1)  # noqa: E731
    logp, old, mask = pad(logp, 0.0), pad(old, 0.0), pad(mask, 0.0)
    cfg = get_loss("gspo").defaults
    base, _ = sequence_ppo_loss(logp, old, adv, mask, cfg)
    weights = torch.where(mask.bool(), torch.tensor([[0.5], [2.0]]), torch.tensor(1.0))  # 1 at the prompt
    weighted, _ = sequence_ppo_loss(logp, old, adv, mask, cfg, weights)
    per_seq, _ = zip(*(sequence_ppo_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], cfg)
                       for i in range(2)))
    assert weighted.item() == pytest.approx((0.5 * per_seq[0].item() + 2.0 * per_seq[1].item()) / 2, rel=1e-6)
    assert weighted.item() != pytest.approx(base.item())


def test_importance_weights():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    beh = torch.log(torch.tensor([[0.25, 0.5]]))
    m = torch.ones(1, 2)
    assert torch.allclose(importance_weights(old, beh, m, "token", "truncate", 1.5), torch.tensor([[1.5, 1.0]]))
    assert torch.equal(importance_weights(old, beh, m, "token", "mask", 1.5), torch.tensor([[0.0, 1.0]]))
    assert torch.allclose(importance_weights(old, beh, m, "sequence", "truncate", 3.0), torch.tensor([[2.0, 2.0]]))
    assert torch.equal(importance_weights(old, beh, m, "sequence", "mask", 1.5), torch.tensor([[0.0, 0.0]]))
    assert torch.equal(importance_weights(old, old, m, "sequence", "mask", 1.5), torch.ones(1, 2))
    with pytest.raises(ValueError, match="cap must be > 1"):
        importance_weights(old, beh, m, "token", "truncate", 1.0)


def test_unknown_loss():
    with pytest.raises(ValueError, match="unknown loss 'ppo2'"):
        get_loss("ppo2")


def _simple_rl_loss(token_lps, sampler_lps, adv):
    """torchtitan simple_rl.py's compute_policy_gradient_loss_vllm, transcribed for lists of per-sequence tensors."""
    total = torch.stack([t.sum() for t in token_lps])
    ref = torch.tensor([float(s.sum()) for s in sampler_lps])
    log_ratio = total - ref
    ratio = torch.exp(log_ratio)
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    entropy = -torch.cat(token_lps).mean()
    return pg - 0.01 * entropy + 0.1 * (ratio - 1 - log_ratio).mean()


def test_blog_loss_is_simple_rl_term_for_term():
    """Ragged sequences in the padded [B, T] layout, random log-probs: the loss and its gradient equal the
    source's per-sequence loop, also when cut into two micro-batches with the step's Totals."""
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    lens = [5, 2, 7, 3]
    logp = -torch.rand(4, 7, generator=g) * 3
    old = logp + torch.randn(4, 7, generator=g) * 0.1
    adv = torch.randn(4, generator=g)
    mask = torch.zeros(4, 7)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    spec = get_loss("blog")
    a = logp.clone().requires_grad_(True)
    loss, stats = spec.fn(a, old, adv, mask, spec.defaults)
    loss.backward()
    b = logp.clone().requires_grad_(True)
    ref = _simple_rl_loss([b[i, :n] for i, n in enumerate(lens)], [old[i, :n] for i, n in enumerate(lens)], adv)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-6), f"seed {seed}"
    totals = Totals.of(mask)
    c = logp.clone().requires_grad_(True)
    parts = [spec.fn(c[rows], old[rows], adv[rows], mask[rows], spec.defaults, None, totals)[0]
             for rows in (slice(0, 1), slice(1, 4))]
    sum(parts).backward()
    assert torch.allclose(sum(parts), ref, atol=1e-6) and torch.allclose(c.grad, b.grad, atol=1e-6), f"seed {seed}"
    ratio = torch.exp(((logp - old) * mask).sum(1))
    assert torch.allclose(stats["seq_ratio_mean"], ratio.mean()), f"seed {seed}"
    assert torch.allclose(stats["seq_ratio_outside_clip"], ((ratio < 0.8) | (ratio > 1.2)).float().mean()), \
        f"seed {seed}"
