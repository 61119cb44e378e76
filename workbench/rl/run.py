"""A training run's setup, on each rank: its place among the processes (`Place`: data, tensor and pipeline
parallel groups), then a trainer rank's state (`TrainerRank`: the weights on the chosen backend, the reference, a
resumed run's state, the sampler and scoring chosen once, the metrics log, the checkpoints) or a rollout rank's
(`RolloutRank`, split roles: a bf16 generator that serves trainer rank 0's orders). The loop is `trainer.train`;
one step `step.train_step`. docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ..config import write_config
from ..distributed.data_parallel import DataParallel, tensor_parallel
from ..distributed.pipeline import Pipeline
from ..env import resolve_device
from ..files import make_folder
from ..generation import DecodeGraphs
from ..kernels import mode
from ..models import build, copy_weights, load_pretrained, load_tokenizer, resolve_model, save_pretrained
from ..models.lora import base_state
from ..policies.selftrained import PolicyConfig, train_policy
from ..tasks import make_task
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_sharded_checkpoint
from .config import TrainConfig
from .logprobs import score
from .metrics import MetricsLog
from .rollout import RolloutBatch
from .rewards import RewardStage
from .samplers import VLLM, Embedded, Remote, StepPrompts, generate_rows
from .scoring import choose_scoring, parity_rows
from .sync import WeightSync
from .weights import TrainWeights


def _starting_policy(cfg: TrainConfig, out: Path, device: str, dp: DataParallel, generator_only: bool = False):
    # fp32 where it becomes the masters; a LoRA base is frozen in bf16 (the same bits as a cast of the fp32 load).
    # A rollout rank's generator is bf16 (its weights come from trainer rank 0's broadcast).
    masters = cfg.optim.master_dtype == "float32" and cfg.optim.adapter == "none" and not generator_only
    dtype = torch.float32 if masters else torch.bfloat16
    if cfg.policy:
        folder = resolve_model(cfg.policy)
        return load_pretrained(folder, dtype=dtype, device=device), load_tokenizer(folder)
    if cfg.data.task != "arithmetic":
        raise ValueError(f"task {cfg.data.task!r} needs a starting checkpoint (policy=...); the self-trained policy "
                         "only knows arithmetic")
    # Rank 0 trains it and saves it; the other ranks load that copy, for its shape and tokenizer (the weights
    # every rank starts from are rank 0's: `DataParallel.replicate`).
    policy = PolicyConfig(seed=cfg.seed, difficulty=cfg.data.difficulty, device=device)
    trained = dp.on_main(lambda: train_policy(policy, out / "policy", progress=cfg.progress)[:2])
    return trained or (load_pretrained(out / "policy", dtype=dtype, device=device), load_tokenizer(out / "policy"))


def _vllm_engine(cfg: TrainConfig, model, out: Path):
    """vLLM running the workbench model on the starting weights, in this process (generator='vllm')."""
    from ..generation.vllm_backend import VLLMGenerator

    save_pretrained(model, out / "vllm_start")
    return VLLMGenerator(out / "vllm_start", gpu_memory_utilization=cfg.rollout.vllm_memory,
                         batch_invariant=cfg.kernel_mode == "invariant", seed=cfg.seed,
                         model_impl=cfg.rollout.vllm_model, kernel_mode=cfg.kernel_mode)


def train_weights(start, cfg: TrainConfig, device: str, shard_group=None, tp_mesh=None) -> TrainWeights:
    """The weights the update trains, from the fp32 (or bf16) `start`, on cfg.distributed.trainer_backend;
    `shard_group`: the FSDP2 trainer ranks; `tp_mesh`: this rank's tensor-parallel group (torchtitan only)."""
    if cfg.distributed.trainer_backend == "torchtitan":   # an optional extra: imported only when asked for
        from .titan_backend import TitanWeights

        return TitanWeights(start, cfg, device, shard_group, tp_mesh)
    optim = cfg.optim
    return TrainWeights(start, optim.master_dtype, optim.lr, device, optim.weight_decay, optim.max_grad_norm,
                        optim.lora_config(), cfg.seed, shard_group)


@dataclass
class Place:
    """This rank's place among the processes."""

    device: str
    world: DataParallel
    """Every rank of the job (one process without torchrun's variables)."""
    pipeline: Pipeline | None
    """Split roles (rollout_ranks > 0): the rollout ranks and the trainer ranks, and what passes between them."""
    trainers: DataParallel | None
    """Every rank that trains (the decisions they take together: the time limit); None on a rollout rank."""
    dp: DataParallel | None
    """The ranks that split each step's prompts (with tensor parallelism: one rank of each group)."""
    tp_mesh: object | None
    """tensor_parallel > 1: this rank's tensor-parallel group (1-D mesh), whose ranks share their rows."""
    share: slice
    """This rank's prompts of each step (to train on; on a rollout rank, to generate)."""

    @classmethod
    def join(cls, cfg: TrainConfig) -> Place:
        """Joins the job (one process without torchrun's variables) and finds this rank's groups and share."""
        device = resolve_device(cfg.device)
        world = DataParallel.join(device)
        ranks = cfg.distributed.rollout_ranks
        pipeline = Pipeline(world, ranks, cfg.rollout.policy_lag) if ranks else None
        trainers = world if pipeline is None else pipeline.trainers
        dp, tp_mesh = trainers, None
        if cfg.distributed.tensor_parallel > 1:
            dp, tp_mesh = tensor_parallel(world, cfg.distributed.tensor_parallel)
        return cls(device, world, pipeline, trainers, dp, tp_mesh, (pipeline or dp).shard(cfg.rollout.prompts_per_step))

    @property
    def is_rollout(self) -> bool:
        """A rollout rank (split roles): it only generates."""
        return self.pipeline is not None and self.pipeline.is_rollout


def open_rank(cfg: TrainConfig) -> TrainerRank | RolloutRank:
    """This rank's side of the run, set up."""
    place = Place.join(cfg)
    return (RolloutRank if place.is_rollout else TrainerRank)(cfg, place)


class _Rank:
    """What both ranks set up: the run folder's checks, the metrics log, the task, the starting policy."""

    def __init__(self, cfg: TrainConfig, place: Place | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        place = place or Place.join(cfg)
        self.device, self.world, self.pipeline, self.trainers = place.device, place.world, place.pipeline, \
            place.trainers
        self.dp, self.tp_mesh, self.share = place.dp, place.tp_mesh, place.share
        if self.world.is_main:   # the only rank that writes the run's files
            make_folder(self.out)
        if cfg.distributed.parallel == "fsdp2" and not self.world.process.distributed:
            raise ValueError("parallel='fsdp2' shards the trainer over torchrun's processes: launch with torchrun "
                             "--nproc-per-node N, or set parallel='replicate' for one process")
        if cfg.rollout.generator == "vllm" and self.world.world_size > 1:
            raise ValueError("generator='vllm' under torchrun is not supported yet (one engine per rank, each "
                             "with its own process group): use generator='embedded', or run vLLM in one process")
        if cfg.rollout.generator == "vllm":
            from ..generation.vllm_backend import require_vllm

            require_vllm()  # before the starting policy is trained: say at once what is missing
        # Before any work: say it at once.
        last = latest_checkpoint(self.out)
        if cfg.checkpoint.resume and last is None:
            raise FileNotFoundError(f"resume: no checkpoint in {self.out / 'checkpoints'}; run without resume first")
        if not cfg.checkpoint.resume and last is not None:
            raise ValueError(f"{self.out} already holds a run (checkpoint {last}); continue it with resume=True "
                             "(--resume), or give another out_dir (or delete that one)")
        main = self.world.is_main
        if main:
            write_config(cfg, self.out / "config.yaml")
        self.log = MetricsLog(cfg.variant or cfg.kernel_mode, cfg.seed, self.out if main else None,
                              cfg.tensorboard and main)
        torch.manual_seed(cfg.seed)
        self.task = make_task(cfg.data.task, seed=cfg.seed, difficulty=cfg.data.difficulty, source=cfg.data.task_source,
                              question_field=cfg.data.question_field, answer_field=cfg.data.answer_field,
                              max_new_tokens=cfg.rollout.max_new_tokens)
        # The embedded generator's caches and graphs, across steps. Not with sync='checkpoint': it loads a new
        # generator model every step, so nothing would replay and the kept step would hold the old model.
        self.graphs = DecodeGraphs() if cfg.rollout.keep_graphs and cfg.rollout.sync != "checkpoint" else None
        start, self.tok = _starting_policy(cfg, self.out, self.device, self.world, isinstance(self, RolloutRank))
        self.prompts = StepPrompts(cfg, self.task, self.tok, self.share)
        self._setup(start)

    def _setup(self, start) -> None:
        raise NotImplementedError


class RolloutRank(_Rank):
    """Split roles: a rank that only generates (a bf16 generator, no masters, no optimizer), the steps trainer
    rank 0 orders, with the weights it sends (`Pipeline.serve`)."""

    def _setup(self, start) -> None:
        self.generator = start

    def serve(self) -> pd.DataFrame:
        """The run on this rank; returns an empty table: the metrics are the trainer ranks' (rank 0 writes them)."""
        cfg = self.cfg

        def sample(step: int) -> list:   # the completions' log-probs are host tensors: they travel pickled
            _, prompts, sampling, rows = self.prompts(step)
            return generate_rows(self.generator, cfg, prompts, sampling, rows, self.graphs)

        def rescore(step: int, completions: list) -> tuple[torch.Tensor, torch.Tensor]:   # the parity check's side
            ids = [c.request_id for c in completions]
            completions = [c for c, ok in zip(completions, parity_rows(cfg, step, ids)) if ok]
            if not completions:
                return torch.empty(0), torch.empty(0)
            batch = RolloutBatch.from_generation([c.prompt for c in completions], completions,
                                                 self.tok.pad_token_id or 0, self.device)
            real = batch.mask.bool()
            return tuple(t[real].cpu() for t in score(self.generator, batch, cfg.optim.max_tokens_per_microbatch,
                                                      cfg.rollout.temperature, with_entropy=True))

        with mode(cfg.kernel_mode):
            self.pipeline.serve(self.generator, sample, rescore)
        self.pipeline.leave()
        return self.log.table()


class TrainerRank(_Rank):
    """A rank that trains: the weights, the sampler and its sync, the scoring, the rewards, the reference."""

    def _setup(self, start) -> None:
        # An error from here on stops the rollout ranks too (they wait for their first order).
        with self.pipeline.stop_on_error() if self.pipeline else contextlib.nullcontext():
            self._trainer(start)

    def _trainer(self, start) -> None:
        """A trainer rank's state: the weights from `start`, the reference, a resumed run's, the sampler's."""
        cfg, main = self.cfg, self.world.is_main
        fsdp2 = cfg.distributed.parallel == "fsdp2"
        if fsdp2 or self.tp_mesh is not None:   # every rank cuts its shards from rank 0's fp32 start
            self.trainers.broadcast_model(start)
        self.weights = train_weights(start, cfg, self.device, self.dp.process_group if fsdp2 else None, self.tp_mesh)
        del start
        self.dp.replicate(self.weights)
        self.reference = None
        if cfg.objective.kl_coef > 0 and cfg.objective.kl_to == "reference":
            # With LoRA the start is the base (B = 0): the reference is the base without adapters.
            self.reference = build(self.weights.model.config, device=self.device, dtype=torch.bfloat16, seed=None)
            copy_weights(base_state(self.weights.model), self.reference)
        self.start_step, lagged, previous = 0, None, None
        if cfg.checkpoint.resume:   # every rank reads the same checkpoint (rank 0 wrote it)
            self.start_step, previous, lagged = load_checkpoint(self.out, self.weights, cfg, self.device)
        self.dp.check_replicas(self.weights, self.start_step)
        self.log.start(self.start_step + 1, previous)
        engine = _vllm_engine(cfg, self.weights.model, self.out) if cfg.rollout.generator == "vllm" else None
        # sync='checkpoint' goes through a folder of each rank's own.
        sync_root = self.out if main else self.out / f"rank-{self.world.rank}"
        # Split roles at policy lag 0: the trainer's model is the sampling weights (the rollout ranks get them by
        # broadcast), so the trainer keeps no generator copy of its own, as one process with sync='shared'.
        sync_cfg = dataclasses.replace(cfg, sync="shared", rollout_ranks=0) \
            if self.pipeline and not cfg.rollout.policy_lag else cfg
        self.sync = WeightSync(sync_cfg, self.weights.model, sync_root, self.device, engine, lagged)
        self.sync(self.start_step)
        self.sampler = _sampler(self)
        self.scoring = choose_scoring(self)
        self.rewards = RewardStage(self.task, self.tok, cfg.rollout.group_size)

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes it (the replicas are identical: today's format, resumable at any world size); FSDP2 or
        tensor parallel: every trainer rank writes its shards."""
        if self.weights.dcp is not None:
            save_sharded_checkpoint(self.out, step, self.weights, self.log.table(), self.cfg, self.sync.lagged)
            return
        self.dp.on_main(lambda: save_checkpoint(self.out, step, self.weights, self.log.table(), self.cfg,
                                                self.sync.lagged))


def _sampler(run: TrainerRank) -> Embedded | VLLM | Remote:
    """The run's rollout source: the rollout ranks (split roles), a vLLM engine, or the embedded generator."""
    if run.pipeline is not None:
        return Remote(run.prompts, run.pipeline, run.sync, run.weights.model, run.start_step, run.cfg.steps)
    return (VLLM if run.cfg.rollout.generator == "vllm" else Embedded)(run.prompts, run.sync, run.graphs)
