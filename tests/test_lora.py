"""LoRA adapters (CPU): the adapted projection's formula, gradients only into the adapters (checked against PEFT),
bitwise generator = trainer with nonzero adapters through the trainer's step, a LoRA GRPO run whose sync moves
only adapters and whose resume is bitwise, PEFT's file format both ways, the merge command, config errors."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import peft
import pytest
import torch
import transformers
from helpers import rel_err
from safetensors.torch import load_file

from workbench.__main__ import main
from workbench.kernels import linear, lora_add, mode
from workbench.kernels import matmul as matmul_module
from workbench.models import build, load_pretrained, save_pretrained
from workbench.models.lora import (
    PROJECTIONS,
    LoraConfig,
    adapter_flat,
    adapter_state,
    attach,
    copy_adapters,
    init_adapters,
)
from workbench.models.peft import load_adapter, read_adapter, save_adapter, to_peft_name
from workbench.models.transformer import Linear
from workbench.rl.checkpoint import latest_checkpoint
from workbench.rl.config import TrainConfig
from workbench.rl.sync import WeightSync
from workbench.rl.trainer import TrainerRank, train, train_step
from workbench.rl.weights import TrainWeights

LORA = LoraConfig(rank=4, alpha=8.0)


def _adapted(dtype=torch.float32, seed: int = 1, cfg: LoraConfig = LORA):
    """The tiny model with adapters of random A and random, nonzero B."""
    model = build("tiny", dtype=dtype, seed=seed)
    attach(model, cfg)
    g = torch.Generator().manual_seed(seed)
    copy_adapters({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in adapter_state(model).items()}, model)
    return model


def _ids(seed: int, batch: int = 2, seq: int = 5, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_adapted_projection_is_the_formula_and_batch_invariant():
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
    lin = lin.to(torch.bfloat16)
    lin.lora_A = torch.nn.Parameter((torch.randn(4, 64, generator=g) * 0.1).bfloat16())
    lin.lora_B = torch.nn.Parameter((torch.randn(48, 4, generator=g) * 0.1).bfloat16())
    lin.lora_scale = 2.0
    x = torch.randn(7, 64, generator=g).bfloat16()
    with mode("invariant"), torch.no_grad():
        y = lin(x)
        base, low = linear(x, lin.weight), linear(linear(x, lin.lora_A), lin.lora_B)
        assert torch.equal(y, lora_add(base, low, 2.0)), "the projection is base, low and their sum, nothing else"
        # fp32 multiply, fp32 add, one cast (the interpreter's cast truncates: within one bf16 ulp of RNE here;
        # bitwise on the GPU in test_gpu_lora.py)
        want = base.float() + low.float() * 2.0
        assert ((y.float() - want).abs() <= want.abs() * 2.0**-7).all()
        assert torch.equal(lin(x[2:5]), y[2:5]), "a row's bits do not depend on the batch"
    ref = x.double() @ lin.weight.double().t() + 2.0 * (x.double() @ lin.lora_A.double().t()) @ lin.lora_B.double().t()
    assert rel_err(y, ref) < 2e-2


def test_init_is_peft_default_and_zero_B_is_the_base():
    model = build("tiny", dtype=torch.float32, seed=0)
    ids = _ids(1)
    with mode("standard"):
        base = model(ids)
    attach(model, LORA)
    init = init_adapters(model, LORA, seed=3)
    assert set(init) == set(adapter_state(model)) and len(init) == 2 * 7 * model.config.num_hidden_layers
    for k, v in init.items():
        if k.endswith("lora_A"):  # Kaiming-uniform, a = sqrt(5): uniform(+-1/sqrt(in))
            assert v.abs().max() <= v.shape[1] ** -0.5 and v.std() > 0.5 * v.shape[1] ** -0.5 / 3 ** 0.5
        else:
            assert not v.any()
    copy_adapters(init, model)
    with mode("standard"):
        assert torch.equal(model(ids), base), "B = 0: the adapted model starts as the base"
    assert all(not p.requires_grad for k, p in model.named_parameters() if "lora_" not in k)


def _peft_model(base_dir, adapter_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)


def test_peft_loads_our_adapters_and_gradients_reach_only_them(tmp_path):
    model = build("tiny", dtype=torch.float32, seed=1)
    save_pretrained(model, tmp_path / "base")
    ours = _adapted()
    save_adapter(tmp_path / "adapter", LORA, adapter_state(ours), base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    assert to_peft_name("model.layers.1.mlp.down_proj.lora_B") in load_file(
        tmp_path / "adapter" / "adapter_model.safetensors")
    theirs = _peft_model(tmp_path / "base", tmp_path / "adapter")
    ids = _ids(2)
    upstream = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(3))
    with mode("standard"):
        (ours(ids) * upstream).sum().backward()
    ref = theirs(ids).logits
    (ref * upstream).sum().backward()
    with mode("standard"), torch.no_grad():
        assert rel_err(ours(ids), ref) < 1e-5
    peft_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if "lora_" in name:
            ref_grad = peft_params[to_peft_name(name).replace(".weight", ".default.weight")].grad
            assert p.grad is not None and rel_err(p.grad, ref_grad) < 1e-4, name
        else:
            assert p.grad is None, f"the frozen base got a gradient: {name}"


def test_frozen_base_runs_no_weight_gradient_products(monkeypatch):
    model = _adapted(torch.bfloat16, cfg=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj")))
    frozen = {tuple(p.shape) for k, p in model.named_parameters() if "lora_" not in k and p.dim() == 2}
    adapters = {tuple(p.shape) for k, p in model.named_parameters() if "lora_" in k}
    shapes = []
    real = matmul_module.matmul

    def recording(a, b, *args, **kw):
        shapes.append((a.shape[0], b.shape[1]))
        return real(a, b, *args, **kw)

    with mode("invariant"):
        loss = model(_ids(4, batch=1, seq=3)).float().sum()
        monkeypatch.setattr(matmul_module, "matmul", recording)
        loss.backward()
    assert shapes and not frozen & set(shapes), "a frozen weight's gradient product ran"
    assert adapters <= set(shapes), "every adapter's weight gradient is computed"


@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_optimizer_holds_and_moves_only_the_adapters(master_dtype):
    weights = TrainWeights(build("tiny", dtype=torch.float32, seed=2), master_dtype, 1e-2, "cpu", lora=LORA, seed=5)
    model = weights.model
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    before = {k: v.detach().clone() for k, v in adapter_state(model).items()}
    assert set(weights.masters) == set(before) and len(weights.params) == len(before)
    assert all(v.dtype == getattr(torch, master_dtype) for v in weights.masters.values())
    for _ in range(2):  # B = 0 at the start: A's gradient is zero until B has moved
        weights.zero_grad()
        with mode("standard"):
            model(_ids(7)).float().square().mean().backward()
        weights.step()
    assert len(weights.opt.state) == len(before), "AdamW state for the adapters only"
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if "lora_" not in k)
    assert all(not torch.equal(p, before[k]) for k, p in adapter_state(model).items()), "every adapter moved"


def _train_cfg(policy, out, **kw):
    base = TrainConfig(policy=policy, out_dir=str(out), steps=3, prompts_per_step=3, group_size=3, max_new_tokens=3,
                       kernel_mode="standard", checkpoint_every=1, lr=3e-2, adapter="lora", lora_rank=4,
                       sync="copy", progress=False)
    return dataclasses.replace(base, **kw)


def _adapter_bytes(run) -> int:
    return sum(p.numel() * 2 for p in adapter_state(run.weights.model).values())


@pytest.mark.slow
def test_invariant_trainer_step_is_bitwise_with_nonzero_adapters(policy, tmp_path):
    run = TrainerRank(_train_cfg(policy, tmp_path, kernel_mode="invariant", steps=1, prompts_per_step=2, group_size=2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, m in run.weights.masters.items():
            if k.endswith("lora_B"):
                m.copy_(torch.randn(m.shape, generator=g) * 0.05)
    run.weights.sync_model()
    run.sync(0)
    ids = _ids(5, vocab=run.weights.model.config.vocab_size)
    with mode("standard"):
        adapted = run.sync.generator(ids)
        copy_adapters({k: torch.zeros_like(v) for k, v in adapter_state(run.sync.generator).items()},
                      run.sync.generator)
        assert (run.sync.generator(ids) - adapted).abs().max() > 1e-2, "the adapters change the policy"
    run.sync(0)
    with mode("invariant"):
        train_step(run, 1)  # raises ParityError on a single differing bit
    value = run.log.close().set_index("metric")["value"]
    assert value["parity_tokens_differing"] == 0 and value["parity_max_abs_diff"] == 0
    assert value["sync_bytes"] == _adapter_bytes(run), "the sync moved the adapters only"


def test_lora_run_syncs_only_adapters_and_resumes_bitwise(policy, tmp_path):
    full = train(_train_cfg(policy, tmp_path / "a"))
    by = full.pivot(index="step", columns="metric", values="value")
    lora_bytes = 2 * 2 * sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (64, 192),
                                                      (192, 64)])
    assert (by["sync_bytes"] == lora_bytes).all(), "only the bf16 adapters move to the generator"
    assert by["weight_delta_l2"].sum() > 0 and not any(m.endswith("/embed") for m in by.columns)
    train(_train_cfg(policy, tmp_path / "b", steps=2))
    resumed = train(_train_cfg(policy, tmp_path / "b", resume=True))
    timing = full.metric.str.startswith("time_") | (full.metric == "tokens_per_s")
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True), resumed[~timing].reset_index(drop=True))
    ck_a, ck_b = latest_checkpoint(tmp_path / "a"), latest_checkpoint(tmp_path / "b")
    a, b = load_file(ck_a / "masters.safetensors"), load_file(ck_b / "masters.safetensors")
    assert all("lora_" in k for k in a) and all(torch.equal(a[k], b[k]) for k in a), "adapters only, bitwise"
    assert set(load_file(ck_a / "optimizer.safetensors")) and "base_checksum" in json.loads(
        (ck_a / "state.json").read_text())
    cfg, tensors = read_adapter(ck_a)  # the checkpoint is a PEFT folder of the bf16 adapters the policy ran
    assert cfg == LoraConfig(rank=4, alpha=32.0) and all(torch.equal(tensors[k], a[k].bfloat16()) for k in a)
    with pytest.raises(ValueError, match="differs from the checkpoint's in .*lora_rank"):
        train(_train_cfg(policy, tmp_path / "b", resume=True, steps=4, lora_rank=8))
    state = json.loads((ck_b / "state.json").read_text())
    (ck_b / "state.json").write_text(json.dumps({**state, "base_checksum": "another base"}))
    with pytest.raises(ValueError, match="frozen base differs"):
        train(_train_cfg(policy, tmp_path / "b", resume=True, steps=4))
    # Through disk (a PEFT folder; with a KL to the base as the reference) and with a one-step lag: the same
    # adapters-only sync, checked by checksum.
    disk = train(_train_cfg(policy, tmp_path / "disk", sync="checkpoint", steps=2, kl_coef=0.1))
    assert disk[(disk.metric == "kl") & (disk.step == 1)].value.item() == 0.0, "B = 0: the start is the base"
    assert (disk[disk.metric == "sync_bytes"].value == lora_bytes).all()
    assert sorted(f.name for f in (tmp_path / "disk" / "sync").iterdir()) == ["adapter_config.json",
                                                                             "adapter_model.safetensors"]
    lagged = train(_train_cfg(policy, tmp_path / "lag", policy_lag=1, steps=2)).pivot(
        index="step", columns="metric", values="value")
    assert list(lagged["policy_lag"]) == [0, 1]


def test_adapters_sync_as_one_flat_buffer_and_fall_back_when_moved(tmp_path):
    """The adapters are views of one buffer, so a copy sync is one copy and one comparison; where a model's
    adapters were replaced (no longer views), the per-tensor path syncs and checks them instead."""
    model = _adapted(torch.bfloat16, cfg=LoraConfig(rank=3, alpha=6.0))   # 3 x 64: padded views
    flat = adapter_flat(model)
    assert flat is not None and flat.numel() > sum(p.numel() for p in adapter_state(model).values())
    sync = WeightSync(TrainConfig(adapter="lora", lora_rank=3, lora_alpha=6.0, sync="copy"), model, tmp_path, "cpu")
    sync(1)
    assert torch.equal(adapter_flat(sync.generator), flat) and sync.moved_bytes == flat.nbytes
    assert all(torch.equal(v, adapter_state(sync.generator)[k]) for k, v in adapter_state(model).items())
    with torch.no_grad():
        flat.add_(1.0)          # the parameters are views: the model changed
    q = model.model.layers[0].self_attn.q_proj
    q.lora_A = torch.nn.Parameter(q.lora_A.detach().clone())    # no longer a view of the flat buffer
    assert adapter_flat(model) is None
    sync(2)
    assert all(torch.equal(v, adapter_state(sync.generator)[k]) for k, v in adapter_state(model).items())
    assert sync.moved_bytes == sum(p.nbytes for p in adapter_state(model).values())


def test_peft_written_adapters_load_and_merge(tmp_path):
    model = build("tiny", dtype=torch.float32, seed=1)
    save_pretrained(model, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=4, target_modules=targets,
                                                     init_lora_weights=False, task_type="CAUSAL_LM"))
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_pretrained(tmp_path / "base", dtype=torch.float32)
    assert load_adapter(tmp_path / "peft", ours) == LoraConfig(8, 4.0, tuple(targets))
    ids = _ids(6)
    with torch.no_grad(), mode("standard"):
        ref = theirs(ids).logits
        adapted = ours(ids)
        assert rel_err(adapted, ref) < 1e-5
        assert rel_err(adapted, model(ids)) > 1e-3, "PEFT's random B makes the adapters matter"
    assert main(["lora-merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "peft"),
                 "--out", str(tmp_path / "merged")]) == 0
    merged = load_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad(), mode("standard"):
        assert rel_err(merged(ids), adapted) < 1e-5
    # A bf16 base merges in fp32 and is written in bf16: within bf16 rounding of the adapted bf16 model.
    save_pretrained(build("tiny", dtype=torch.bfloat16, seed=1), tmp_path / "base16")
    assert main(["lora-merge", "--base", str(tmp_path / "base16"), "--adapter", str(tmp_path / "peft"),
                 "--out", str(tmp_path / "merged16")]) == 0
    merged16 = load_pretrained(tmp_path / "merged16", dtype=torch.float32)
    assert json.loads((tmp_path / "merged16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in load_file(tmp_path / "merged16" / "model.safetensors").values())
    with torch.no_grad(), mode("standard"):
        assert rel_err(merged16(ids), adapted) < 2e-2


def test_bad_lora_settings_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="adapter must be 'none'"):
        TrainConfig(adapter="qlora")
    with pytest.raises(ValueError, match="lora_rank must be a positive integer"):
        TrainConfig(adapter="lora", lora_rank=0)
    with pytest.raises(ValueError, match="lora_alpha must be"):
        TrainConfig(adapter="lora", lora_alpha=-1.0)
    with pytest.raises(ValueError, match="lora_targets must be .*q_proj"):
        TrainConfig(adapter="lora", lora_targets=("qkv",))
    with pytest.raises(ValueError, match="generator='vllm' is not supported.*generator='embedded'.*lora-merge"):
        TrainConfig(adapter="lora", generator="vllm", sync="copy")
    assert TrainConfig(adapter="lora").optim.lora_config() == LoraConfig(16, 32.0, PROJECTIONS)
    with pytest.raises(ValueError, match="LoRA adapters attached.*save_adapter"):
        save_pretrained(_adapted(), tmp_path / "x")
    save_adapter(tmp_path / "dora", LORA, adapter_state(_adapted()))
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        read_adapter(tmp_path / "dora")
    with pytest.raises(SystemExit):
        main(["lora-merge", "--base", str(tmp_path)])
    assert "lora-merge needs --adapter, --out" in capsys.readouterr().err


def test_adapter_gradient_split_over_tokens_is_the_product_and_deterministic():
    """The adapters' weight gradients ([r, tokens] @ [tokens, in] and [out, tokens] @ [tokens, r]) are cut over the
    tokens into fp32 partials: the same product as fp64, the same bits run to run, added to main_grad."""
    g = torch.Generator().manual_seed(11)
    for m, n in ((4, 72), (80, 4)):
        a = torch.randn(m, 300, generator=g).bfloat16()
        b = torch.randn(300, n, generator=g).bfloat16()
        start = torch.randn(m, n, generator=g)
        assert matmul_module.split_k_splits(m, n, 300) > 1
        got = [matmul_module.matmul_split_k(a, b, start.clone()) for _ in range(2)]
        assert torch.equal(got[0], got[1])
        ref = start.double() + a.double() @ b.double()
        assert rel_err(got[0], ref) < 1e-5
