"""Processes under torchrun: who this process is (`Dist`), its process group (`init`), and which ranks train and
which generate (`roles`).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it starts; `init` reads
them and initialises torch.distributed over NCCL on GPUs and gloo on CPUs. Without them the program is one
process with no process group, and the same code runs at world size 1 (the modules of this package check
`torch.distributed.is_initialized()` and skip their collectives then). `spawn` starts N local processes with
torchrun's variables set, so a test or a CPU trial goes through the same `init` as a real launch.
"""

from __future__ import annotations

import atexit
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in every process (and `init` needs: all of them, or none for one process)."""

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
"""The process-group backend per device type: NCCL moves GPU tensors GPU to GPU; gloo is the CPU one."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Processes in the job (all nodes)."""
    local_rank: int
    """Rank on this node: the GPU index this process drives."""
    device: torch.device
    """Where this process's tensors live (cuda:local_rank, or cpu)."""
    backend: str | None
    """'nccl' or 'gloo'; None for one process without a process group."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that logs, writes the run's files and publishes the weights."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group exists (collectives run), even at world size 1 under torchrun."""
        return self.backend is not None


def _int_var(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"torchrun variable {name}={env[name]!r} is not an integer; launch with torchrun, "
                         "which sets it") from None


def _device(device: str | torch.device, local_rank: int, under_torchrun: bool) -> tuple[torch.device, str]:
    """(this process's device, its backend) for a requested device."""
    dev = torch.device(device)
    if dev.type not in BACKENDS:
        raise ValueError(f"device {str(device)!r}: distributed runs support {sorted(BACKENDS)}; pass 'cuda' or 'cpu'")
    if dev.type == "cpu":
        return torch.device("cpu"), BACKENDS["cpu"]
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; pass device='cpu' (gloo) or run "
                         "on a GPU host")
    count = torch.cuda.device_count()
    if under_torchrun and dev.index is not None and dev.index != local_rank:
        raise ValueError(f"device {str(device)!r} but LOCAL_RANK={local_rank}: under torchrun each process drives "
                         "the GPU of its local rank; pass 'cuda' without an index")
    index = local_rank if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"this process needs GPU {index} but the host has {count}: start at most {count} "
                         f"processes per node (torchrun --nproc-per-node {count})")
    return torch.device("cuda", index), BACKENDS["cuda"]


def from_env(device: str | torch.device = "cpu", env: dict[str, str] | None = None) -> Dist:
    """The `Dist` that torchrun's variables in `env` (default os.environ) describe, without initialising anything;
    a single-process Dist (backend None) when none of them is set. A partial or inconsistent set is a ValueError."""
    env = dict(os.environ if env is None else env)
    present = [v for v in TORCHRUN_VARS if v in env]
    if not present:
        dev, _ = _device(device, 0, under_torchrun=False)
        return Dist(rank=0, world_size=1, local_rank=0, device=dev, backend=None)
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ValueError(f"torchrun's environment is incomplete: {missing} unset while {present} are set; launch "
                         "with torchrun (torchrun --nproc-per-node N ...) or unset them all to run as one process")
    rank, world, local = (_int_var(env, v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world < 1 or not 0 <= rank < world or not 0 <= local <= rank:
        raise ValueError(f"inconsistent torchrun variables RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}: "
                         "need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE")
    dev, backend = _device(device, local, under_torchrun=True)
    return Dist(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend)


def init(device: str | torch.device = "cuda", timeout_s: float | None = None) -> Dist:
    """Joins the job torchrun started (NCCL for 'cuda', gloo for 'cpu') and returns this process's `Dist`; a
    single-process Dist, with no process group, outside torchrun. Calling it again returns the same Dist.
    The group lasts until the process exits (or `shutdown`): a later run of the same job joins it again. Tearing
    it down and building it anew on the same port is a race: a rank that finished first reached the old
    rendezvous store before rank 0 closed it, and NCCL's set-up failed on the dropped connection.

    timeout_s: how long a collective may wait for the other ranks before failing (torch's default otherwise: a
    rank that died leaves the others blocked until then)."""
    d = from_env(device)
    if d.backend is None:
        return d
    if dist.is_initialized():
        backend = dist.get_backend()
        if (dist.get_rank(), dist.get_world_size(), backend) != (d.rank, d.world_size, d.backend):
            raise RuntimeError(f"a process group already exists (rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, {backend}) that is not the one torchrun's variables "
                               f"describe ({d.rank} of {d.world_size}, {d.backend}); call shutdown() first")
        return d
    if d.device.type == "cuda":
        torch.cuda.set_device(d.device)
    dist.init_process_group(d.backend, init_method="env://", rank=d.rank, world_size=d.world_size,
                            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
                            # NCCL: bind the communicator to this GPU now, not at the first collective.
                            device_id=d.device if d.device.type == "cuda" else None)
    atexit.register(shutdown)
    return d


def shutdown() -> None:
    """Destroys the process group if one exists (at exit; a no-op for one process)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Roles:
    """Which global ranks train and which generate rollouts."""

    trainer: tuple[int, ...]
    """The trainer ranks (one FSDP group); the first is the source of every weight sync."""
    rollout: tuple[int, ...]
    """The ranks that generate. Colocated: the same ranks as `trainer`."""

    @property
    def colocated(self) -> bool:
        """Every rank both trains and generates (its generator takes the weights on its own GPU, no broadcast)."""
        return self.trainer == self.rollout

    @property
    def source(self) -> int:
        """The trainer rank that publishes the weights (`broadcast.broadcast_weights`' src)."""
        return self.trainer[0]

    @property
    def receivers(self) -> tuple[int, ...]:
        """The ranks a weight sync sends to: the rollout ranks that do not train (none when colocated)."""
        return tuple(r for r in self.rollout if r not in self.trainer)

    def of(self, rank: int) -> tuple[str, ...]:
        """The roles of one rank: ('trainer',), ('rollout',) or ('trainer', 'rollout')."""
        if not 0 <= rank < len(set(self.trainer) | set(self.rollout)):
            raise ValueError(f"rank {rank} is not in this job of {len(set(self.trainer) | set(self.rollout))} ranks")
        return tuple(name for name, ranks in (("trainer", self.trainer), ("rollout", self.rollout)) if rank in ranks)


def roles(world_size: int, rollout_ranks: int) -> Roles:
    """Splits `world_size` ranks: the last `rollout_ranks` generate, the others train; with rollout_ranks == 0
    every rank does both (colocated). Trainers take the low ranks so rank 0, which writes the run's files, trains
    and is the weight source, and the FSDP group is one contiguous block (on one host: its GPUs 0..T-1)."""
    for name, v in (("world_size", world_size), ("rollout_ranks", rollout_ranks)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rollout_ranks < 0:
        raise ValueError(f"rollout_ranks must be >= 0 (0: colocated, every rank trains and generates), got "
                         f"{rollout_ranks}")
    if rollout_ranks >= world_size:
        raise ValueError(f"rollout_ranks={rollout_ranks} leaves no trainer rank in a world of {world_size}: use at "
                         f"most {world_size - 1} rollout ranks, or 0 to colocate (every rank trains and generates)")
    everyone = tuple(range(world_size))
    if rollout_ranks == 0:
        return Roles(trainer=everyone, rollout=everyone)
    split = world_size - rollout_ranks
    return Roles(trainer=everyone[:split], rollout=everyone[split:])


_PORTS = range(20000, 32768)
"""Where `free_port` draws from: below Linux's ephemeral range (32768-60999), from which the kernel hands out the
ports of every outgoing connection, gloo's among them. A port the kernel picked (bind to port 0) is an ephemeral
one, which another test's connections could take before the rendezvous binds it; one drawn here is not."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn at random below the ephemeral range (another process may still take
    it before the rendezvous binds it: tests and benchmarks only)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in {_PORTS.start}-{_PORTS.stop - 1} after 200 tries")


def _spawned(local_rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # As torchrun: one CPU thread per process unless OMP_NUM_THREADS says otherwise (N processes each spinning up
    # a thread per core oversubscribe the host; torch was imported before this line, so the count is set here).
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        fn(*args)
        # Every rank done before any tears its connections down: a gloo rank whose peer destroyed the group while
        # its own last transfer was still closing aborted ("terminate called without an active exception", ~1 in
        # 30 runs of tests/test_distributed.py). Not on an error: the peer may never reach the barrier.
        if dist.is_initialized():
            dist.barrier()
    finally:
        shutdown()


def spawn(fn: Callable[..., None], world_size: int, *args, port: int | None = None) -> None:
    """Runs fn(*args) in `world_size` fresh local processes (start method spawn) with torchrun's variables set, as
    `torchrun --nproc-per-node world_size` would; fn calls `init` itself. fn must be importable by name (a
    module-level function). Returns when all have finished; an exception in any is raised here with its
    traceback, and the others are terminated."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mp.start_processes(_spawned, args=(fn, world_size, port or free_port(), args), nprocs=world_size,
                       start_method="spawn", join=True)
