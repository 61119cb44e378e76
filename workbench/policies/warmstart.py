"""A supervised warm start: fine-tune a pretrained policy on a task's own right answers until its sampled reward
leaves room for RL, and save it as the starting policy of RL runs.

Why: an RL run learns from the spread of rewards within a group. A policy that starts near 0 (SmolLM2-135M-Instruct
on the counting task, as measured in docs/results/2026-11-27_offarm-probe-h100_8217c92) gives every group the same
reward, so nothing is learned, in either arm of an ON/OFF comparison. A cold start on the task's own format
(as DeepSeek-R1's and most RL recipes have) moves the start rate into the range where RL can act. It measures that
rate the way the RL runs will meet it: sampled at their temperature, scored by the task's reward, on problems the
fine-tune did not see.

The fine-tune runs the standard kernels with fp32 weights and AdamW, under torch's deterministic algorithms: the
same settings give the same bits on the same GPU and software, so each GPU hold can make its own copy of a starting
policy that the regime map's arms share (they are paired only from the same weights' digest, and nothing but a
hold's outputs survives it). The saved checkpoint is bf16, through the one cast path (`selftrained.save_policy`), as
every starting policy.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..config import check_at_least_one, check_positive
from ..env import resolve_device
from ..generation import SamplingParams, generate
from ..kernels import mode
from ..models import encode_prompt, load_pretrained, load_tokenizer, resolve_model
from ..rundir import POLICY_FILES, claim
from ..tasks import make_task
from .selftrained import answer_batch, save_policy, supervised_step


@dataclass(frozen=True)
class WarmStartConfig:
    policy: str = "smollm2-135m-instruct"
    """The pretrained policy to fine-tune: registry name, folder, .gguf or hub id."""
    task: str = "counting"
    """A task whose problems say what their right answer is (`answer_text`): counting."""
    difficulty: int = 2
    """The task's difficulty."""
    max_new_tokens: int = 256
    """The generation length the task's answers are sized to, and the limit when the start rate is sampled."""
    chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template, as the RL runs will."""
    steps: int = 300
    """Supervised steps at most."""
    batch_size: int = 16
    """Problems per step."""
    # 16 answers of ~1,500 tokens ran an H100 out of memory: the standard attention keeps [T, T] a head for backward.
    micro_batch: int = 4
    """Problems per forward and backward; the step's gradient is accumulated over them."""
    lr: float = 1e-5
    """AdamW learning rate."""
    eval_every: int = 25
    """Sample the start rate every this many steps."""
    eval_problems: int = 32
    """Held-out problems per start-rate measurement (one sample each)."""
    temperature: float = 1.0
    """Sampling temperature of the start-rate measurement: the RL runs'."""
    target_reward: tuple[float, float] = (0.1, 0.6)
    """Wanted start rate: training stops at the first measurement >= low; `in_range` says if it is also <= high."""
    seed: int = 0
    """Seed of the problems and the sampling."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto'."""

    def __post_init__(self):
        check_at_least_one(self, "steps", "batch_size", "micro_batch", "eval_every", "eval_problems", "max_new_tokens",
                           "difficulty")
        check_positive("lr", self.lr)
        check_positive("temperature", self.temperature)
        low, high = self.target_reward
        if not 0 <= low <= high <= 1:
            raise ValueError(f"target_reward must be (low, high) with 0 <= low <= high <= 1, got {self.target_reward}")


def _batch(tok, problems, task, chat_template: bool, device):
    """The answer batch: each prompt as the RL runs encode it, then its right answer and the end of the turn."""
    pairs = [(encode_prompt(tok, p.prompt, chat_template),
              list(tok(task.answer_text(p), add_special_tokens=False)["input_ids"]) + [tok.eos_token_id])
             for p in problems]
    return answer_batch(pairs, tok.pad_token_id or 0, device)


@torch.no_grad()
def sampled_reward(model, tok, task, problems, cfg: WarmStartConfig, seed: int) -> float:
    """The mean task reward of one sample per problem at cfg.temperature: the start rate an RL run meets."""
    prompts = [encode_prompt(tok, p.prompt, cfg.chat_template) for p in problems]
    out = generate(model, prompts, SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                                  stop_token_ids=(tok.eos_token_id,), seed=seed))
    texts = [tok.decode(c.tokens, skip_special_tokens=True) for c in out.completions]
    return sum(task.reward(t, p) for t, p in zip(texts, problems)) / len(problems)


def warm_start(cfg: WarmStartConfig, out_dir: str | Path, progress: bool = False) -> pd.DataFrame:
    """Fine-tune cfg.policy on cfg.task's right answers until the sampled reward lies in cfg.target_reward (or
    cfg.steps pass), save it to `out_dir` (which must hold no policy yet); returns the long metrics table (also
    out_dir/warm_start_metrics.csv): the loss every step, the sampled start reward before training and at each
    measurement."""
    # Locked until saved; a failure (or Ctrl-C) before the save leaves no empty folder behind.
    with claim(out_dir, "warm-start", option="--out", holds=POLICY_FILES, what="a policy", config=False) as folder:
        return _warm_start(cfg, folder.folder, progress)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms while the block runs (an op without a deterministic form raises, naming
    itself); cuBLAS's products are run to run the same only with a fixed workspace, which it reads from
    CUBLAS_WORKSPACE_CONFIG (set here where unset: before this process's first product, as in the CLI)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _warm_start(cfg: WarmStartConfig, out: Path, progress: bool) -> pd.DataFrame:
    device = resolve_device(cfg.device)
    task = make_task(cfg.task, seed=cfg.seed, difficulty=cfg.difficulty, max_new_tokens=cfg.max_new_tokens)
    if not hasattr(task, "answer_text"):
        raise ValueError(f"task {cfg.task!r} does not say what its right answer is, so there is nothing to imitate; "
                         "warm-start takes: counting")
    path = resolve_model(cfg.policy)
    tok, model = load_tokenizer(path), load_pretrained(path, dtype=torch.float32, device=device)
    held_out = task.eval_problems(cfg.eval_problems)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rows, start = [], time.perf_counter()
    bar = tqdm(total=cfg.steps, disable=not progress, desc=f"warm-start ({cfg.task}, {device})")
    with mode("standard"), deterministic(), bar:
        reward = sampled_reward(model, tok, task, held_out, cfg, seed=cfg.seed)
        rows.append({"step": 0, "metric": "sampled_reward", "value": reward})
        for step in range(1, cfg.steps + 1):
            # Stop at the first measurement that reaches the range's low end: more fine-tuning only raises the
            # rate, so one above the range is reported (`in_range` 0) rather than trained further from.
            if reward >= cfg.target_reward[0]:
                break
            batch = _batch(tok, task.problems(cfg.batch_size, start=step * cfg.batch_size), task,
                           cfg.chat_template, device)
            loss = supervised_step(model, opt, *batch, step, micro_rows=cfg.micro_batch)
            rows.append({"step": step, "metric": "loss", "value": loss})
            bar.update(1)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                reward = sampled_reward(model, tok, task, held_out, cfg, seed=cfg.seed + step)
                rows.append({"step": step, "metric": "sampled_reward", "value": reward})
                bar.set_postfix(loss=f"{loss:.3f}", reward=f"{reward:.3f}")
    rows.append({"step": rows[-1]["step"], "metric": "seconds", "value": time.perf_counter() - start})
    rows.append({"step": rows[-1]["step"], "metric": "in_range",
                 "value": float(cfg.target_reward[0] <= reward <= cfg.target_reward[1])})
    table = pd.DataFrame(rows).assign(variant=f"warm-start-{cfg.task}", seed=cfg.seed)
    save_policy(model, tok, out)
    table.to_csv(out / "warm_start_metrics.csv", index=False)
    return table
