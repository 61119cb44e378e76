"""Beyond one process, on torch.distributed: the torchrun launch and the trainer/rollout split (`launch`), the
weight broadcast with its digest check (`broadcast`), sharded DCP checkpoints (`checkpoint`), the trainer's
replicated data parallelism (`data_parallel`) or its FSDP2 sharding (`fsdp`), and split roles with their
asynchronous pipeline (`pipeline`). See docs/distributed.md."""

from .broadcast import DEFAULT_BUCKET_BYTES, SyncResult, broadcast_weights, verify_weights, weights_digest
from .checkpoint import checkpoints, latest
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_checkpoint
from .data_parallel import DataParallel
from .launch import Dist, Roles, free_port, from_env, init, roles, shutdown, spawn
from .pipeline import Pipeline

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DataParallel",
    "Dist",
    "Pipeline",
    "Roles",
    "SyncResult",
    "broadcast_weights",
    "checkpoints",
    "free_port",
    "from_env",
    "init",
    "latest",
    "load_checkpoint",
    "roles",
    "save_checkpoint",
    "shutdown",
    "spawn",
    "verify_weights",
    "weights_digest",
]
