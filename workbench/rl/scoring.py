"""The trainer's log-probs of a step's samples on the weights that sampled them, and the parity check they owe,
chosen once per run (`choose_scoring`): a separate no-grad pass before the update (`ScorePass`), the update's own
forward where it gives the same bits (`InUpdate`: the check then runs after its backward, before its optimizer
step), or the rollout ranks' scores that came with the samples (`Received`, split roles).

The parity check always compares the generator with the trainer's kernels on the generator's weights, so it
measures the kernel mismatch, never the policy lag. In `invariant` mode a difference stops the run (parity='error')
unless `sampler_noise` perturbs the sampler on purpose; in `standard` mode it is measured and logged. A sample of
the rows may be checked (`parity_sample`): the rows skipped take the generator's log-probs, which are the
trainer's bits wherever the check looks. docs/distributed.md: the check under data and pipeline parallelism.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checkpoint import last_good
from .config import TrainConfig
from .logprobs import parity_stats, save_token_logprobs, score
from .rank import Rank
from .rollout import RolloutBatch
from .samplers import Rollout


class ParityError(RuntimeError):
    """Generator and trainer log-probs differ in a run that claims bitwise parity."""


@dataclass
class Scores:
    """One step's trainer log-probs of this rank's samples, and their parity check."""

    checked: torch.Tensor
    """[B, T] the real tokens the check and the logged entropy cover (the rows recomputed)."""
    logp: torch.Tensor | None = None
    """[B, T] the trainer's log-probs (a row not checked: the generator's); None until the update scored them."""
    entropy: torch.Tensor | None = None
    """[B, T] the trainer's entropies of the rows checked."""
    parity: dict | None = None
    """The check's statistics (`parity_stats`)."""
    seconds: float = 0.0
    """The scoring's own time; 0 where the update's forward scored (that time is the update's)."""
    check: Callable[[torch.Tensor], dict] | None = None
    """InUpdate: the parity check the update's log-probs still owe."""

    def old(self, kind: str, batch: RolloutBatch) -> torch.Tensor | None:
        """The PPO ratio's denominator (`old_logprobs`): None where the update's own forward gives it."""
        if self.check is not None:
            return None
        return self.logp if kind == "recompute" else batch.behavior

    @property
    def in_update(self) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """What the update calls with its forward's [B, T] log-probs and entropies, before its loss check and
        optimizer step (a check that raises leaves the weights as they were); None: scored before the update."""
        return None if self.check is None else self.take

    def take(self, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        self.logp, self.entropy = logp, entropy
        self.parity = self.check(logp)


def parity_rows(cfg: TrainConfig, step: int, rows) -> list[bool]:
    """Whether the parity check recomputes each of `rows` (row numbers of the step): 1 in cfg.parity_sample, the
    rows with (row + step) % n == 0, so each row of a block of n takes its turn (with n = group_size, one completion
    of every group); every row at step 1, the starting policy's whole mismatch (step1_logprobs.npz)."""
    n = cfg.parity_sample
    return [step == 1 or (r + step) % n == 0 for r in rows]


def scores_in_update(run: Rank, gen_version: int, version: int) -> bool:
    """Whether the update's forward can be this step's scoring pass: where it computes the same log-prob bits as the
    no-grad pass would, on the same weights, and nothing needs them before the update. Each exclusion says why."""
    cfg, weights = run.cfg, run.weights
    return (run.pipeline is None   # split roles: the rollout ranks scored the samples, beside the generation
            and gen_version == version   # a lagged generator: the check runs on its weights, not the trained ones
            # Standard mode: the training forward's products (q, k and v apart, where the no-grad forward packs
            # them) need not give the no-grad forward's bits, which the standard arm's parity statistics measure.
            and cfg.kernel_mode == "invariant"
            # A second mini-batch or epoch trains on moved weights: the old log-probs are the first one's weights'.
            and cfg.optim.epochs == 1 and cfg.optim.mini_batches == 1
            and cfg.objective.old_logprobs == "recompute"   # 'sampler': the ratio divides by the generator's log-probs
            # The penalty needs them before the advantages.
            and not (cfg.objective.kl_coef > 0 and cfg.objective.kl_in_reward)
            # The correction weighs the old policy against the sampler over whole sequences of the [B, T] layout,
            # and its weights are logged over the step: computed per micro-batch, a sum's grouping could differ.
            and cfg.objective.correction == "none"
            # FSDP2: the sharded module trains, the whole bf16 model scores (a sharded forward is a collective).
            and weights.scorer is weights.module)


def check_parity(run: Rank, step: int, batch: RolloutBatch, recomputed: torch.Tensor,
                 checked: torch.Tensor) -> dict:
    """The parity check over the whole step (every rank's rows, gathered in rank order) on the tokens `checked` (the
    real tokens of the rows recomputed): its statistics logged, step 1's per-token log-probs saved, and in invariant
    mode a difference stops the run; returns the statistics."""
    cfg, log, dp = run.cfg, run.log, run.dp
    # Over the whole step: a break on any rank stops every rank, each raising the same error.
    behavior_all, recomputed_all, mask_all = dp.gather_rows(batch.behavior, recomputed, checked)
    parity = parity_stats(behavior_all, recomputed_all, mask_all)
    # Logged first, so the step that breaks parity is on record in metrics.csv.
    log(step, "parity_tokens_checked", parity["tokens"])
    log(step, "parity_max_abs_diff", parity["max_abs_diff"])
    log(step, "parity_mean_abs_diff", parity["mean_abs_diff"])
    log(step, "parity_tokens_differing", parity["tokens_differing"])
    log(step, "sampler_trainer_kl", parity["kl"])
    log(step, "is_ess", parity["ess"])
    log(step, "seq_logratio_sd", parity["seq_logratio_sd"])
    log(step, "seq_ratio_outside_1.2", parity["seq_ratio_outside_1.2"])
    if step == 1 and dp.is_main:  # the starting policy's per-token mismatch, for histograms
        save_token_logprobs(run.out / "step1_logprobs.npz", behavior_all, recomputed_all, mask_all)
    # With sampler_noise the mismatch is the experiment's own knob, measured above, not a broken kernel.
    if cfg.kernel_mode == "invariant" and not cfg.rollout.sampler_noise and parity["tokens_differing"]:
        msg = (f"step {step}: generator and trainer log-probs differ on {parity['tokens_differing']} of "
               f"{parity['tokens']} tokens (max |diff| {parity['max_abs_diff']:.3g}) in invariant mode")
        if cfg.parity == "error":
            raise ParityError(f"{msg}; {last_good(run.out)}. Check that no op runs in standard mode "
                              "(mode overrides) and that the generator and trainer share the weights.")
        if dp.is_main:
            print("warning:", msg)
    return parity


class ScorePass:
    """A no-grad pass of the trainer's forward over the rows checked, before the update."""

    def __init__(self, run: Rank):
        self.run = run

    def _checked(self, step: int, batch: RolloutBatch, logp: torch.Tensor, entropy: torch.Tensor,
                 rows_checked: list[bool], seconds: float) -> Scores:
        """The check on the rows recomputed; the rows skipped take the generator's log-probs."""
        checked = batch.mask
        if not all(rows_checked):
            seen = torch.tensor(rows_checked, device=batch.device)[:, None]
            logp, checked = torch.where(seen, logp, batch.behavior), batch.mask * seen
        return Scores(checked, logp, entropy, check_parity(self.run, step, batch, logp, checked), seconds)

    def begin(self, step: int, rollout: Rollout, batch: RolloutBatch) -> Scores:
        """The step's scores, checked."""
        run, cfg = self.run, self.run.cfg
        rows_checked = parity_rows(cfg, step, range(rollout.rows.start, rollout.rows.stop))
        # A lagged generator's weights are its own copy's; else the trainer's (the whole bf16 model with FSDP2).
        scorer = run.sampler.generator if rollout.version != step - 1 else run.weights.scorer
        t0 = time.perf_counter()
        logp, entropy = score(scorer, batch, cfg.optim.max_tokens_per_microbatch, cfg.rollout.temperature,
                              with_entropy=True,
                              rows=None if all(rows_checked) else [i for i, ok in enumerate(rows_checked) if ok])
        if logp.is_cuda:   # the kernels run ahead of the host: their end, not their launch
            torch.cuda.synchronize(logp.device)
        return self._checked(step, batch, logp, entropy, rows_checked, time.perf_counter() - t0)


class InUpdate(ScorePass):
    """The update's forward (one epoch of one mini-batch on the weights that sampled, `scores_in_update`): its
    log-probs, detached, are the old ones, and the check runs after its backward, before its optimizer step. A
    step sampled by a lagged generator (a policy lag, after step 1) takes the separate pass on the generator's
    weights."""

    def begin(self, step: int, rollout: Rollout, batch: RolloutBatch) -> Scores:
        if rollout.version != step - 1:
            return super().begin(step, rollout, batch)
        return Scores(batch.mask, check=functools.partial(check_parity, self.run, step, batch, checked=batch.mask))


class Received(ScorePass):
    """Split roles: the rollout ranks ran the trainer's forward on the weights that sampled (`Rollout.received`:
    the scores of the whole step's rows checked, one after another)."""

    def begin(self, step: int, rollout: Rollout, batch: RolloutBatch) -> Scores:
        received, rows = rollout.received, rollout.rows
        everyone = parity_rows(self.run.cfg, step, range(len(received.items)))
        numbers = [r for r, ok in enumerate(everyone) if ok]
        lengths = [len(received.items[r].tokens) for r in numbers]
        scored = [dict(zip(numbers, t.split(lengths))) for t in received.scored]

        def mine(side: dict) -> torch.Tensor:   # this rank's [B, T], 0 on a row not checked (as `score`'s)
            return batch.spread(torch.cat([side.get(r, torch.zeros(len(received.items[r].tokens)))
                                           for r in range(rows.start, rows.stop)]))
        return self._checked(step, batch, mine(scored[0]), mine(scored[1]), everyone[rows], received.score_s)


def choose_scoring(run: Rank) -> ScorePass:
    """The run's scoring: the rollout ranks' (split roles), the update's forward where it gives the same bits, else
    a separate pass."""
    if run.pipeline is not None:
        return Received(run)
    return InUpdate(run) if scores_in_update(run, 0, 0) else ScorePass(run)
