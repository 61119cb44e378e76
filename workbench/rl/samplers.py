"""Where a trainer rank's samples come from, chosen once per run (`run.py`): the embedded generator (`Embedded`),
a vLLM engine in this process (`VLLM`), or the rollout ranks of a run with split roles (`Remote`). Each has
`sample(step) -> Rollout` and `publish(step, model)` (the generator gets the weights it samples the next step
with), so the step has no branch on the rollout source. docs/distributed.md: split roles and the policy lag.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..distributed.pipeline import Pipeline, Received
from ..generation import SamplingParams, generate
from ..kernels import FUSED_ROWWISE, mode
from ..models import encode_prompt
from .config import TrainConfig
from .sync import WeightSync


def sampler_kernels(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """The generator's kernels: the trainer's (the mode in force), or with sampler_kernels='engine' an inference
    engine's: the same standard products and decode attention, with the norms, SiLU and RoPE fused and rounded
    once (FUSED_ROWWISE), where the standard trainer runs Hugging Face's formulas with their bf16 round trips."""
    return mode("standard", **FUSED_ROWWISE) if cfg.rollout.sampler_kernels == "engine" else contextlib.nullcontext()


@dataclass
class StepPrompts:
    """A rank's share of each step: its problems, their prompts (each group_size times), the sampling settings."""

    cfg: TrainConfig
    task: object
    tok: object
    share: slice
    """This rank's prompts of each step (among the trainer ranks, or among the rollout ranks)."""

    def __call__(self, step: int) -> tuple[list, list[list[int]], SamplingParams, slice]:
        """(problems, prompts, sampling settings, this rank's rows of the step)."""
        cfg, share = self.cfg, self.share
        problems = self.task.problems(cfg.rollout.prompts_per_step, start=step * cfg.rollout.prompts_per_step)[share]
        prompts = [encode_prompt(self.tok, p.prompt, cfg.chat_template) for p in problems
                   for _ in range(cfg.rollout.group_size)]
        sampling = SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                                  stop_token_ids=(self.tok.eos_token_id,), seed=cfg.seed * 1_000_003 + step,
                                  logit_noise=cfg.rollout.sampler_noise)
        group = cfg.rollout.group_size
        return problems, prompts, sampling, slice(share.start * group, share.stop * group)


def generate_rows(generator, cfg: TrainConfig, prompts: list[list[int]], sampling: SamplingParams, rows: slice,
                  graphs) -> list:
    """The embedded generator's completions of `prompts`, the step's rows `rows` (their row numbers are the request
    ids: a completion's randomness is the same at any world size)."""
    with sampler_kernels(cfg):
        return generate(generator, prompts, sampling, request_ids=list(range(rows.start, rows.stop)),
                        keep=graphs).completions


@dataclass
class Rollout:
    """This trainer rank's samples of one step."""

    problems: list
    prompts: list[list[int]]
    completions: list
    """The generator's `Completion`s, one per prompt."""
    rows: slice
    """This rank's rows of the step."""
    version: int
    """The weights version that sampled them (updates applied)."""
    received: Received | None = None
    """Split roles: the whole step's samples with the rollout ranks' trainer log-probs (`scoring.Received`)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """The sampler's own times, in place of the step's (split roles: the rollout ranks' generation and waits)."""
    sync_s: float = 0.0
    """Seconds of weight sync while sampling (split roles, policy lag: the lagged version sent on)."""


class Embedded:
    """The embedded generator, in this process; `WeightSync` is its publish."""

    def __init__(self, prompts: StepPrompts, sync: WeightSync, graphs):
        self.prompts, self.sync, self.graphs = prompts, sync, graphs

    @property
    def generator(self):
        """The model holding the sampling weights (a lagged generator's are scored on it)."""
        return self.sync.generator

    @property
    def moved_bytes(self) -> int:
        """What the last publish moved."""
        return self.sync.moved_bytes

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, rows: slice) -> list:
        return generate_rows(self.sync.sampler, self.sync.cfg, prompts, sampling, rows, self.graphs)

    def sample(self, step: int) -> Rollout:
        version = self.sync.version
        problems, prompts, sampling, rows = self.prompts(step)
        return Rollout(problems, prompts, self._generate(prompts, sampling, rows), rows, version)

    def publish(self, step: int, model) -> None:
        self.sync(step)

    def running(self) -> contextlib.AbstractContextManager:
        """The run's steps (nothing to start or stop in this process)."""
        return contextlib.nullcontext()


class VLLM(Embedded):
    """A vLLM engine in this process (generator='vllm'), synced by `WeightSync` beside the embedded copy."""

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, rows: slice) -> list:
        return self.sync.engine.generate(prompts, sampling, request_ids=list(range(rows.start, rows.stop))).completions


class Remote:
    """Split roles: the rollout ranks sampled the whole step (`Pipeline`); this rank takes its rows. Publishing
    orders the next step, with the weights it samples with (by broadcast to the rollout ranks)."""

    def __init__(self, prompts: StepPrompts, pipeline: Pipeline, sync: WeightSync, model, start_step: int,
                 steps: int):
        self.prompts, self.pipeline, self.sync, self.model = prompts, pipeline, sync, model
        self.sent = []
        """The weight syncs to the rollout ranks during the current step."""
        pipeline.start(sync.generator, sync.version, start_step + 1, steps)

    @property
    def generator(self):
        return self.sync.generator

    @property
    def moved_bytes(self) -> int:
        return sum(r.bytes for r in self.sent if r)

    def sample(self, step: int) -> Rollout:
        version = self.sync.version
        problems, prompts, _, rows = self.prompts(step)
        t0 = time.perf_counter()
        received = self.pipeline.receive(step)
        completions = received.items[rows]
        if received.version != version or [c.prompt for c in completions] != prompts:
            raise RuntimeError(f"step {step}: the rollout ranks sampled with weights version {received.version} "
                               f"(this rank holds {version} for the check), or other prompts than this rank's")
        t_received = time.perf_counter()
        # Policy lag k >= 1: step s + 1 samples with version s - k, which exists already (a kept copy): the rollout
        # ranks go on to the next step now, while this one trains. (At lag 0 it needs this step's update.)
        self.sent = []
        lag = self.sync.cfg.rollout.policy_lag
        if lag:
            need = max(step - lag, 0)
            self.sent.append(self.pipeline.advance(step, self.model, need, self.sync.weights_of(need)))
        seconds = {"generate": received.generate_s, "rollout_wait": received.rollout_wait_s,
                   "trainer_wait": t_received - t0, "overlap": received.overlap_s}
        return Rollout(problems, prompts, completions, rows, version, received, seconds,
                       time.perf_counter() - t_received)

    def publish(self, step: int, model) -> None:
        """Policy lag 0: the trainer's model is the sampling weights (`WeightSync` with sync='shared'), broadcast to
        the rollout ranks, which go on to the next step now."""
        self.sync(step)
        self.sent.append(self.pipeline.advance(step, model, step))

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The run's steps: an error in them stops the rollout ranks too; at their end the rollout ranks stop."""
        with self.pipeline.stop_on_error():
            yield
            self.pipeline.end()
            self.pipeline.leave()
