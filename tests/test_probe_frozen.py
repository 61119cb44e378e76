"""The frozen-policy probe (bench/probe_frozen.py) and the shares it reads (`losses._outside_band`): every loss logs
the tokens and sequences outside a 0.2 band around ratio 1; at lr = 0 `on` reads exactly 0 and the OFF arms do not."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from workbench.rl.losses import LOSSES, Totals

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_logs_the_band_shares(loss):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    b, t = 16, 12
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + torch.randn(b, t, generator=g) * 0.15
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]).float()
    adv = torch.randn(b, generator=g)
    spec = LOSSES[loss]
    cfg = dataclasses.replace(spec.defaults, norm=float(t))   # dr_grpo's constant; the others ignore it
    _, stats = spec.fn(logp, old, adv, mask, cfg, None, Totals.of(mask))
    r = torch.exp(logp - old)
    token = (((r < 0.8) | (r > 1.2)).float() * mask).sum() / mask.sum()
    seq_r = torch.exp(((logp - old) * mask).sum(1))
    seq = ((seq_r < 0.8) | (seq_r > 1.2)).float().mean()
    assert torch.allclose(stats["token_ratio_outside_0.2"], token), f"seed {seed}"
    assert torch.allclose(stats["seq_sum_ratio_outside_0.2"], seq), f"seed {seed}"
    assert 0 < float(token) < 1, f"seed {seed}: the draw should put some tokens on each side"
    _, same = spec.fn(old, old, adv, mask, cfg, None, Totals.of(mask))
    assert float(same["token_ratio_outside_0.2"]) == 0 == float(same["seq_sum_ratio_outside_0.2"])


def test_on_must_read_zero_check_catches_a_nonzero_cell():
    sys.path.insert(0, str(ROOT / "bench"))
    from probe_frozen import on_not_zero

    long = pd.DataFrame({"arm": ["on", "on", "off"], "length": [4, 4, 4], "loss": ["grpo"] * 3, "seed": [0] * 3,
                         "metric": ["sampler_trainer_kl", "is_ess", "sampler_trainer_kl"], "value": [0.0, 1.0, 0.2]})
    assert on_not_zero(long) == []
    long.loc[0, "value"] = 1e-9
    assert len(on_not_zero(long)) == 1


@pytest.mark.slow
def test_probe_frozen_smoke(tmp_path):
    """The script end to end on the CPU: `on` exactly 0 (its exit status), the OFF arms above it, both tables."""
    out = tmp_path / "frozen"
    done = subprocess.run([sys.executable, str(ROOT / "bench/probe_frozen.py"), "--smoke", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    long = pd.read_csv(out / "frozen.csv")
    assert set(long.arm) == {"on", "off", "off-fp8"} and set(long.loss) == {"grpo", "blog"}
    kl = long[long.metric == "sampler_trainer_kl"].groupby("arm").value.max()
    assert kl["on"] == 0 and kl["off"] > 0 and kl["off-fp8"] > 0, kl
    assert "token clip share" in (out / "frozen.md").read_text() and "length x KL" in done.stdout
