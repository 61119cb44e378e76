"""The trainer's log-probs of the sampled completion tokens: one function for the policy being trained,
the lagged generator's weights and the reference model.

Only completion positions reach the LM head: the decoder's hidden states at the positions that predict a
completion token go through `linear_logprobs` (the LM head fused with the log-softmax, chunked over
tokens), so no [tokens, vocab] logits exist, in any dtype. In `invariant` mode a token's log-prob is the
bits the generator reported for it (same kernels, same temperature), whatever the micro-batch, padded or
packed. The workbench's own model (`CausalLM`) scores packed micro-batches (no work on padding) and updates on
them unless `optim.packed_sequences` is off; torchtitan's routed model (`titan.model`) runs padded ones. The weights' gradients are not bitwise alike between the two
layouts: dW sums over a micro-batch's tokens, and the layouts group the tokens into other tiles and micro-batches.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..kernels import linear_logprobs
from ..models.transformer import CausalLM
from .rollout import MicroBatch, RolloutBatch


def packs(model) -> bool:
    """Whether `model` takes packed micro-batches (`CausalLM.hidden_states(packed=...)`, also FSDP2-sharded, whose
    class derives from it); torchtitan's routed model runs right-padded batches only."""
    return isinstance(model, CausalLM)


def completion_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool = False,
                        recompute: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """([b, width] fp32 log-probs, [b, width] entropies or None) of `mb`'s completion tokens, 0 on padding;
    differentiable in the model's weights when grad is enabled; `recompute` as in `CausalLM.hidden_states`."""
    if mb.packed is None:
        hidden = model.hidden_states(mb.ids, mb.lens, recompute=recompute)[mb.rows, mb.positions]  # [n, H]
    else:
        hidden = model.hidden_states(mb.ids, recompute=recompute, packed=mb.packed)[0, mb.positions]
    lp, ent = linear_logprobs(hidden, model.lm_head_weight, mb.targets, temperature,
                              with_entropy=with_entropy)                                    # [n]
    shape = (len(mb.index), mb.width)
    place = (mb.rows, mb.columns)
    logp = torch.zeros(shape, device=lp.device, dtype=lp.dtype).index_put(place, lp)
    if ent is None:
        return logp, None
    return logp, torch.zeros(shape, device=ent.device, dtype=ent.dtype).index_put(place, ent.detach())


@torch.no_grad()
def score(model, batch: RolloutBatch, max_tokens: int, temperature: float, with_entropy: bool = False,
          rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's [B, T] log-probs (and entropies) under `model`, micro-batch by micro-batch: of the rows `rows`
    (default all; the others' are 0)."""
    logp = torch.zeros_like(batch.mask)
    ent = torch.zeros_like(batch.mask) if with_entropy else None
    index = None if rows is None else torch.tensor(rows, dtype=torch.long)
    for mb in batch.micro_batches(index, max_tokens, packs(model)):
        lp, e = completion_logprobs(model, mb, temperature, with_entropy)
        logp[mb.index, : mb.width] = lp
        if ent is not None:
            ent[mb.index, : mb.width] = e
    return logp, ent


def parity_stats(generator: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Generator vs trainer log-probs [B, T] on the real tokens: tokens whose fp32 bits differ, the max and
    mean |difference|, KL(sampler || trainer) per token, and the effective sample size of the sequences'
    importance weights, and the spread of the sequences' log-ratios. Vectorised: a step holds ~10^5 tokens.

    KL: the k3 estimate mean(r - 1 - log r), r = trainer / sampler probability of each sampled token
    (unbiased and never negative, so it has a log axis; VeXact reports the same). ESS: with the sequence
    weights w = exp(sum over its tokens of trainer - sampler), (sum w)^2 / (B sum w^2), in (0, 1]; 1 when
    every weight is equal (bitwise parity), small when a few sequences dominate an importance-weighted
    update (the leading indicator of collapse in the off-policy literature).

    Sequence log-ratio: sum over a sequence's tokens of trainer - sampler, the log of the ratio a sequence-level
    loss built on the sampler's log-probs starts from (the blog's loss; GSPO divides it by the length). Its
    standard deviation over the step's sequences grows with the length (a sum of per-token differences), and the
    share outside log(1.2) is the share a 0.2 clip range would clip before any update."""
    real = mask.bool()
    n = max(int(real.sum()), 1)
    log_r = (trainer - generator) * real
    diff = -log_r[real]
    differ = (generator.contiguous().view(torch.int32) != trainer.contiguous().view(torch.int32)) & real
    k3 = (torch.expm1(log_r) - log_r) * real
    seq = log_r.double().sum(1)
    w = torch.exp(seq - seq.max())  # the scale cancels in the ratio
    rows = real.any(1)
    spread = float(seq[rows].std()) if int(rows.sum()) > 1 else 0.0
    outside = float((seq[rows].abs() > math.log(1.2)).double().mean()) if bool(rows.any()) else 0.0
    return {"tokens": int(real.sum()), "tokens_differing": int(differ.sum()),
            "max_abs_diff": float(diff.abs().max()) if diff.numel() else 0.0,
            "mean_abs_diff": float(diff.abs().sum()) / n, "kl": float(k3.sum()) / n,
            "ess": float(w.sum() ** 2 / (len(w) * (w * w).sum())), "seq_logratio_sd": spread,
            "seq_ratio_outside_1.2": outside}


def save_token_logprobs(path: Path, generator: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> None:
    """The real tokens' generator and trainer log-probs (fp32, row-major over [B, T]) as an .npz file."""
    real = mask.bool()
    np.savez_compressed(path, generator=generator[real].cpu().numpy(), trainer=trainer[real].cpu().numpy())
