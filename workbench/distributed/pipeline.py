"""Split roles: rollout ranks that only generate, trainer ranks that only train, and what passes between them.

With `rollout_ranks = r > 0` of W ranks (`launch.roles`) the last r ranks hold a bf16 generator and nothing else;
the first W - r train, replicated data-parallel among themselves. Orders (`Order`), weights (`broadcast`) and
samples with their trainer log-probs (`Share`) move as plain torch.distributed collectives; a rollout rank scores
its own samples with the trainer's forward on the weights that drew them, so the parity check still compares the
generator with the trainer's kernels. The trainer side alone decides and every rank meets the collectives in one
sequence, which is why blocking collectives over three groups cannot deadlock, and a stop reaches everyone. The
protocol in full (orders, policy lag, stops, failures): docs/distributed.md, "The split-roles protocol".
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .broadcast import SyncResult, broadcast_weights, named_weights
from .data_parallel import DataParallel, share
from .launch import roles


@dataclass(frozen=True)
class Order:
    """What trainer rank 0 tells the rollout ranks next."""

    step: int | None
    """The step to generate; None: stop."""
    version: int | None = None
    """The weights version to generate it with (sent just after the order when the rollout ranks lack it)."""
    error: BaseException | None = None
    """With a stop: the error that stopped the trainer ranks (None: the run ended, or its time limit)."""


@dataclass
class Share:
    """One rollout rank's samples of one step, as they travel to the trainer ranks."""

    step: int
    version: int
    """The weights version that drew them."""
    items: list
    """The completions, their tensor fields cut out into `columns` (`_pack`)."""
    columns: dict
    """The items' 1-D tensor fields, each concatenated over the items, with the items' lengths."""
    scored: tuple
    """The trainer's (log-probs, entropies) of the tokens of the items the parity check recomputes (all, or a sample:
    `TrainConfig.parity_sample`) on the weights that drew them, one item after another (host fp32; empty after a
    failure)."""
    generate_s: float
    """Seconds generating them."""
    score_s: float
    """Seconds scoring them (the trainer's forward)."""
    wait_s: float
    """Seconds before that, waiting: to hand over the previous share, for this order and its weights."""
    span: tuple[float, float]
    """Wall-clock (time.time()) start and end of generating and scoring, to measure the overlap with the trainer's
    update."""
    error: str | None = None
    """A failure while generating or scoring (items then empty)."""


@dataclass
class Received:
    """A step's samples on a trainer rank, with the numbers of the exchange."""

    items: list
    """The whole step's completions, in row order."""
    scored: tuple[torch.Tensor, torch.Tensor]
    """The trainer's (log-probs, entropies) of the tokens of the completions checked, one after another
    (`Share.scored`)."""
    version: int
    """The weights version that drew them."""
    generate_s: float
    """The slowest rollout rank's seconds generating them."""
    score_s: float
    """The slowest rollout rank's seconds scoring them."""
    rollout_wait_s: float
    """The rollout ranks' most seconds waiting before generating them."""
    wait_s: float
    """This trainer rank's seconds waiting for them."""
    overlap_s: float
    """Seconds their generation and scoring ran while this trainer rank trained on the previous step."""


def _portable(error: BaseException | None) -> BaseException | None:
    """The error as the rollout ranks will get it: itself when it pickles, else a RuntimeError with its text."""
    if error is None:
        return None
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _pack(items: list) -> tuple[list, dict]:
    """(the items without their 1-D tensor fields, {field: (the field concatenated over the items, lengths)}): one
    tensor a field to pickle instead of one an item. Pickling costs by the tensor, not by the byte: a step's 512
    completions with two tensors each took 0.7 s to pickle and unpickle on a 2-core CPU, packed 0.15 s all told."""
    if not items or not dataclasses.is_dataclass(items[0]):
        return items, {}
    names = [f.name for f in dataclasses.fields(items[0]) if isinstance(getattr(items[0], f.name), torch.Tensor)]
    columns = {n: (torch.cat([getattr(x, n) for x in items]), [len(getattr(x, n)) for x in items]) for n in names}
    return [dataclasses.replace(x, **dict.fromkeys(names)) for x in items], columns


def _unpack(items: list, columns: dict) -> list:
    """`_pack`'s items whole again."""
    parts = {n: flat.split(lengths) for n, (flat, lengths) in columns.items()}
    return [dataclasses.replace(x, **{n: p[i] for n, p in parts.items()}) for i, x in enumerate(items)]


class Pipeline:
    """One rank's side of a run with split roles (every rank of the job builds one, in the same order)."""

    def __init__(self, dp: DataParallel, rollout_ranks: int, lag: int):
        """`dp`: the whole job's (DataParallel.join); `lag`: the config's policy_lag."""
        if not dp.process.distributed:
            raise ValueError(f"rollout_ranks={rollout_ranks} needs processes of their own for the rollouts: launch "
                             f"with torchrun --nproc-per-node N (N > {rollout_ranks}), or set rollout_ranks=0 to "
                             "generate and train in one process")
        self.roles = roles(dp.world_size, rollout_ranks)
        self.rank = dp.rank
        self.lag = lag
        # new_group is a collective over the whole job, members or not: every rank creates both, in one order.
        self.trainer_group = dist.new_group(list(self.roles.trainer))
        self.sync_group = dist.new_group([self.roles.source, *self.roles.receivers])
        self.is_rollout = self.rank in self.roles.receivers
        self.trainers = None if self.is_rollout else dataclasses.replace(dp, group=self.trainer_group)
        """The trainer ranks' DataParallel (None on a rollout rank)."""
        self.version: int | None = None
        """The weights version the rollout ranks hold (None: not sent yet)."""
        self.ordered = self.gathered = 0   # the last step ordered, and the last whose samples were gathered
        self.closed = False
        """A stop was sent, or a weight broadcast failed (every rank of its group raised): no order may follow."""
        self.last = 0   # the run's last step (`start`)
        self._trained = (0.0, 0.0)   # wall-clock span of this trainer rank's work on the last step received

    def shard(self, n: int, name: str = "prompts_per_step") -> slice:
        """This rank's share of a step's n prompts: among the rollout ranks, which generate them, or among the
        trainer ranks, which train on them. Both splits are checked on every rank, so a bad n stops every rank."""
        for ranks, who in ((self.roles.trainer, "trainer ranks"), (self.roles.rollout, "rollout ranks")):
            share(n, 0, len(ranks), name, who)
        ranks = self.roles.rollout if self.is_rollout else self.roles.trainer
        return share(n, ranks.index(self.rank), len(ranks), name)

    # The rollout side.

    def serve(self, generator: nn.Module, sample: Callable[[int], list],
              score: Callable[[int, list], tuple]) -> None:
        """A rollout rank's whole run: follow trainer rank 0's orders, `sample(step)` (the step's completions of
        this rank's share, on the host) with `generator`'s weights, `score(step, completions)` (`Share.scored`) on
        the same weights, and hand each share over, until a stop."""
        failure: BaseException | None = None
        waiting = time.perf_counter()
        while True:
            order = self._order()
            if order.step is None:
                if failure is not None:
                    raise failure
                if order.error is not None:
                    order.error.add_note(f"(raised by the trainer ranks; rollout rank {self.rank} stops with it)")
                    raise order.error
                return
            if order.version != self.version:
                self.version = broadcast_weights(generator, None, src=self.roles.source, group=self.sync_group).version
            t0, start = time.perf_counter(), time.time()
            items, scored, error = [], (), None
            t1 = t0
            if failure is None:
                try:
                    items = sample(order.step)
                    t1 = time.perf_counter()
                    scored = score(order.step, items)
                except Exception as e:   # handed over with the share: the trainers stop everyone
                    items, scored, failure = [], (), e
            if failure is not None:
                error = f"{type(failure).__name__}: {failure}"
            t2 = time.perf_counter()
            self._gather(Share(order.step, self.version, *_pack(items), scored, t1 - t0, t2 - t1, t0 - waiting,
                               (start, time.time()), error))
            waiting = t2

    # The trainer side (every trainer rank calls each method; trainer rank 0 alone talks to the rollout ranks).

    def start(self, model: nn.Module, version: int, step: int, last: int) -> None:
        """Before the first step (`step`, of the run's `last`): the rollout ranks generate it with `model`'s
        weights, of `version`."""
        self.last = last
        if step <= last:
            self._release(step, model, version)

    def receive(self, step: int) -> Received:
        """Step `step`'s samples (every trainer rank gets the whole step's)."""
        t0 = time.perf_counter()
        shares = [s for s in self._gather(None) if s is not None]
        wait = time.perf_counter() - t0
        self.gathered = step
        failed = [(r, s.error) for r, s in zip(self.roles.receivers, shares) if s.error is not None]
        if failed:
            raise RuntimeError(f"step {step}: rollout rank {failed[0][0]} failed: {failed[0][1]}")
        if {(s.step, s.version) for s in shares} != {(step, self.version)}:
            raise RuntimeError(f"step {step}: the rollout ranks sent steps/versions "
                               f"{sorted({(s.step, s.version) for s in shares})}, ordered ({step}, {self.version})")
        start, end = self._trained
        overlap = max(min(end, s.span[1]) - max(start, s.span[0]) for s in shares)
        self._trained = (time.time(), time.time())
        scored = tuple(torch.cat(side) for side in zip(*(s.scored for s in shares)))
        return Received([x for s in shares for x in _unpack(s.items, s.columns)], scored, self.version,
                        max(s.generate_s for s in shares), max(s.score_s for s in shares),
                        max(s.wait_s for s in shares), wait, max(overlap, 0.0))

    def advance(self, step: int, model: nn.Module, version: int,
                weights: Mapping[str, torch.Tensor] | None = None) -> SyncResult | None:
        """Called with weights of `version` (`model`'s own, or `weights` by its names: a kept older version) once
        step `step`'s samples are in, and again after its update: orders step + 1 as soon as `version` is the one
        it samples with, max(step - lag, 0) (as in one process: `workbench.rl.sync`). Returns the weight sync's
        result, None when none ran."""
        self._trained = (self._trained[0], time.time())
        if step >= self.last or self.ordered > step or version != max(step - self.lag, 0):
            return None
        return self._release(step + 1, model, version, weights)

    def end(self, error: BaseException | None = None) -> None:
        """Trainer ranks, at the run's end, at a time limit, or on an error every trainer rank raises: the rollout
        ranks stop (raising `error`, when given). A step they were ordered and the trainers will not take is
        gathered first and dropped."""
        if self.closed:
            return
        if self.ordered > self.gathered:
            self._gather(None)
            self.gathered = self.ordered
        self._order(Order(None, error=_portable(error)))
        self.closed = True

    def leave(self) -> None:
        """Every rank, after a run that ended without an error: the run's two groups destroyed once every rank is
        done with them (the job's group stays for the next run of the same job)."""
        dist.barrier()
        for group in (self.trainer_group, self.sync_group):
            dist.destroy_process_group(group)

    @contextlib.contextmanager
    def stop_on_error(self) -> Iterator[None]:
        """Trainer ranks' work: an error raised in it (on every trainer rank alike) stops the rollout ranks too."""
        try:
            yield
        except Exception as e:
            self.end(e)
            raise

    def _release(self, step: int, model: nn.Module, version: int,
                 weights: Mapping[str, torch.Tensor] | None = None) -> SyncResult | None:
        """Orders `step` with the weights of `version`, broadcasting them first when the rollout ranks lack them.
        The sync's result on every trainer rank (the source's times; the other ranks' zero)."""
        self._order(Order(step, version))
        self.ordered = step
        if version == self.version:
            return None
        try:
            result = self.trainers.on_main(
                lambda: broadcast_weights(model, version, src=self.roles.source, group=self.sync_group,
                                          weights=weights))
        except BaseException:
            self.closed = True
            raise
        self.version = version
        return result or SyncResult(version, sum(t.nbytes for _, t in named_weights(model)), 0, 0.0, 0.0)

    def _order(self, order: Order | None = None) -> Order:
        """Trainer rank 0 sends `order`; a rollout rank receives one (the other trainer ranks take no part)."""
        if not self.is_rollout and self.rank != self.roles.source:
            return order
        box = [order]
        dist.broadcast_object_list(box, src=self.roles.source, group=self.sync_group)
        return box[0]

    def _gather(self, mine: Share | None) -> list[Any]:
        """Every rank's contribution, in rank order (the rollout ranks' shares; None from the trainer ranks)."""
        out: list[Any] = [None] * (len(self.roles.trainer) + len(self.roles.receivers))
        dist.all_gather_object(out, mine)
        return out
