"""torch.distributed on CPU: 2 processes over gloo on 127.0.0.1, each started by `launch.spawn` with torchrun's
variables, on the tiny model: the weight broadcast and its checks, FSDP2's forward bits, DCP checkpoints
(bitwise resume at world size 2, loadable at world size 1, atomic saves). The trainer's data parallelism:
test_data_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import same_bits

from workbench.distributed import broadcast, checkpoint, launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_roles():
    r = launch.roles(4, 1)
    assert (r.trainer, r.rollout, r.source, r.receivers, r.colocated) == ((0, 1, 2), (3,), 0, (3,), False)
    assert r.of(0) == ("trainer",) and r.of(3) == ("rollout",)
    c = launch.roles(2, 0)
    assert c.colocated and c.trainer == c.rollout == (0, 1) and c.receivers == () and c.of(1) == ("trainer", "rollout")
    assert launch.roles(1, 0).trainer == (0,)
    with pytest.raises(ValueError, match="leaves no trainer rank"):
        launch.roles(2, 2)
    with pytest.raises(ValueError, match="rollout_ranks must be >= 0"):
        launch.roles(2, -1)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch.roles(0, 0)
    with pytest.raises(ValueError, match="must be an integer"):
        launch.roles(2.0, 0)
    with pytest.raises(ValueError, match="not in this job"):
        r.of(4)


def test_env_without_torchrun_and_its_errors(monkeypatch):
    for v in launch.TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)
    d = launch.init("cpu")
    assert d == launch.Dist(0, 1, 0, torch.device("cpu"), None) and d.is_main and not d.distributed
    assert not dist.is_initialized()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert launch.from_env("cpu", env) == launch.Dist(1, 2, 1, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match=r"incomplete: \['MASTER_ADDR', 'MASTER_PORT'\] unset"):
        launch.from_env("cpu", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE"):
        launch.from_env("cpu", {**env, "RANK": "2"})
    with pytest.raises(ValueError, match="not an integer"):
        launch.from_env("cpu", {**env, "WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="pass 'cuda' or 'cpu'"):
        launch.from_env("mps", env)


def _broadcast_worker() -> None:
    from workbench.models import build, weights_equal

    d = launch.init("cpu")
    source = build("tiny", dtype=torch.bfloat16, seed=0)
    model = build("tiny", dtype=torch.bfloat16, seed=d.rank)   # the receiver starts from other weights
    total = sum(t.nbytes for _, t in broadcast.named_weights(model))
    bucket = 40_000   # the 64 KiB embedding spans two buckets; the last bucket is partial
    res = broadcast.broadcast_weights(model, 3 if d.is_main else None, bucket_bytes=bucket)
    assert weights_equal(dict(model.state_dict()), dict(source.state_dict()))
    assert (res.version, res.bytes, res.buckets) == (3, total, math.ceil(total / bucket)) and res.check_seconds > 0

    # A receiver's copy flips one bit of the first tensor in name order: the digest check names rank and tensor.
    unpack = broadcast._unpack

    def corrupting(pieces, buf):
        unpack(pieces, buf)
        view, start, _, _ = pieces[0]
        view[start:start + 1].bitwise_xor_(1)

    if d.rank == 1:
        broadcast._unpack = corrupting
    try:
        with pytest.raises(RuntimeError, match=r"version 4\): ranks \[1\] hold other bits than source rank 0.*"
                                               r"model\.embed_tokens\.weight.*Run the sync again"):
            broadcast.broadcast_weights(model, 4 if d.is_main else None, bucket_bytes=bucket)
    finally:
        broadcast._unpack = unpack
    res = broadcast.broadcast_weights(model, 4 if d.is_main else None)   # one 256 MiB bucket, partial
    assert res.buckets == 1 and weights_equal(dict(model.state_dict()), dict(source.state_dict()))
    assert broadcast.verify_weights(model, 4 if d.is_main else None) == 4

    # Another layout on rank 1 (fp32): named before any payload moves, on both ranks.
    other = build("tiny", dtype=torch.float32 if d.rank == 1 else torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"ranks \[1\] hold a model of another layout"):
        broadcast.broadcast_weights(other, 5 if d.is_main else None)
    with pytest.raises(ValueError, match="source rank 0 passed no version"):
        broadcast.broadcast_weights(model, None)

    # The source sends a kept version (a policy lag's older weights) by the model's names, not its model's own.
    older = build("tiny", dtype=torch.bfloat16, seed=7)
    kept = {k: v.detach().clone() for k, v in older.state_dict().items()}
    res = broadcast.broadcast_weights(model, 6 if d.is_main else None, weights=kept if d.is_main else None)
    assert res.version == 6 and weights_equal(dict(model.state_dict()), dict(older.state_dict())) == (d.rank == 1)
    del kept["model.norm.weight"]   # named on every rank, not raised on the source alone (the others would wait)
    with pytest.raises(ValueError, match=r"ranks \[1\] hold a model of another layout"):
        broadcast.broadcast_weights(model, 7 if d.is_main else None, weights=kept if d.is_main else None)


@pytest.mark.slow
def test_broadcast_two_ranks():
    launch.spawn(_broadcast_worker, 2)


def _sharded(seed: int, mp_policy=None) -> torch.nn.Module:
    """The tiny model in fp32 (the trainer's masters), sharded over the world per decoder layer and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from workbench.models import build

    # An explicit CPU mesh: without one, fully_shard picks CUDA wherever torch sees a GPU, gloo group or not.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build("tiny", dtype=torch.float32, seed=seed)
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _fsdp_forward_worker() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from workbench.kernels import mode
    from workbench.models import build, copy_weights

    d = launch.init("cpu")
    # The single-GPU trainer's bf16 model: the fp32 masters cast by copy_ (round to nearest even).
    ref = build("tiny", dtype=torch.bfloat16, seed=None)
    copy_weights(dict(build("tiny", dtype=torch.float32, seed=0).state_dict()), ref)
    # FSDP2 casts the gathered fp32 shards to bf16 the same way. The model's inputs include fp32 RoPE tables that
    # must stay fp32, hence cast_forward_inputs=False (token ids are integers, never cast).
    sharded = _sharded(0, MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    w = sharded.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, DTensor) and w.to_local().shape[0] * d.world_size == w.shape[0]
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    with mode("invariant"), torch.no_grad():
        want, got = ref(ids), sharded(ids)
    assert got.dtype == torch.bfloat16 and same_bits(got, want)


@pytest.mark.slow
def test_fsdp2_forward_bits_match_unsharded():
    launch.spawn(_fsdp_forward_worker, 2)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    """A deterministic optimizer step without a forward (the checkpoint is what is tested)."""
    for p in model.parameters():
        p.grad = p.detach() * (0.5 * k) + 0.01 * k
    opt.step()


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _checkpoint_worker(root: str, snapshot: str) -> None:
    from pathlib import Path

    d = launch.init("cpu")
    model = _sharded(0)
    opt = _adamw(model)
    for step in (1, 2):
        _train_step(model, opt, step)
        checkpoint.save(root, step, model, opt, version=step, seeds={"data": 7}, extra={"note": "test"})
    saved = _full_state(model, opt)
    if d.is_main:
        torch.save(saved, snapshot)

    # A save killed after every shard is written but before state.json: step 2 stays the newest complete one.
    _train_step(model, opt, 3)
    write_state = checkpoint._write_state

    def killed(folder, state):
        raise OSError("simulated kill before state.json")

    checkpoint._write_state = killed
    try:
        with pytest.raises((OSError, RuntimeError), match="simulated kill"):
            checkpoint.save(root, 3, model, opt, version=3)
    finally:
        checkpoint._write_state = write_state
    dist.barrier()
    assert [p.name for p in checkpoint.checkpoints(root)] == ["step-000001", "step-000002"]
    assert (Path(root) / ".step-000003.tmp").is_dir() and not (Path(root) / ".step-000003.tmp/state.json").exists()
    with pytest.raises(ValueError, match="not a complete checkpoint.*newest complete one is .*step-000002"):
        checkpoint.load(Path(root) / ".step-000003.tmp", model, opt)

    state = checkpoint.load(checkpoint.latest(root), model, opt)
    assert (state["step"], state["version"], state["seeds"], state["world_size"]) == (2, 2, {"data": 7}, 2)
    assert same_bits(_full_state(model, opt), saved)


@pytest.mark.slow
def test_checkpoint_resume_bitwise_and_at_world_size_one(tmp_path):
    root, snapshot = tmp_path / "checkpoints", tmp_path / "snapshot.pt"
    launch.spawn(_checkpoint_worker, 2, str(root), str(snapshot))
    saved_model, saved_optim = torch.load(snapshot)

    # World size 1, no process group: the 2-rank checkpoint loads whole into a plain model and optimizer.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from workbench.models import build

    assert not dist.is_initialized()
    model = build("tiny", dtype=torch.float32, seed=5)
    opt = _adamw(model)
    state = checkpoint.load(checkpoint.latest(root), model, opt)
    assert state["step"] == 2 and state["extra"] == {"note": "test"}
    got_model, got_optim = get_state_dict(model, opt)
    assert same_bits(got_model, saved_model) and same_bits(got_optim, saved_optim)

    # A single-process save replaces the killed save's leftovers and keeps the newest two.
    _train_step(model, opt, 3)
    checkpoint.save(root, 3, model, opt, version=3)
    assert [p.name for p in checkpoint.checkpoints(root)] == ["step-000002", "step-000003"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
