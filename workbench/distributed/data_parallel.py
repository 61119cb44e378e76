"""Replicated data parallelism for the trainer: every rank holds the whole model, generates and trains on its own
share of each step's prompts, and takes the same optimizer step on gradients summed over the ranks.

Each need beyond one process is a plain torch.distributed collective: the rank's share of the prompts (`shard`, whole
groups), the whole step's rows in the one-process order (`gather_rows`, `gather_objects`), scalar reductions so that
every rank takes the same decision (`sum`, `max`, `any`, ...), the gradient sum (`all_reduce_grads`), the replica
check (`replicate`, `check_replicas`) and rank 0's work (`on_main`). At world size 1 every method returns its input:
one process computes what it computed before this module existed. The weights are duck-typed (`TrainWeights`), so
this module imports nothing from `workbench.rl`. Each method, split roles, FSDP2 and tensor parallelism:
docs/distributed.md, "`workbench/distributed/data_parallel.py`: replicated data parallelism".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .broadcast import digest, named_weights
from .launch import Dist, init

GRAD_BUCKET_ELEMENTS = 64 * 2**20
"""Gradients without a flat buffer are summed in fp32 buckets of this many elements (256 MiB): one collective
per bucket, and never a full-model fp32 copy."""

_T = TypeVar("_T")


@dataclass
class DataParallel:
    """This process's rank in a replicated data-parallel run (or the whole run, at world size 1)."""

    process: Dist
    """This process's rank, world size and device."""
    group: dist.ProcessGroup | None = None
    """The ranks that train together, their first member global rank 0 (None: every rank of the job)."""

    @classmethod
    def join(cls, device: str) -> DataParallel:
        """Joins the job torchrun started (`launch.init`), or one process without torchrun's variables."""
        return cls(init(device))

    @property
    def rank(self) -> int:
        """This process's rank among the ranks that train together."""
        return self.process.rank if self.group is None else dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        """The ranks that train together."""
        return self.process.world_size if self.group is None else dist.get_world_size(self.group)

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes the run's files."""
        return self.process.is_main

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The ranks that train together as a process group (FSDP2 shards over it)."""
        return self.group or dist.group.WORLD

    @property
    def _src(self) -> int:
        """The group's first rank as a global rank (what torch.distributed's `src` arguments take)."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def shard(self, n: int, name: str = "prompts_per_step") -> slice:
        """This rank's contiguous share of n items, the same size on every rank (so replicas train on equal
        shares and the step's rows lie in rank order); `name` is the setting a bad n is reported as."""
        return share(n, self.rank, self.world_size, name)

    def gather_rows(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors of one shape and dtype from every rank, each concatenated along dim 0 in rank order; the other
        dims are zero-padded to the widest rank's (a [B, T] completion layout is right-padded with zeros, as one
        process pads it). Two collectives for all of them."""
        if self.world_size == 1:
            return tensors
        stacked = torch.stack(tensors)
        shape = torch.tensor(stacked.shape[1:], dtype=torch.int64, device=stacked.device)
        shapes = [torch.empty_like(shape) for _ in range(self.world_size)]
        dist.all_gather(shapes, shape, group=self.group)
        shapes = [tuple(s.tolist()) for s in shapes]
        widest = [max(s[d] for s in shapes) for d in range(len(shapes[0]))]
        padded = stacked.new_zeros(len(tensors), *widest)
        padded[(slice(None), *(slice(0, n) for n in stacked.shape[1:]))] = stacked
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        whole = torch.cat([p[:, : s[0]] for p, s in zip(parts, shapes)], dim=1)
        return tuple(whole.unbind(0))

    def gather_objects(self, items: list) -> list:
        """Every rank's list (picklable items), concatenated in rank order."""
        if self.world_size == 1:
            return items
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, items, group=self.group)
        return [x for part in out for x in part]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks (a new tensor)."""
        if self.world_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def ratio_of_sums(self, num: torch.Tensor, den: torch.Tensor) -> float:
        """sum(num) / sum(den) over the ranks: a mean over the whole step's tokens (num, den: scalar tensors)."""
        if self.world_size > 1:
            num, den = self.sum(torch.stack([num, den.to(num.dtype)])).unbind()
        return float(num / den)

    def max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (times: a step lasts as long as its slowest rank)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.process.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.process.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def first_non_finite(self, losses: torch.Tensor) -> torch.Tensor | None:
        """The first non-finite value of `losses` on the lowest rank that has one, or None on every rank."""
        bad = losses[~torch.isfinite(losses)]
        if self.world_size == 1:
            return bad[0] if len(bad) else None
        mine = torch.stack([torch.ones_like(bad[0]), bad[0]]) if len(bad) else losses.new_zeros(2)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return next((t[1] for t in every if t[0] == 1), None)

    def on_main(self, fn: Callable[[], _T]) -> _T | None:
        """fn() on rank 0 only: its result there, None on the other ranks, which wait for it. Rank 0's failure is
        raised on every rank (the others as a RuntimeError naming it), so no rank blocks in its next collective."""
        if self.world_size == 1:
            return fn()
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:
                error = e
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=self._src, group=self.group)
        if error is not None:
            raise error
        if status[0] is not None:
            raise RuntimeError(f"rank 0 failed, so rank {self.rank} stops too: {status[0]}")
        return result

    def all_reduce_grads(self, weights) -> None:
        """Sums the gradients of `weights.params` over the ranks, in place, before the optimizer step. The masters'
        fp32 gradients live in one flat buffer (`weights.grad_buffer`): one collective, no copy. Without masters
        (bf16 weights, bf16 adapters) autograd's gradients are summed in fp32, in the parameters' fixed order, in
        buckets cut by sizes alone, and rounded back once; a rank that held no row of the mini-batch adds zeros."""
        if self.world_size == 1:
            return
        if weights.grad_buffer is not None:
            dist.all_reduce(weights.grad_buffer, group=self.group)
            return
        grads = []
        for p in weights.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for bucket in _buckets(grads, GRAD_BUCKET_ELEMENTS):
            flat = torch.cat([g.reshape(-1).float() for g in bucket])
            dist.all_reduce(flat, group=self.group)
            for g, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(summed.view_as(g))

    def replicate(self, weights) -> None:
        """Rank 0's weights (the bf16 model, and the fp32 masters) on every rank: the run starts from one set of
        bits whatever each rank loaded or trained (rank 0 alone trains a self-trained starting policy)."""
        self._broadcast(_replicated(weights))

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Rank 0's weights of `model` on every rank (FSDP2: the fp32 start, before it is cut into shards)."""
        self._broadcast(named_weights(model))

    def _broadcast(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.world_size == 1:
            return
        with torch.no_grad():
            for _, t in named:
                dist.broadcast(t.detach(), src=self._src, group=self.group)

    def check_replicas(self, weights, step: int) -> None:
        """Raises on every rank, naming the ranks and tensors, if any rank's weights (the bf16 model the generator
        runs, and the fp32 masters) differ from rank 0's. A digest per tensor (exact integer sums of the bits,
        `broadcast.digest`), all-gathered: a few small kernels per tensor and one small transfer."""
        if self.world_size == 1:
            return
        named = _replicated(weights)
        mine = digest(named)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        every = [d.cpu() for d in every]
        bad = {r: [named[i][0] for i in torch.nonzero((d != every[0]).any(1)).flatten().tolist()[:3]]
               for r, d in enumerate(every) if not torch.equal(d, every[0])}
        if bad:
            raise RuntimeError(f"step {step}: the data-parallel replicas diverged: ranks {sorted(bad)} hold other "
                               f"weights than rank 0 (first differing tensors per rank: {bad}). Every rank applies "
                               "the same summed gradients, so a rank computed differently: another torch, triton "
                               "or kernel mode, or a faulty GPU. Check those ranks before training on.")


def share(n: int, index: int, count: int, name: str = "prompts_per_step", who: str = "ranks") -> slice:
    """Member `index`'s contiguous share of n items among `count` members, the same size for all (so the rows lie
    in member order); `name` is the setting a bad n is reported as, `who` the members (in the message)."""
    if n < count:
        raise ValueError(f"{name}={n} leaves some of the {count} {who} without work: set {name} to at least {count} "
                         f"(a multiple of {count}), or start fewer processes")
    if n % count:
        raise ValueError(f"{name}={n} does not split evenly over {count} {who}: set {name} to a multiple of {count} "
                         f"(e.g. {n - n % count} or {n - n % count + count})")
    per = n // count
    return slice(index * per, (index + 1) * per)


def _replicated(weights) -> list[tuple[str, torch.Tensor]]:
    """What must be equal on every rank: the bf16 model's tensors, then the masters (when they are not the model's
    own parameters, nor FSDP2's shards), by name."""
    named = named_weights(weights.model)
    if weights.has_masters and weights.sharded is None:   # tensor parallel: this rank's parts, as its dp peers'
        named += [(f"master {k}", _local(weights.masters[k]).detach()) for k in sorted(weights.masters)]
    return named


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_parallel(world: DataParallel, degree: int) -> tuple[DataParallel, DeviceMesh]:
    """The `world = dp x degree` ranks as a (dp, tp) mesh in torchtitan's order (a tensor-parallel group is `degree`
    consecutive ranks): this rank's data-parallel group (the ranks holding its part of the weights) and its
    tensor-parallel mesh (1-D: the ranks that share its rows)."""
    if not world.process.distributed:
        raise ValueError(f"tensor_parallel={degree} splits the model over torchrun's processes: launch with torchrun "
                         f"--nproc-per-node {degree} (or a multiple), or set tensor_parallel=1")
    if world.world_size % degree:
        raise ValueError(f"tensor_parallel={degree} does not divide the {world.world_size} trainer processes: start "
                         f"a multiple of {degree} processes, or set tensor_parallel to a divisor of "
                         f"{world.world_size}")
    mesh = init_device_mesh(world.process.device.type, (world.world_size // degree, degree),
                            mesh_dim_names=("dp", "tp"))
    return DataParallel(world.process, mesh["dp"].get_group()), mesh["tp"]


def _buckets(tensors: list[torch.Tensor], elements: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped up to `elements` each (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = elements
    for t in tensors:
        if size + t.numel() > elements:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return out
