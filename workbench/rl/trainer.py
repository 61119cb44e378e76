"""GRPO-family training with the generator and trainer on one model and one set of kernels.

Each step: sync (the generator gets the trainer's bf16 weights, checked by checksum) -> prompts
-> a group of completions per prompt (the embedded generator, or vLLM running the workbench model:
`generator='vllm'`) -> rewards -> group advantages ->
the trainer's recomputation of the sampled tokens' log-probs, checked against the generator's
(the parity check) -> one policy update on fp32 master weights -> the one fp32 -> bf16 cast.

Synchronous by default (policy lag 0). With `policy_lag=1` the generator samples with the weights
of one update before the trainer's, as an asynchronous pipeline would; the steps still run one
after another (the lag is reproduced exactly, the overlap is not). The parity check then compares
the generator with the trainer's kernels run on the generator's weights, and those recomputed
log-probs are the PPO ratio's "old" policy.

In `invariant` mode any log-prob difference stops the run (parity="error"); in `standard` mode
the mismatch is measured and logged. `sampler_trainer_kl` and the parity metrics always compare
kernels on the same weights (the generator's), so they measure the kernel mismatch, never the
lag. A KL to the sampler at lag 0 in invariant mode is exactly 0 and, with k2 or k3, has zero
gradient too: it only acts under a lag or a mismatch. Metrics are a long table (step, metric, value, variant,
seed), also sent to TensorBoard when asked.
"""

from __future__ import annotations

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
from ..kernels import entropy, mode
from ..models import (build, copy_weights, encode_prompt, load_pretrained, load_tokenizer, resolve_model,
                      save_pretrained, weights_checksum)
from .losses import AGGREGATIONS, LossConfig, aggregate, get_loss, group_advantages, importance_weights, kl_estimate
from .policy import PolicyConfig, train_policy
from .tasks import TASKS, make_task


class ParityError(RuntimeError):
    """Generator and trainer log-probs differ in a run that claims bitwise parity."""


@dataclass(frozen=True)
class TrainConfig:
    policy: str = ""
    """Starting policy: registry name (smollm2-135m-instruct), folder, .gguf or hub id; empty: self-trained."""
    chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template (instruct models), where it has one."""
    out_dir: str = "runs/train"
    """Where metrics and checkpoints go."""
    kernel_mode: str = "invariant"
    """'invariant' (bitwise generator = trainer) or 'standard' (the mismatched control)."""
    task: str = "arithmetic"
    """'arithmetic' (synthetic, offline) or 'gsm8k' (needs task_source)."""
    task_source: str = ""
    """GSM8K only: a folder holding train.jsonl and test.jsonl, a JSONL file, or a hub id."""
    difficulty: int = 1
    """Arithmetic difficulty."""
    loss: str = "grpo"
    """grpo, dr_grpo, dapo or gspo."""
    steps: int = 2
    """Policy updates (the defaults are a CPU smoke run of about 45 s)."""
    prompts_per_step: int = 2
    """Prompts sampled per step."""
    group_size: int = 4
    """Completions per prompt."""
    max_new_tokens: int = 4
    """Completion length limit."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    lr: float = 1e-3
    """AdamW learning rate on the fp32 master weights."""
    seed: int = 0
    """Seed of the data order, the sampling and the starting policy."""
    parity: str = "error"
    """In invariant mode, what a log-prob difference does: 'error' or 'warn'."""
    correction: str = "none"
    """Off-policy correction: none, tis-token, tis-sequence, mask-token, mask-sequence."""
    correction_cap: float = 2.0
    """Cap C of the correction (truncate at C, or mask outside [1/C, C])."""
    kl_coef: float = 0.0
    """Weight of the KL penalty (0: none, and no reference model is built)."""
    kl_to: str = "reference"
    """What the KL is measured to: 'reference' (the frozen starting policy) or 'sampler' (the generator)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (see losses.kl_estimate)."""
    kl_in_reward: bool = False
    """Subtract the KL from each sequence's reward instead of adding it to the loss."""
    generator: str = "embedded"
    """'embedded' (the workbench's sampler) or 'vllm' (vLLM running the workbench model: needs vLLM, a GPU)."""
    vllm_memory: float = 0.3
    """generator='vllm': the share of the GPU's memory vLLM may take."""
    sync: str = "shared"
    """Weight sync into the generator: shared (same bf16 model), copy, or checkpoint (through disk)."""
    policy_lag: int = 0
    """0: synchronous; 1: the generator samples with the weights one update behind (needs sync='copy')."""
    checkpoint_every: int = 5
    """Write a resumable checkpoint every this many steps (and at the end)."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir."""
    tensorboard: bool = False
    """Also write every metric to TensorBoard event files in out_dir/tensorboard."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when there is one)."""
    progress: bool = True
    """A progress bar on the terminal (reward, parity) while training."""

    def __post_init__(self):
        get_loss(self.loss)
        if self.kernel_mode not in ("invariant", "standard"):
            raise ValueError(f"kernel_mode must be 'invariant' or 'standard', got {self.kernel_mode!r}")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.task == "gsm8k" and not self.task_source:
            raise ValueError("task 'gsm8k' needs task_source: a folder holding train.jsonl/test.jsonl, "
                             "a file, or a hub id")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (GRPO compares samples of one prompt), "
                             f"got {self.group_size}")
        check_positive("lr", self.lr)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for RL sampling, got {self.temperature!r}")
        check_at_least_one(self, "steps", "prompts_per_step", "max_new_tokens", "checkpoint_every", "difficulty")
        if self.parity not in ("error", "warn"):
            raise ValueError(f"parity must be 'error' or 'warn', got {self.parity!r}")
        if self.correction not in ("none", "tis-token", "tis-sequence", "mask-token", "mask-sequence"):
            raise ValueError(f"unknown correction {self.correction!r}")
        if self.loss == "gspo" and self.correction.endswith("-token"):
            raise ValueError(f"loss 'gspo' has one ratio per sequence: a per-token correction ({self.correction}) "
                             "has no place in it; use tis-sequence or mask-sequence")
        if self.kl_coef < 0 or not math.isfinite(self.kl_coef):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if self.kl_to not in ("reference", "sampler"):
            raise ValueError(f"kl_to must be 'reference' or 'sampler', got {self.kl_to!r}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; choose k1, k2 or k3")
        if self.sync not in ("shared", "copy", "checkpoint"):
            raise ValueError(f"sync must be 'shared', 'copy' or 'checkpoint', got {self.sync!r}")
        if self.policy_lag not in (0, 1):
            raise ValueError(f"policy_lag must be 0 (synchronous) or 1 (one step behind), got {self.policy_lag}")
        if self.policy_lag and self.sync != "copy":
            raise ValueError("policy_lag=1 keeps the generator's weights apart from the trainer's: use sync='copy'")
        if self.generator not in ("embedded", "vllm"):
            raise ValueError(f"generator must be 'embedded' or 'vllm', got {self.generator!r}")
        if self.generator == "vllm" and self.sync == "shared":
            raise ValueError("generator='vllm' holds its own copy of the weights: use sync='copy' (in place into "
                             "the running engine) or sync='checkpoint' (through disk)")
        if not 0 < self.vllm_memory < 1:
            raise ValueError(f"vllm_memory must lie in (0, 1), got {self.vllm_memory!r}")


def layer_group(name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'layer_03'; embeddings, final norm and head by name."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layer_{int(parts[2]):02d}"
    return {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
            "lm_head.weight": "lm_head"}.get(name, name)


def weight_delta_metrics(before: dict, after: dict) -> dict[str, float]:
    """L2 norm of the update and its size relative to the weights, in total and per layer."""
    sq_delta: dict[str, float] = {}
    sq_before: dict[str, float] = {}
    for k, new in after.items():
        g = layer_group(k)
        sq_delta[g] = sq_delta.get(g, 0.0) + float(((new - before[k]).double() ** 2).sum())
        sq_before[g] = sq_before.get(g, 0.0) + float((before[k].double() ** 2).sum())
    out = {"weight_delta_l2": math.sqrt(sum(sq_delta.values())),
           "weight_rel_change": math.sqrt(sum(sq_delta.values()) / max(sum(sq_before.values()), 1e-300))}
    for g in sorted(sq_delta):
        out[f"weight_delta_l2/{g}"] = math.sqrt(sq_delta[g])
        out[f"weight_rel_change/{g}"] = math.sqrt(sq_delta[g] / max(sq_before[g], 1e-300))
    return out


class _Metrics:
    """The long table being built, and optionally a TensorBoard writer fed the same numbers."""

    def __init__(self, cfg: TrainConfig, out: Path):
        self.rows: list[dict] = []
        self.variant, self.seed = cfg.kernel_mode, cfg.seed
        self.writer = None
        self.out = out
        if cfg.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise ValueError("tensorboard=True needs the tensorboard package: pip install tensorboard") from None

    def start(self, cfg: TrainConfig, first_step: int) -> None:
        """Open TensorBoard; events of steps >= first_step left by an interrupted run are dropped."""
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=first_step)

    def __call__(self, step: int, metric: str, value) -> None:
        value = float(value)
        self.rows.append({"step": step, "metric": metric, "value": value, "variant": self.variant,
                          "seed": self.seed})
        if self.writer is not None:
            self.writer.add_scalar(metric, value, step)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["step", "metric", "value", "variant", "seed"])

    def close(self) -> pd.DataFrame:
        if self.writer is not None:
            self.writer.close()
        table = self.table()
        table.to_csv(self.out / "metrics.csv", index=False)
        return table


def _last_good(out: Path) -> str:
    state = out / "checkpoint" / "state.json"
    if not state.exists():
        return "no checkpoint was written yet"
    return f"the last good checkpoint (step {json.loads(state.read_text())['step']}) is in {out / 'checkpoint'}"


def _starting_policy(cfg: TrainConfig, out: Path, device: str):
    if cfg.policy:
        folder = resolve_model(cfg.policy)
        return load_pretrained(folder, dtype=torch.float32, device=device), load_tokenizer(folder)
    if cfg.task != "arithmetic":
        raise ValueError(f"task {cfg.task!r} needs a starting checkpoint (policy=...); the self-trained policy "
                         "only knows arithmetic")
    policy_cfg = PolicyConfig(seed=cfg.seed, difficulty=cfg.difficulty, device=device)
    model, tok, _ = train_policy(policy_cfg, out / "policy")
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


def _save_checkpoint(out: Path, step: int, masters: dict, opt, metrics: pd.DataFrame, cfg: TrainConfig,
                     lagged: tuple[int, dict] | None) -> None:
    """Atomic: written to a temporary folder, then renamed over `checkpoint/` (a crash keeps the old one)."""
    tmp = out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in masters.items()}, tmp / "masters.safetensors")
    state = opt.state_dict()
    tensors = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    if lagged is not None:
        save_file({k: v.contiguous() for k, v in lagged[1].items()}, tmp / "generator.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg),
                                                "generator_version": None if lagged is None else lagged[0],
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
_RESUMABLE_CHANGES = {"steps", "resume", "checkpoint_every", "device", "out_dir", "progress", "tensorboard",
                      "vllm_memory"}


def config_changes(saved: dict, cfg: TrainConfig) -> dict:
    """{field: (saved, now)} for every field a resumed run may not change. A field the saved config
    lacks (a checkpoint from before that field existed) counts as its default."""
    defaults = asdict(TrainConfig())
    return {k: (saved.get(k, defaults[k]), v) for k, v in asdict(cfg).items()
            if k not in _RESUMABLE_CHANGES and saved.get(k, defaults[k]) != (list(v) if isinstance(v, tuple) else v)}


def _load_checkpoint(out: Path, masters: dict, opt, cfg: TrainConfig, device: str):
    """Restores masters and optimizer in place; returns (step, metrics so far, lagged generator weights)."""
    ck = out / "checkpoint"
    if not (ck / "state.json").exists():
        raise FileNotFoundError(f"resume: no checkpoint in {ck}; run without resume first")
    state = json.loads((ck / "state.json").read_text())
    changed = config_changes(state["config"], cfg)
    if changed:
        raise ValueError(f"resume: the config differs from the checkpoint's in {changed} (saved, now); "
                         "resume with the same settings or start a new out_dir")
    saved = load_file(ck / "masters.safetensors")
    with torch.no_grad():
        for k, v in masters.items():
            v.copy_(saved[k])
    tensors = load_file(ck / "optimizer.safetensors")  # load_state_dict moves them to the parameters' device
    opt_state = {"param_groups": state["param_groups"], "state": {}}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        opt_state["state"].setdefault(int(i), {})[name] = v
    opt.load_state_dict(opt_state)
    lagged = None
    if state.get("generator_version") is not None:
        lagged = (state["generator_version"], load_file(ck / "generator.safetensors", device=device))
    return state["step"], pd.read_csv(ck / "metrics.csv"), lagged


def _sync(cfg: TrainConfig, model, gen_model, history: list, version: int, out: Path, device: str, engine=None):
    """Bring the generator to the weights it samples with at this step; returns (generator, its version).

    `history` holds (version, bf16 weights) the trainer published, oldest first (policy lag only).
    With vLLM (`engine`), the weights also go into the running engine, in place or through disk;
    `gen_model` keeps the trainer-side copy the lagged recomputation runs on.
    """
    if cfg.sync == "shared":
        return model, version
    current = dict(model.state_dict())
    gen_version, source = version, current
    if cfg.policy_lag:
        history.append((version, {k: v.detach().clone() for k, v in current.items()}))
        del history[: -(cfg.policy_lag + 1)]
        gen_version, source = history[0]
    if cfg.sync == "copy":
        copy_weights(source, gen_model)
        if engine is not None:
            engine.load_weights(source)
    else:
        save_pretrained(model, out / "sync")
        gen_model = load_pretrained(out / "sync", dtype=torch.bfloat16, device=device)
        if engine is not None:
            engine.load_checkpoint(out / "sync")
    synced = {"generator": weights_checksum(gen_model.state_dict()) == weights_checksum(source)}
    if engine is not None:
        synced["vLLM engine"] = engine.weights_checksum() == engine.expected_checksum(source)
    for who, ok in synced.items():
        if not ok:
            raise RuntimeError(f"the {who}'s weights differ from the trainer's version {gen_version} after the "
                               f"sync ({cfg.sync}); the sync path is broken")
    return gen_model, gen_version


def _vllm_engine(cfg: TrainConfig, model, out: Path):
    """vLLM running the workbench model on the starting weights, in this process (generator='vllm')."""
    from ..generation.vllm_backend import VLLMGenerator

    save_pretrained(model, out / "vllm_start")
    return VLLMGenerator(out / "vllm_start", gpu_memory_utilization=cfg.vllm_memory,
                         batch_invariant=cfg.kernel_mode == "invariant", seed=cfg.seed, model_impl="workbench",
                         kernel_mode=cfg.kernel_mode)


def train(cfg: TrainConfig) -> pd.DataFrame:
    """Run GRPO-family training; returns the long metrics table (also written to out_dir/metrics.csv).

    On a failure (parity break, NaN loss) the metrics so far are still written before the error.
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    if cfg.generator == "vllm":
        from ..generation.vllm_backend import require_vllm

        require_vllm()  # before the starting policy is trained: say at once what is missing
    log = _Metrics(cfg, out)
    torch.manual_seed(cfg.seed)
    task = make_task(cfg.task, seed=cfg.seed, difficulty=cfg.difficulty, source=cfg.task_source)
    master_model, tok = _starting_policy(cfg, out, device)
    masters = {k: v.detach().clone().float() for k, v in master_model.state_dict().items()}
    model = build(master_model.config, device=device, dtype=torch.bfloat16, seed=None)
    copy_weights(masters, model)
    gen_model = model if cfg.sync == "shared" else build(model.config, device=device, dtype=torch.bfloat16, seed=None)
    reference = None
    if cfg.kl_coef > 0 and cfg.kl_to == "reference":
        reference = build(model.config, device=device, dtype=torch.bfloat16, seed=None)
        copy_weights(masters, reference)
    params = [masters[k] for k in sorted(masters)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    start_step, history = 0, []
    if cfg.resume:
        start_step, previous, lagged = _load_checkpoint(out, masters, opt, cfg, device)
        log.rows.extend(previous.to_dict("records"))
        history = [lagged] if lagged is not None else []
        copy_weights(masters, model)
    log.start(cfg, start_step + 1)
    engine = _vllm_engine(cfg, model, out) if cfg.generator == "vllm" else None
    run = _Run(cfg, out, device, task, tok, model, gen_model, reference, masters, params, opt, history, log, engine)
    bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, desc=f"train ({cfg.kernel_mode})")
    try:
        with mode(cfg.kernel_mode):
            for step in range(start_step + 1, cfg.steps + 1):
                reward, differing = _step(run, step)
                bar.set_postfix(reward=f"{reward:.3f}", differing=differing)
                bar.update(1)
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    lagged = run.history[-1] if cfg.policy_lag and run.history else None
                    _save_checkpoint(out, step, {k: v.detach() for k, v in masters.items()}, opt, log.table(), cfg,
                                     lagged)
    finally:
        bar.close()
        table = log.close()
    return table


@dataclass
class _Run:
    """What a training step works on."""

    cfg: TrainConfig
    out: Path
    device: str
    task: object
    tok: object
    model: torch.nn.Module
    """The trainer's bf16 model (the cast of the masters)."""
    gen_model: torch.nn.Module
    """The generator's bf16 model (the trainer's own in sync='shared')."""
    reference: torch.nn.Module | None
    masters: dict
    params: list
    opt: torch.optim.Optimizer
    history: list
    log: _Metrics
    engine: object | None = None
    """generator='vllm': the running `VLLMGenerator`."""


def _step(run: _Run, step: int) -> tuple[float, int]:
    """One sync -> generate -> score -> parity check -> update; metrics go to run.log.

    Returns (mean reward, tokens differing) for the progress bar.
    """
    cfg, out, device, task, tok, model = run.cfg, run.out, run.device, run.task, run.tok, run.model
    masters, log = run.masters, run.log
    spec = get_loss(cfg.loss)
    loss_cfg: LossConfig = spec.defaults
    version = step - 1  # updates applied so far
    t0 = time.perf_counter()
    run.gen_model, gen_version = _sync(cfg, model, run.gen_model, run.history, version, out, device, run.engine)
    gen_model = run.gen_model
    t_sync = time.perf_counter()

    problems = task.problems(cfg.prompts_per_step, start=step * cfg.prompts_per_step)
    prompts = [encode_prompt(tok, p.prompt, cfg.chat_template) for p in problems for _ in range(cfg.group_size)]
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              stop_token_ids=(tok.eos_token_id,), seed=cfg.seed * 1_000_003 + step)
    if run.engine is not None:
        gen = run.engine.generate(prompts, sampling, request_ids=list(range(len(prompts))))
    else:
        gen = generate(gen_model, prompts, sampling, request_ids=list(range(len(prompts))))
    t_gen = time.perf_counter()

    completions = [c.tokens for c in gen.completions]
    texts = [tok.decode(c, skip_special_tokens=True) for c in completions]
    scores = [task.scores(t, problems[i // cfg.group_size]) for i, t in enumerate(texts)]
    rewards = torch.tensor([task.reward(t, problems[i // cfg.group_size]) for i, t in enumerate(texts)],
                           device=device)

    ids, lens, mask = (t.to(device) for t in _completion_batch(tok, prompts, completions))
    targets = torch.roll(ids, -1, dims=1)
    logits = model(ids, seq_lens=lens)
    # Position t scores the token at t + 1 (the last position's target is a dummy, masked).
    logp = sampled_logprobs(logits, targets, sampling)[:, :-1]                          # [B, T-1]
    if gen_version == version:
        old = logp.detach()
    else:
        with torch.no_grad():  # the trainer's kernels on the weights the generator sampled with
            old = sampled_logprobs(gen_model(ids, seq_lens=lens), targets, sampling)[:, :-1]
    behavior = torch.zeros_like(mask)
    for i, c in enumerate(gen.completions):
        start = len(prompts[i]) - 1
        behavior[i, start : start + len(c.tokens)] = c.sampled_logprobs.to(device)
    table = parity_table([c.sampled_logprobs for c in gen.completions],
                         [old[i, len(prompts[i]) - 1 : len(prompts[i]) - 1 + len(c.tokens)].cpu()
                          for i, c in enumerate(gen.completions)], completions)
    parity = parity_summary(table)
    # Logged first, so the step that breaks parity is on record in metrics.csv.
    log(step, "parity_max_abs_diff", parity["max_abs_diff"])
    log(step, "parity_mean_abs_diff", parity["mean_abs_diff"])
    log(step, "parity_tokens_differing", parity["tokens_differing"])
    log(step, "sampler_trainer_kl", parity["kl"])
    if cfg.kernel_mode == "invariant" and not parity["bitwise_identical"]:
        msg = (f"step {step}: generator and trainer log-probs differ on {parity['tokens_differing']} of "
               f"{parity['tokens']} tokens (max |diff| {parity['max_abs_diff']:.3g}) in invariant mode")
        if cfg.parity == "error":
            raise ParityError(f"{msg}; {_last_good(out)}. Check that no op runs in standard mode "
                              "(mode overrides) and that the generator and trainer share the weights.")
        print("warning:", msg)

    kl, later = None, {}  # `later`: metrics logged once the loss is known to be finite
    if cfg.kl_coef > 0:
        if run.reference is not None:
            with torch.no_grad():
                target = sampled_logprobs(run.reference(ids, seq_lens=lens), targets, sampling)[:, :-1]
        else:
            target = behavior
        kl = kl_estimate(logp, target, cfg.kl_estimator) * mask
        later["kl"] = kl.detach().sum() / mask.sum()
    shaped = rewards - cfg.kl_coef * kl.detach().sum(1) if kl is not None and cfg.kl_in_reward else rewards
    adv = group_advantages(shaped, cfg.group_size, scale=spec.scale_advantages)
    norm = cfg.max_new_tokens if loss_cfg.aggregation == AGGREGATIONS[2] else None
    weights = None
    if cfg.correction != "none":
        kind, level = cfg.correction.split("-")
        weights = importance_weights(old, behavior, mask, level, "truncate" if kind == "tis" else "mask",
                                     cfg.correction_cap)
        later["is_weight_mean"] = (weights * mask).sum() / mask.sum()
    loss, stats = spec.fn(logp, old, adv, mask, LossConfig(loss_cfg.eps_low, loss_cfg.eps_high,
                                                           loss_cfg.aggregation, norm), weights)
    if kl is not None and not cfg.kl_in_reward:
        loss = loss + cfg.kl_coef * aggregate(kl, mask, loss_cfg.aggregation, norm)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss.item()}; {_last_good(out)}. "
                                 "Lower the learning rate or check the rewards.")
    with torch.no_grad():
        ent = (entropy(logits.detach(), cfg.temperature)[:, :-1] * mask).sum() / mask.sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    named = dict(model.named_parameters())
    for k, m in masters.items():
        m.grad = named[k].grad.float()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, float("inf"))
    before = {k: v.detach().clone() for k, v in masters.items()}
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        copy_weights({k: v.detach() for k, v in masters.items()}, model)
    t_train = time.perf_counter()

    for name, value in later.items():
        log(step, name, value)
    log(step, "loss", loss.item())
    log(step, "reward_mean", rewards.mean())
    log(step, "reward_std", rewards.std())
    log(step, "accuracy", (rewards > 0).float().mean())
    for name in scores[0]:
        log(step, f"accuracy_{name}", sum(s[name] for s in scores) / len(scores))
    for k, v in stats.items():
        log(step, k, v.item())
    log(step, "entropy", ent)
    log(step, "grad_norm", grad_norm.item())
    log(step, "response_length", sum(map(len, completions)) / len(completions))
    log(step, "truncation_rate", sum(c.finish_reason == "length" for c in gen.completions) / len(completions))
    for k, v in weight_delta_metrics(before, {k: v.detach() for k, v in masters.items()}).items():
        log(step, k, v)
    log(step, "policy_lag", version - gen_version)
    log(step, "time_sync", t_sync - t0)
    log(step, "time_generate", t_gen - t_sync)
    log(step, "time_train", t_train - t_gen)
    log(step, "time_step", t_train - t0)
    log(step, "tokens_per_s", sum(map(len, completions)) / (t_train - t0))
    return rewards.mean().item(), parity["tokens_differing"]
