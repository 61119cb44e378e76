"""The per-token long table of sampler vs trainer log-probs that the mismatch viewer draws: one row per generated
token of each (model, arm, sequence), produced here from a model and published as a record.

An arm is a pair of kernel settings: the sampler's (the generator's decode steps, one token per sequence against a
KV cache) and the trainer's (one forward over prompt + completion, the whole batch at once). The sampler's log-prob
is the generator's own, of the model's distribution at temperature 1; the trainer's is the recomputation of the same
token. Columns: source, model, arm, seq, pos, token, text, sampler_logprob, trainer_logprob.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..generation import SamplingParams, generate, trainer_logprobs
from ..generation.fp8 import Fp8Sampler
from ..kernels import FUSED_ROWWISE, mode
from ..published import published_label
from ..records import load_index
from ..tables import project_path
from .audit import divergence_sweep

COLUMNS = ["source", "model", "arm", "seq", "pos", "token", "text", "sampler_logprob", "trainer_logprob"]


@dataclass(frozen=True)
class TokenArm:
    """Where the sampler's and the trainer's log-probs come from."""

    description: str
    """One line for the viewer."""
    sampler: dict
    """The generator's kernel settings: `mode(default, **overrides)` as {"default": ..., op: mode}."""
    trainer: dict
    """The trainer's kernel settings, in the same form."""
    dtype: torch.dtype = torch.bfloat16
    """The model's dtype on both sides."""
    setting: str = ""
    """Its row in the parity report's first-divergence table (`audit.DIVERGENCE_SETTINGS`' names); empty: none."""
    fp8: bool = False
    """The sampler runs the generator's fp8 copy (`generation.fp8`, the `off-fp8` arm's), the trainer the bf16 model."""


_STANDARD = {"default": "standard"}
ARMS: dict[str, TokenArm] = {
    "invariant": TokenArm("bitwise: the invariant kernels on both sides", {"default": "invariant"},
                          {"default": "invariant"}, setting="all invariant"),
    "standard": TokenArm("the standard kernels on both sides (decode-shaped vs batch-shaped products)", _STANDARD,
                         _STANDARD, setting="all standard"),
    "engine off": TokenArm("the ON/OFF `off` arm: an engine's fused kernels sample, the standard trainer scores",
                           {**_STANDARD, **FUSED_ROWWISE}, _STANDARD),
    "standard fp32": TokenArm("the CPU's control: the standard kernels with the model in fp32", _STANDARD, _STANDARD,
                              torch.float32, setting="all standard, fp32 (CPU control)"),
    "fp8 off": TokenArm("the ON/OFF `off-fp8` arm: the engine's kernels on fp8 weights and activations sample, the "
                        "bf16 standard trainer scores", {**_STANDARD, **FUSED_ROWWISE}, _STANDARD, fp8=True),
}
"""The arms the viewer offers."""
GPU_ARMS = ("invariant", "standard", "engine off", "fp8 off")
"""On a GPU the bf16 standard kernels differ already; the fp32 control is the CPU's."""


def _kernels(setting: dict):
    setting = dict(setting)
    return mode(setting.pop("default"), **setting)


def arm_tokens(model, prompts: list[list[int]], arm: TokenArm, params: SamplingParams,
               text: Callable[[int], str] = lambda t: f"#{t}") -> pd.DataFrame:
    """One arm's rows: sample with the sampler's kernels, recompute the same tokens with the trainer's."""
    model = model if arm.dtype == model.lm_head_weight.dtype else copy.deepcopy(model).to(arm.dtype)
    sampler = Fp8Sampler(model).model if arm.fp8 else model
    with _kernels(arm.sampler):
        completions = generate(sampler, prompts, params).completions
    tokens = [c.tokens for c in completions]
    with _kernels(arm.trainer):
        recomputed = trainer_logprobs(model, prompts, tokens)
    rows = [{"seq": s, "pos": i, "token": tok, "text": text(tok), "sampler_logprob": g, "trainer_logprob": t}
            for s, (c, r) in enumerate(zip(completions, recomputed))
            for i, (tok, g, t) in enumerate(zip(c.tokens, c.logprobs.tolist(), r.tolist()))]
    return pd.DataFrame(rows)


def token_table(model, prompts: list[list[int]], arms, params: SamplingParams, model_name: str, source: str,
                text: Callable[[int], str] = lambda t: f"#{t}", progress: bool = True) -> pd.DataFrame:
    """The long table (COLUMNS) of every arm in `arms` (names of ARMS) on these prompts, a progress bar per arm."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    tables = []
    for name in tqdm(list(arms), desc="arms (sample, then score)", disable=not progress):
        tables.append(arm_tokens(model, prompts, ARMS[name], params, text).assign(arm=name))
    return pd.concat(tables, ignore_index=True).assign(source=source, model=model_name)[COLUMNS]


def divergence_table(model, arms, seq_len: int = 12, batch: int = 8) -> pd.DataFrame:
    """Per arm with a parity-report setting: the first op whose output differs between the trainer's forward and the
    decode step (`audit.divergence_sweep`), in the arm's dtype. Columns: arm, first_divergence, first_max_abs_diff."""
    rows = []
    for name in arms:
        arm = ARMS[name]
        if not arm.setting:
            continue
        m = model if arm.dtype == model.lm_head_weight.dtype else copy.deepcopy(model).to(arm.dtype)
        found = divergence_sweep(m, {arm.setting: arm.sampler}, seq_len=seq_len, batch=batch).iloc[0]
        rows.append({"arm": name, "first_divergence": found.first_divergence,
                     "first_max_abs_diff": found.first_max_abs_diff})
    return pd.DataFrame(rows, columns=["arm", "first_divergence", "first_max_abs_diff"])


RECORD_PATTERN = "token-mismatch"
"""A published record's folder name contains this (`docs/results/<date>_token-mismatch-<device>_<sha>/`)."""
TABLE_FILE, DIVERGENCE_FILE = "token_mismatch.csv.gz", "divergence.csv"


@dataclass(frozen=True)
class PublishedTokens:
    """The newest published token-level record, as the notebook shows it beside a live run."""

    folder: Path
    """Its folder in docs/results."""
    table: pd.DataFrame
    """The long table, `source` set to the label."""
    divergence: pd.DataFrame | None
    """Its first-divergence table, where published."""
    label: str
    """"published, GPU, <device>, <date>"."""


def published_tokens(root: str | Path = "docs/results") -> PublishedTokens | None:
    """The newest record of the index under `root` (a relative root is the project's) that holds TABLE_FILE; None
    when there is none."""
    base = project_path(root)
    found = sorted((r for r in load_index(base) if (base / r.folder / TABLE_FILE).exists()),
                   key=lambda r: (r.date, r.folder))
    if not found:
        return None
    record, folder = found[-1], base / found[-1].folder
    label = published_label(record.device, record.date)
    divergence = (pd.read_csv(folder / DIVERGENCE_FILE).assign(source=label) if (folder / DIVERGENCE_FILE).exists()
                  else None)
    return PublishedTokens(folder, pd.read_csv(folder / TABLE_FILE, keep_default_na=False).assign(source=label),
                           divergence, label)


def record_name(env: dict) -> str:
    """<date>_token-mismatch-<device>_<sha>: the record folder's name (published with a result.json; the index
    finds it)."""
    device = re.sub(r"[^a-z0-9]", "", (env.get("gpu") or "cpu").lower().replace("nvidia", ""))
    device = re.search(r"[a-z]\d+", device)[0] if re.search(r"[a-z]\d+", device) else device or "cpu"
    return f"{datetime.date.today().isoformat()}_{RECORD_PATTERN}-{device}_{env.get('git_sha', 'nogit')}"
