"""The torchtitan trainer backend (`trainer_backend='torchtitan'`, workbench/rl/titan_backend.py) on CPU: the RL update
on torchtitan's model, AdamW and LR-scheduler builders and clip_grad_norm_ equals the workbench's own bit for bit
(Qwen3 and Llama 3 layouts, fp32 masters and bf16 weights, with clipping and weight decay); the trainer with it on
the session's small arithmetic policy, parity 0 every step, the same run as the workbench trainer; FSDP2 through
torchtitan's recipe in 2 gloo processes against one process; the config errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import once_per_run, same_bits

pytest.importorskip("torchtitan")

TIMES = ("time_", "tokens_per_s", "sync_bytes")
"""Metrics that measure the run rather than the training (prefixes)."""


def _tiny(family: str):
    from workbench.models import ModelConfig

    qwen = family == "qwen3"
    return ModelConfig(model_type=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32,
                       qk_norm=qwen, tie_word_embeddings=qwen)


@pytest.mark.parametrize("family,master_dtype", [("qwen3", "float32"), ("llama", "float32"), ("qwen3", "bfloat16")])
def test_update_equals_the_workbench_trainer(family, master_dtype):
    """Two GRPO updates of 2 mini-batches each, clipped (norm 0.05 < the gradients') with weight decay: the masters
    and the generator's bf16 model are the workbench trainer's bits, and the titan model's log-probs (the parity
    check's trainer side) the generator model's, before each update."""
    from workbench.kernels import mode
    from workbench.models import build
    from workbench.rl.config import TrainConfig
    from workbench.rl.logprobs import score
    from workbench.rl.losses import get_loss
    from workbench.rl.rollout import RolloutBatch
    from workbench.rl.update import UpdateInputs, update
    from workbench.rl.weights import TrainWeights
    from workbench.rl.titan_backend import TitanWeights
    from workbench.titan.weights import from_titan

    mc = _tiny(family)
    # Both trainers on right-padded micro-batches (torchtitan's routed model has no packed form).
    cfg = TrainConfig(lr=1e-2, max_grad_norm=0.05, weight_decay=0.1, master_dtype=master_dtype, mini_batches=2,
                      group_size=2, prompts_per_step=2, max_new_tokens=4, trainer_backend="torchtitan",
                      packed_sequences=False)
    seed = 3
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mc.vocab_size, (4, 7), generator=g)
    mask = torch.ones(4, 4)
    mask[1, 2:] = 0
    batch = RolloutBatch(ids[:, :3].tolist(), ids[:, 3:].tolist(), torch.zeros_like(mask), mask, pad_id=0)
    dtype = torch.float32 if master_dtype == "float32" else torch.bfloat16
    ends, norms = {}, {}
    for backend in ("workbench", "torchtitan"):
        start = build(mc, dtype=dtype, seed=1)
        w = TitanWeights(start, cfg, "cpu") if backend == "torchtitan" else \
            TrainWeights(start, master_dtype, cfg.optim.lr, "cpu", cfg.optim.weight_decay, cfg.optim.max_grad_norm)
        norms[backend] = []
        with mode("invariant"):
            for step in (1, 2):
                old, _ = score(w.scorer, batch, 64, 1.0)
                assert same_bits(old, score(w.model, batch, 64, 1.0)[0]), f"seed {seed}, step {step}"
                adv = torch.randn(4, generator=torch.Generator().manual_seed(seed + step))
                out = update(cfg, get_loss("grpo"), w, batch, UpdateInputs(adv, old, None, None), step,
                             lambda loss: pytest.fail(f"loss {loss}"))
                norms[backend].append(out["grad_norm"])
        masters = {k: v.detach().clone() for k, v in w.masters.items()}
        ends[backend] = (from_titan(masters, mc) if backend == "torchtitan" else masters,
                         {k: v.clone() for k, v in w.model.state_dict().items()})
    assert min(norms["workbench"]) > 0.05, "the clipping must be active"
    assert norms["torchtitan"] == norms["workbench"]
    assert same_bits(ends["torchtitan"], ends["workbench"]), f"seed {seed}"


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_titan_weights_use_torchtitans_builders():
    """The optimizer and scheduler are torchtitan's containers around a fused torch AdamW with the workbench's
    settings, the lr factor stays 1.0 to the run's last step, and the one-process titan model computes on the
    generator's memory (no third copy of the weights)."""
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer

    from workbench.models import build
    from workbench.rl.config import TrainConfig
    from workbench.rl.titan_backend import TitanWeights

    cfg = TrainConfig(lr=3e-3, weight_decay=0.01, steps=2, mini_batches=2, group_size=2, prompts_per_step=2,
                      trainer_backend="torchtitan")
    w = TitanWeights(build(_tiny("qwen3"), dtype=torch.float32, seed=0), cfg, "cpu")
    assert isinstance(w.optimizers, OptimizersContainer) and isinstance(w.lr_schedulers, LRSchedulersContainer)
    group = w.opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["fused"]) == \
        (3e-3, (0.9, 0.999), 1e-8, 0.01, True)
    for _ in range(cfg.steps * cfg.optim.mini_batches):
        w.lr_schedulers.step()
        assert w.opt.param_groups[0]["lr"] == 3e-3
    assert w.titan.tok_embeddings.weight.data_ptr() == w.model.model.embed_tokens.weight.data_ptr()
    assert w.titan.output.weight is w.titan.tok_embeddings.weight
    assert all(m.dtype == torch.float32 for m in w.masters.values()) and "output.weight" not in w.masters


def _cfg(policy: str, out, **kw):
    from workbench.rl.config import TrainConfig

    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="invariant", checkpoint_every=2, lr=3e-3, progress=False, mini_batches=2,
                       max_grad_norm=1e-3, trainer_backend="torchtitan", packed_sequences=False)
    return dataclasses.replace(base, **kw)


def _masters(folder) -> dict[str, torch.Tensor]:
    """A one-process run's last checkpoint's masters, by the names its backend gives them (torchtitan: its own)."""
    from safetensors.torch import load_file

    from workbench.rl.checkpoint import latest_checkpoint

    last = latest_checkpoint(folder)
    return load_file(last / "masters.safetensors")


@pytest.fixture(scope="session")
def one_titan_run(policy, tmp_path_factory):
    """A call for the one-process torchtitan run of `_cfg` (its metrics table and final masters), which two tests
    compare against: run once for the whole pytest run (`once_per_run`), by the first test to call it (the FSDP2
    test calls it after its spawn, so a worker that started beside it rarely waits)."""
    from workbench.rl.trainer import train

    def run(folder):
        return train(_cfg(policy, folder / "run")), _masters(folder / "run")

    return lambda: once_per_run(tmp_path_factory, "one_titan_run", run)


@pytest.mark.slow
def test_trainer_with_torchtitan_is_the_workbench_run(policy, tmp_path, one_titan_run):
    """train() with trainer_backend='torchtitan' for 2 steps (2 clipped mini-batches each): 0 differing tokens every
    step, and every metric and the final masters the workbench trainer's, bit for bit; a resumed run the same."""
    from workbench.models import load_pretrained
    from workbench.rl.trainer import train
    from workbench.titan.weights import from_titan

    titan_table, titan_masters = one_titan_run()
    runs = {"workbench": train(_cfg(policy, tmp_path / "workbench", trainer_backend="workbench")),
            "torchtitan": titan_table}
    tables = {b: t.pivot(index="step", columns="metric", values="value") for b, t in runs.items()}
    titan, ref = tables["torchtitan"], tables["workbench"]
    assert list(titan.index) == [1, 2] and (titan["parity_tokens_differing"] == 0).all()
    # Step 1's gradient is clipped (its norm > 1e-3); step 2's groups tie (no gradient) and AdamW's momentum moves on.
    assert ref.loc[1, "grad_norm"] > 1e-3 and (titan["weight_delta_l2"] > 0).all()
    kept = [c for c in ref.columns if not c.startswith(TIMES)]
    assert sorted(kept) == sorted(c for c in titan.columns if not c.startswith(TIMES))
    import pandas as pd

    pd.testing.assert_frame_equal(titan[kept], ref[kept])
    mc = load_pretrained(policy).config
    assert same_bits(from_titan(titan_masters, mc), _masters(tmp_path / "workbench"))
    # Stopped after step 1 and resumed (the workbench's checkpoint, torchtitan's AdamW state; the LR scheduler's
    # factor is 1.0 at every step, so it restarts without changing a bit): the uninterrupted run's masters.
    train(_cfg(policy, tmp_path / "resumed", steps=1))
    train(_cfg(policy, tmp_path / "resumed", resume=True))
    assert same_bits(_masters(tmp_path / "resumed"), titan_masters)


def _sharded_forward_is_the_generators(weights) -> None:
    """The FSDP2 titan module's training forward gives the generator's bf16 model's log-probs bit for bit (the parity
    check scores with the latter under FSDP2; the update's ratio needs the former to match it)."""
    from workbench.kernels import mode
    from workbench.rl.logprobs import completion_logprobs
    from workbench.rl.rollout import RolloutBatch

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mb = RolloutBatch([[1, 5, 7, 9], [1, 4]], [[3, 8], [6, 2, 2]], torch.zeros(2, 3), mask, 0).micro_batches(None, 64)
    with mode("invariant"):
        weights.zero_grad()
        weights.before_backward(last=True)
        sharded, _ = completion_logprobs(weights.module, mb[0], 1.0)
        sharded.sum().backward()   # an FSDP2 forward is followed by its backward (the root reshards there)
        with torch.no_grad():
            plain, _ = completion_logprobs(weights.model, mb[0], 1.0)
    assert same_bits(sharded.detach(), plain)


def _fsdp_worker(policy: str, root: str) -> None:
    from pathlib import Path

    from workbench.distributed import launch
    from workbench.rl import trainer

    launch.init("cpu")
    runs, init = [], trainer.TrainerRank.__init__

    def keep(self, *args):
        init(self, *args)
        runs.append(self)

    trainer.TrainerRank.__init__ = keep
    for backend in ("torchtitan", "workbench"):
        trainer.train(_cfg(policy, Path(root) / backend, parallel="fsdp2", trainer_backend=backend))
    _sharded_forward_is_the_generators(runs[0].weights)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_through_torchtitans_recipe_matches_one_process(policy, tmp_path, one_titan_run):
    """2 gloo processes, FSDP2 by the backend's `shard` (torchtitan's per-block units, bf16 compute, fp32 reduce):
    parity 0 every step, the sharded titan forward the generator's bits; against the one-process torchtitan run, its
    masters up to the order of the 2-rank gradient sum (the fp32 reduce-scatter adds the ranks' sums; one process adds every micro-batch into one buffer); against the
    workbench's own FSDP2 run, up to the gradient norm's last bits (torchtitan's clip_grad_norm_ reduces each
    DTensor's norm over the ranks, the workbench sums each rank's squared total: 2.3347994 vs 2.3347993 at step 1)."""
    import pandas as pd

    from workbench.distributed import launch
    from workbench.distributed.checkpoint import load
    from workbench.models import build, load_pretrained
    from workbench.rl.checkpoint import latest_checkpoint
    from workbench.titan.model import build_titan_model
    from workbench.titan.weights import from_titan

    launch.spawn(_fsdp_worker, 2, policy, str(tmp_path))
    one, one_masters = one_titan_run()
    one = one.pivot(index="step", columns="metric", values="value")
    tables = {b: pd.read_csv(tmp_path / b / "metrics.csv").pivot(index="step", columns="metric", values="value")
              for b in ("torchtitan", "workbench")}
    two = tables["torchtitan"]
    assert (two["parity_tokens_differing"] == 0).all() and list(two.index) == [1, 2]
    assert (two["response_length"] == one["response_length"]).all()
    for m in ("loss", "grad_norm", "weight_delta_l2"):
        assert two[m].to_numpy() == pytest.approx(one[m].to_numpy(), rel=1e-5, abs=1e-6), m
        assert two[m].to_numpy() == pytest.approx(tables["workbench"][m].to_numpy(), rel=1e-6, abs=1e-7), m
    mc = load_pretrained(policy).config
    titan = build_titan_model(mc, "cpu", torch.float32, seed=None)
    load(latest_checkpoint(tmp_path / "torchtitan"), titan)
    titan = from_titan({k: v.detach() for k, v in titan.named_parameters()}, mc)
    own = build(mc, dtype=torch.float32, seed=None)
    load(latest_checkpoint(tmp_path / "workbench"), own)
    for ref in (from_titan(one_masters, mc), dict(own.named_parameters())):
        assert max(float((ref[k].detach() - titan[k]).abs().max()) for k in ref) < 1e-6


def _llama_gradients(group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """One backward of a tiny Llama's logits through TitanWeights (fp32 masters; FSDP2 over `group`, or one
    process): the masters' fp32 gradients, whole, by torchtitan's names."""
    from workbench.kernels import mode
    from workbench.models import build
    from workbench.rl.config import TrainConfig
    from workbench.rl.titan_backend import TitanWeights

    cfg = TrainConfig(trainer_backend="torchtitan", master_dtype="float32")
    w = TitanWeights(build(_tiny("llama"), dtype=torch.float32, seed=1), cfg, "cpu", group)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    w.zero_grad()
    w.before_backward(last=True)
    with mode("invariant"):
        w.module(ids).float().square().mean().backward()
    return {k: (p.grad.full_tensor() if group is not None else p.grad).clone() for k, p in w.masters.items()}


def _llama_fsdp_worker(out: str) -> None:
    from workbench.distributed import launch

    launch.init("cpu")
    grads = _llama_gradients(dist.group.WORLD)
    if dist.get_rank() == 0:
        torch.save(grads, out)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_llama_qk_gradients_reach_the_reduced_masters(tmp_path):
    """FSDP2 on 2 gloo ranks, both running the same micro-batch: every master's gradient is twice the one-process
    one, bit for bit (a + a is exact): Llama's q/k gradients, added from the gathered weights' buffers into the
    unsharded parameters' main_grads (FSDP2's accumulation buffers), are there before the reduce-scatter."""
    from workbench.distributed import launch

    launch.spawn(_llama_fsdp_worker, 2, str(tmp_path / "fsdp2.pt"))
    two, one = torch.load(tmp_path / "fsdp2.pt"), _llama_gradients()
    assert one.keys() == two.keys() and all(one[k].abs().sum() > 0 for k in one)
    for k in one:
        assert torch.equal(two[k], 2 * one[k]), k


def test_bench_runs_on_a_tiny_shape(monkeypatch):
    """bench/titan_update.py's measurement on the CPU (--tiny): both backends, positive rates, rank 0's table."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import titan_update

    from workbench.distributed.data_parallel import DataParallel

    results = titan_update.measure(titan_update.TINY, 8, 16, 64, "cpu", DataParallel.join("cpu"))
    assert sorted(results) == ["torchtitan", "workbench"] and all(r[0] > 0 for r in results.values())
    assert "| torchtitan / workbench |" in "\n".join(titan_update.table(results, "tiny", 8, 16, 64, 1))


def test_config_errors():
    from workbench.rl.config import TrainConfig

    with pytest.raises(ValueError, match=r"^trainer_backend must be 'workbench' or 'torchtitan', got 'foo'$"):
        TrainConfig(trainer_backend="foo")
    with pytest.raises(ValueError, match="trainer_backend='torchtitan' trains every weight .*adapter='lora'") as e:
        TrainConfig(trainer_backend="torchtitan", adapter="lora")
    assert "\n" not in str(e.value)


def test_unsupported_models_and_a_missing_torchtitan_are_one_line(monkeypatch):
    import sys

    from workbench.models import build
    from workbench.rl.config import TrainConfig
    from workbench.rl.titan_backend import TitanWeights

    cfg = TrainConfig(trainer_backend="torchtitan")
    qwen2 = dataclasses.replace(_tiny("qwen3"), model_type="qwen2", qk_norm=False, attention_bias=True)
    with pytest.raises(ValueError, match="torchtitan 0.2.2 has no model with q/k/v biases") as e:
        TitanWeights(build(qwen2, dtype=torch.float32, seed=0), cfg, "cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "torchtitan.components.optimizer", None)
    with pytest.raises(ImportError, match=r"trainer_backend='torchtitan' needs torchtitan .*pip install") as e:
        TitanWeights(build(_tiny("qwen3"), dtype=torch.float32, seed=0), cfg, "cpu")
    assert "\n" not in str(e.value)

