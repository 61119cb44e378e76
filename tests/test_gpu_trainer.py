"""The trainer on a real GPU: zero differing tokens at every step in invariant mode (skipped without CUDA)."""

import pytest

from workbench.rl.trainer import TrainConfig, train

pytestmark = pytest.mark.gpu


def test_gpu_grpo_steps_hold_parity_and_resume(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path / "inv"), steps=4, prompts_per_step=8, group_size=4, max_new_tokens=3,
                      kernel_mode="invariant", checkpoint_every=2, device="cuda")
    table = train(cfg)
    parity = table[table.metric == "parity_tokens_differing"]
    assert len(parity) == 4 and (parity.value == 0).all()
    assert (table[table.metric == "ratio_mean"].value == 1.0).all()
    standard = train(TrainConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "std"), "kernel_mode": "standard",
                                    "policy": str(tmp_path / "inv" / "policy")}))
    assert (standard.metric == "parity_max_abs_diff").sum() == 4
