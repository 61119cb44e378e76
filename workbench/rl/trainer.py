"""GRPO-family training with the generator and trainer on one model and one set of kernels.

Each step: prompts -> a group of completions per prompt (the embedded generator) -> rewards ->
group advantages -> the trainer's recomputation of the sampled tokens' log-probs, checked
against the generator's (the parity check) -> one policy update on fp32 master weights ->
the one fp32 -> bf16 cast into the model both sides use -> a checksum that the generator's
weights are the trainer's. Synchronous (policy lag 0). An optional KL to the frozen starting
policy (k1/k2/k3) goes into the loss or the reward.

In `invariant` mode any log-prob difference stops the run (parity="error"); in `standard` mode
the mismatch is measured and logged. Metrics are a long table (step, metric, value, variant, seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..config import check_at_least_one, check_positive
from ..env import resolve_device
from ..generation import SamplingParams, generate, parity_summary, parity_table, sampled_logprobs
from ..kernels import mode
from ..models import build, copy_weights, load_pretrained, load_tokenizer, save_pretrained
from .losses import AGGREGATIONS, LossConfig, aggregate, get_loss, group_advantages, importance_weights, kl_estimate
from .policy import PolicyConfig, train_policy
from .tasks import Arithmetic


class ParityError(RuntimeError):
    """Generator and trainer log-probs differ in a run that claims bitwise parity."""


@dataclass(frozen=True)
class TrainConfig:
    policy: str = ""
    """Starting checkpoint (a Hugging Face folder with tokenizer); empty: train the tiny arithmetic policy."""
    out_dir: str = "runs/train"
    """Where metrics and checkpoints go."""
    kernel_mode: str = "invariant"
    """'invariant' (bitwise generator = trainer) or 'standard' (the mismatched control)."""
    loss: str = "grpo"
    """grpo, dr_grpo, dapo or gspo."""
    steps: int = 10
    """Policy updates."""
    prompts_per_step: int = 4
    """Prompts sampled per step."""
    group_size: int = 4
    """Completions per prompt."""
    max_new_tokens: int = 4
    """Completion length limit."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    lr: float = 1e-3
    """AdamW learning rate on the fp32 master weights."""
    difficulty: int = 1
    """Arithmetic difficulty."""
    seed: int = 0
    """Seed of the data order, the sampling and the starting policy."""
    parity: str = "error"
    """In invariant mode, what a log-prob difference does: 'error' or 'warn'."""
    correction: str = "none"
    """Off-policy correction: none, tis-token, tis-sequence, mask-token, mask-sequence."""
    correction_cap: float = 2.0
    """Cap C of the correction (truncate at C, or mask outside [1/C, C])."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen starting policy (0: no reference model at all)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (see losses.kl_estimate)."""
    kl_in_reward: bool = False
    """Subtract the KL from each sequence's reward instead of adding it to the loss."""
    sync: str = "shared"
    """Weight sync into the generator: shared (same bf16 model), copy, or checkpoint (through disk)."""
    checkpoint_every: int = 5
    """Write a resumable checkpoint every this many steps (and at the end)."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when there is one)."""
    progress: bool = True
    """A progress bar on the terminal (reward, parity) while training."""

    def __post_init__(self):
        get_loss(self.loss)
        if self.kernel_mode not in ("invariant", "standard"):
            raise ValueError(f"kernel_mode must be 'invariant' or 'standard', got {self.kernel_mode!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (GRPO compares samples of one prompt), "
                             f"got {self.group_size}")
        check_positive("lr", self.lr)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for RL sampling, got {self.temperature!r}")
        check_at_least_one(self, "steps", "prompts_per_step", "max_new_tokens", "checkpoint_every")
        if self.parity not in ("error", "warn"):
            raise ValueError(f"parity must be 'error' or 'warn', got {self.parity!r}")
        if self.correction not in ("none", "tis-token", "tis-sequence", "mask-token", "mask-sequence"):
            raise ValueError(f"unknown correction {self.correction!r}")
        if self.kl_coef < 0 or not math.isfinite(self.kl_coef):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; choose k1, k2 or k3")
        if self.sync not in ("shared", "copy", "checkpoint"):
            raise ValueError(f"sync must be 'shared', 'copy' or 'checkpoint', got {self.sync!r}")


def weights_checksum(model) -> str:
    """sha256 over every parameter's bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _starting_policy(cfg: TrainConfig, out: Path, device: str):
    if cfg.policy:
        return load_pretrained(cfg.policy, dtype=torch.float32, device=device), load_tokenizer(cfg.policy)
    model, tok, _ = train_policy(PolicyConfig(seed=cfg.seed, difficulty=cfg.difficulty, device=device), out / "policy")
    return model, tok


def _completion_batch(tokenizer, prompts, completions):
    """(ids [B, T], lens [B], mask [B, T-1] on the positions whose next token is a completion token)."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((len(seqs), t - 1))
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(p) - 1 : len(s) - 1] = 1
    return ids, torch.tensor([len(s) for s in seqs], dtype=torch.int32), mask


def _save_checkpoint(out: Path, step: int, masters: dict, opt, metrics: pd.DataFrame, cfg: TrainConfig) -> None:
    """Atomic: written to a temporary folder, then renamed over `checkpoint/` (a crash keeps the old one)."""
    tmp = out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in masters.items()}, tmp / "masters.safetensors")
    state = opt.state_dict()
    tensors = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg),
                                                "param_groups": state["param_groups"]}, indent=1))
    metrics.to_csv(tmp / "metrics.csv", index=False)
    final = out / "checkpoint"
    old = out / ".checkpoint-old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


# Fields a resumed run may change; any other difference would silently make another run.
_RESUMABLE_CHANGES = {"steps", "resume", "checkpoint_every", "device", "out_dir", "progress"}


def _load_checkpoint(out: Path, masters: dict, opt, cfg: TrainConfig) -> tuple[int, pd.DataFrame]:
    ck = out / "checkpoint"
    if not (ck / "state.json").exists():
        raise FileNotFoundError(f"resume: no checkpoint in {ck}; run without resume first")
    saved_cfg = json.loads((ck / "state.json").read_text())["config"]
    changed = {k: (saved_cfg.get(k), v) for k, v in asdict(cfg).items()
               if k not in _RESUMABLE_CHANGES and saved_cfg.get(k) != (list(v) if isinstance(v, tuple) else v)}
    if changed:
        raise ValueError(f"resume: the config differs from the checkpoint's in {changed} (saved, now); "
                         "resume with the same settings or start a new out_dir")
    saved = load_file(ck / "masters.safetensors")
    with torch.no_grad():
        for k, v in masters.items():
            v.copy_(saved[k])
    state = json.loads((ck / "state.json").read_text())
    tensors = load_file(ck / "optimizer.safetensors")  # load_state_dict moves them to the parameters' device
    opt_state = {"param_groups": state["param_groups"], "state": {}}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        opt_state["state"].setdefault(int(i), {})[name] = v
    opt.load_state_dict(opt_state)
    return state["step"], pd.read_csv(ck / "metrics.csv")


def train(cfg: TrainConfig) -> pd.DataFrame:
    """Run GRPO-family training; returns the long metrics table (also written to out_dir/metrics.csv)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    master_model, tok = _starting_policy(cfg, out, device)
    masters = {k: v.detach().clone().float() for k, v in master_model.state_dict().items()}
    model = build(master_model.config, device=device, dtype=torch.bfloat16, seed=None)
    copy_weights(masters, model)
    gen_model = model if cfg.sync == "shared" else build(model.config, device=device, dtype=torch.bfloat16, seed=None)
    reference = None
    if cfg.kl_coef > 0:
        reference = build(model.config, device=device, dtype=torch.bfloat16, seed=None)
        copy_weights(masters, reference)
    params = [masters[k] for k in sorted(masters)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    spec = get_loss(cfg.loss)
    loss_cfg: LossConfig = spec.defaults
    task = Arithmetic(seed=cfg.seed, difficulty=cfg.difficulty)
    variant = cfg.kernel_mode
    rows: list[dict] = []
    start_step = 0
    if cfg.resume:
        start_step, previous = _load_checkpoint(out, masters, opt, cfg)
        rows = previous.to_dict("records")
        copy_weights(masters, model)

    def log(step, metric, value):
        rows.append({"step": step, "metric": metric, "value": float(value), "variant": variant, "seed": cfg.seed})

    bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, desc=f"train ({cfg.kernel_mode})")
    with mode(cfg.kernel_mode):
        for step in range(start_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            # Sync: the generator gets the trainer's bf16 weights, checked by checksum.
            if cfg.sync == "copy":
                copy_weights({k: v.detach() for k, v in model.state_dict().items()}, gen_model)
            elif cfg.sync == "checkpoint":
                save_pretrained(model, out / "sync")
                gen_model = load_pretrained(out / "sync", dtype=torch.bfloat16, device=device)
            if cfg.sync != "shared" and weights_checksum(gen_model) != weights_checksum(model):
                raise RuntimeError(f"step {step}: generator weights differ from the trainer's after the sync")
            t_sync = time.perf_counter()

            problems = task.problems(cfg.prompts_per_step, start=step * cfg.prompts_per_step)
            prompts = [tok(p.prompt)["input_ids"] for p in problems for _ in range(cfg.group_size)]
            sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                      stop_token_ids=(tok.eos_token_id,), seed=cfg.seed * 1_000_003 + step)
            gen = generate(gen_model, prompts, sampling, request_ids=list(range(len(prompts))))
            t_gen = time.perf_counter()

            completions = [c.tokens for c in gen.completions]
            texts = [tok.decode(c, skip_special_tokens=True) for c in completions]
            rewards = torch.tensor([task.reward(t, problems[i // cfg.group_size]) for i, t in enumerate(texts)],
                                   device=device)

            ids, lens, mask = (t.to(device) for t in _completion_batch(tok, prompts, completions))
            targets = torch.roll(ids, -1, dims=1)
            logits = model(ids, seq_lens=lens)
            # Position t scores the token at t + 1 (the last position's target is a dummy, masked).
            logp = sampled_logprobs(logits, targets, sampling)[:, :-1]                       # [B, T-1]
            kl = None
            if reference is not None:
                with torch.no_grad():
                    ref_logp = sampled_logprobs(reference(ids, seq_lens=lens), targets, sampling)[:, :-1]
                kl = kl_estimate(logp, ref_logp, cfg.kl_estimator) * mask
                log(step, "kl", kl.detach().sum() / mask.sum())
            shaped = rewards - cfg.kl_coef * kl.detach().sum(1) if kl is not None and cfg.kl_in_reward else rewards
            adv = group_advantages(shaped, cfg.group_size, scale=spec.scale_advantages)
            behavior = torch.zeros_like(mask)
            for i, c in enumerate(gen.completions):
                start = len(prompts[i]) - 1
                behavior[i, start : start + len(c.tokens)] = c.sampled_logprobs.to(device)
            old = logp.detach()
            table = parity_table([c.sampled_logprobs for c in gen.completions],
                                 [old[i, len(prompts[i]) - 1 : len(prompts[i]) - 1 + len(c.tokens)].cpu()
                                  for i, c in enumerate(gen.completions)], completions)
            parity = parity_summary(table)
            if cfg.kernel_mode == "invariant" and not parity["bitwise_identical"]:
                msg = (f"step {step}: generator and trainer log-probs differ on {parity['tokens_differing']} of "
                       f"{parity['tokens']} tokens (max |diff| {parity['max_abs_diff']:.3g}) in invariant mode")
                if cfg.parity == "error":
                    raise ParityError(msg + "; the last good checkpoint is in " + str(out / "checkpoint"))
                print("warning:", msg)

            norm = cfg.max_new_tokens if loss_cfg.aggregation == AGGREGATIONS[2] else None
            weights = None
            if cfg.correction != "none":
                kind, level = cfg.correction.split("-")
                weights = importance_weights(old, behavior, mask, level, "truncate" if kind == "tis" else "mask",
                                             cfg.correction_cap)
                log(step, "is_weight_mean", (weights * mask).sum() / mask.sum())
            loss, stats = spec.fn(logp, old, adv, mask, LossConfig(loss_cfg.eps_low, loss_cfg.eps_high,
                                                                   loss_cfg.aggregation, norm), weights)
            if kl is not None and not cfg.kl_in_reward:
                loss = loss + cfg.kl_coef * aggregate(kl, mask, loss_cfg.aggregation, norm)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: the loss is {loss.item()}; the last good checkpoint is in "
                                         f"{out / 'checkpoint'}")
            model.zero_grad(set_to_none=True)
            loss.backward()
            named = dict(model.named_parameters())
            for k, m in masters.items():
                m.grad = named[k].grad.float()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
            before = {k: v.detach().clone() for k, v in masters.items()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                copy_weights({k: v.detach() for k, v in masters.items()}, model)
            t_train = time.perf_counter()

            log(step, "loss", loss.item())
            log(step, "reward_mean", rewards.mean())
            log(step, "reward_std", rewards.std())
            log(step, "accuracy", (rewards > 0).float().mean())
            for k, v in stats.items():
                log(step, k, v.item())
            log(step, "grad_norm", grad_norm.item())
            log(step, "response_length", sum(map(len, completions)) / len(completions))
            log(step, "truncation_rate", sum(c.finish_reason == "length" for c in gen.completions) / len(completions))
            delta = sum(((masters[k] - before[k]) ** 2).sum() for k in masters).sqrt()
            log(step, "weight_delta_l2", delta.item())
            log(step, "parity_max_abs_diff", parity["max_abs_diff"])
            log(step, "parity_mean_abs_diff", parity["mean_abs_diff"])
            log(step, "parity_tokens_differing", parity["tokens_differing"])
            log(step, "sampler_trainer_kl", parity["kl"])
            log(step, "time_sync", t_sync - t0)
            log(step, "time_generate", t_gen - t_sync)
            log(step, "time_train", t_train - t_gen)
            log(step, "tokens_per_s", sum(map(len, completions)) / (t_train - t0))
            bar.set_postfix(reward=f"{rewards.mean().item():.3f}", differing=parity["tokens_differing"])
            bar.update(1)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                _save_checkpoint(out, step, {k: v.detach() for k, v in masters.items()}, opt,
                                 pd.DataFrame(rows), cfg)
    bar.close()
    metrics = pd.DataFrame(rows)
    metrics.to_csv(out / "metrics.csv", index=False)
    return metrics
