"""A starting policy without downloads: a digit-level BPE tokenizer and a small Qwen3-shaped model trained by
supervised learning on the arithmetic task until its accuracy leaves room for RL, saved as a
Hugging Face checkpoint (with its tokenizer) that `workbench.models.load_pretrained` reads.

The tokenizer is a `tokenizers` BPE whose vocabulary is the task's characters and no merges:
a tiny model learns arithmetic far more easily when every number is spelled digit by digit.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..config import check_at_least_one, check_positive
from ..env import resolve_device
from ..generation import SamplingParams, generate
from ..kernels import mode
from ..models import ModelConfig, build, copy_weights, save_pretrained
from ..tasks import Arithmetic

EOS, PAD = "<|endoftext|>", "<pad>"

POLICY_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),
}


@dataclass(frozen=True)
class PolicyConfig:
    size: str = "tiny"
    """'tiny' (trains on a CPU in seconds) or 'small' (a GPU in minutes)."""
    difficulty: int = 1
    """Arithmetic difficulty (operands and digits)."""
    seed: int = 0
    """Seed of the problems, the initial weights and the batch order."""
    max_steps: int = 400
    """Optimizer steps at most."""
    batch_size: int = 64
    """Problems per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    eval_every: int = 50
    """Measure greedy accuracy every this many steps."""
    eval_problems: int = 64
    """Held-out problems per accuracy measurement."""
    target_accuracy: tuple[float, float] = (0.1, 0.6)
    """Wanted start accuracy (room left for RL): training stops at the first measurement >= low; the table's
    `in_range` says if it is <= high."""
    kernel_mode: str = "standard"
    """Kernel mode for this supervised run (its numerics need not be invariant)."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto'."""

    def __post_init__(self):
        if self.size not in POLICY_SIZES:
            raise ValueError(f"unknown policy size {self.size!r}; choose one of {sorted(POLICY_SIZES)}")
        check_positive("lr", self.lr)
        if len(self.target_accuracy) != 2 or not 0 <= self.target_accuracy[0] < self.target_accuracy[1] <= 1:
            raise ValueError("target_accuracy must be (low, high) with 0 <= low < high <= 1, "
                             f"got {self.target_accuracy}")
        check_at_least_one(self, "max_steps", "batch_size", "eval_every", "eval_problems")


def train_tokenizer(task: Arithmetic):
    """A BPE over the task's characters (no merges), with end-of-text and padding tokens."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [p.prompt + p.answer for p in task.problems(512)]
    alphabet = sorted(set("".join(corpus)) | set("0123456789+-*="))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 3, special_tokens=[EOS, PAD, "<unk>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token="<unk>")


def answer_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int, device):
    """(ids [B, T], lens [B], loss mask [B, T] on the positions that predict each answer) from (prompt ids, answer
    ids) pairs, right-padded: the layout of a supervised step (`supervised_step`)."""
    seqs = [prompt + answer for prompt, answer in pairs]
    masks = [[0] * (len(prompt) - 1) + [1] * len(answer) + [0] for prompt, answer in pairs]
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t))
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    return ids.to(device), lens.to(device), mask.to(device)


def supervised_step(model, opt, ids, lens, mask, step: int, micro_rows: int = 0) -> float:
    """One AdamW step on the mean cross-entropy of the masked (answer) tokens; returns that loss. `micro_rows` > 0:
    forward and backward that many rows at a time, each part's loss over the whole batch's answer tokens, so the
    accumulated gradient is the batch's (the standard attention keeps a [T, T] matrix a head for the backward)."""
    opt.zero_grad(set_to_none=True)
    total, loss = mask.sum(), 0.0
    rows = micro_rows or ids.shape[0]
    for i in range(0, ids.shape[0], rows):
        part = slice(i, i + rows)
        logits = model(ids[part], seq_lens=lens[part]).float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[part, 1:].flatten(),
                                                reduction="none").view(logits.shape[0], -1)
        part_loss = (nll * mask[part, :-1]).sum() / total
        if not torch.isfinite(part_loss):
            raise FloatingPointError(f"supervised loss is {part_loss.item()} at step {step}; lower the learning rate")
        part_loss.backward()
        loss += part_loss.item()
    opt.step()
    return loss


def _batch(tokenizer, problems, device):
    """The answer batch of arithmetic problems: the answer and the end of sequence after each prompt."""
    pairs = [(tokenizer(p.prompt)["input_ids"], tokenizer(p.answer)["input_ids"] + [tokenizer.eos_token_id])
             for p in problems]
    return answer_batch(pairs, tokenizer.pad_token_id, device)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: Arithmetic, problems) -> float:
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    longest = max(len(tokenizer(p.answer)["input_ids"]) for p in problems)
    out = generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=longest + 1,
                                                 stop_token_ids=(tokenizer.eos_token_id,)))
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in out.completions]
    return sum(task.reward(t, p) for t, p in zip(texts, problems)) / len(problems)


def train_policy(cfg: PolicyConfig, out_dir: str | Path | None = None, progress: bool = False):
    """Supervised training on arithmetic until the greedy accuracy reaches cfg.target_accuracy's low end (or
    cfg.max_steps pass); returns (model in fp32, tokenizer, metrics table: the loss every step, the accuracy at each
    measurement, `in_range` whether the last one lies in target_accuracy). A warning says when it does not.

    With `out_dir`, the bf16 model and its tokenizer are saved there as a Hugging Face checkpoint. `progress`: a
    progress bar (loss, the last accuracy) on stderr, for a command line (a minute or more on a CPU).
    """
    device = resolve_device(cfg.device)
    task = Arithmetic(seed=cfg.seed, difficulty=cfg.difficulty)
    held_out = task.eval_problems(cfg.eval_problems)
    tokenizer = train_tokenizer(task)
    longest = max(len(p.prompt) + len(p.answer) for p in task.problems(512)) + 2
    model_cfg = ModelConfig(vocab_size=len(tokenizer), max_position_embeddings=2 * longest,
                            **POLICY_SIZES[cfg.size])
    model = build(model_cfg, device=device, dtype=torch.float32, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rows, start = [], time.perf_counter()
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc=f"train-policy ({cfg.size}, {device})")
    with mode(cfg.kernel_mode), bar:
        for step in range(1, cfg.max_steps + 1):
            batch = _batch(tokenizer, task.problems(cfg.batch_size, start=step * cfg.batch_size), device)
            loss = supervised_step(model, opt, *batch, step)
            rows.append({"step": step, "metric": "loss", "value": loss})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                acc = greedy_accuracy(model, tokenizer, task, held_out)
                rows.append({"step": step, "metric": "accuracy", "value": acc})
                bar.set_postfix(loss=f"{loss:.3f}", accuracy=f"{acc:.2f}")
                # Stop at the first measurement that reaches the range's low end: more training only raises the
                # accuracy, so one above the range is reported (`in_range` 0) rather than trained further from.
                if acc >= cfg.target_accuracy[0]:
                    break
    rows.append({"step": step, "metric": "seconds", "value": time.perf_counter() - start})
    low, high = cfg.target_accuracy
    rows.append({"step": step, "metric": "in_range", "value": float(low <= acc <= high)})
    if not low <= acc <= high:
        warnings.warn(f"train-policy: greedy accuracy {acc:.3f} after {step} steps is outside target_accuracy "
                      f"[{low}, {high}]: " + ("raise max_steps or lr" if acc < low else "lower lr or eval_every"),
                      stacklevel=2)
    table = pd.DataFrame(rows).assign(variant=f"sft-{cfg.size}", seed=cfg.seed)
    if out_dir is not None:
        save_policy(model, tokenizer, out_dir)
    return model, tokenizer, table


def save_policy(model, tokenizer, out_dir: str | Path) -> Path:
    """The fp32 model through the one cast path into bf16, saved with its tokenizer."""
    bf16 = build(model.config, device="cpu", dtype=torch.bfloat16, seed=None)
    copy_weights({k: v.detach().cpu() for k, v in model.state_dict().items()}, bf16)
    return save_pretrained(bf16, out_dir, tokenizer=tokenizer)

