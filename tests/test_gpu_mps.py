"""No run's bits depend on what shares its GPU (issue 59), on an H200 with the CUDA MPS tools (skipped without
them): each test starts an MPS daemon of its own (a private pipe directory, `onoff.mps`).

- A capped share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25: the process sees 32 SMs) is refused in invariant mode (with
  the tiles pinned to `matmul_tiles.PINNED_SMS` its bits still changed on an H200); the control: standard mode's
  bits follow the SM count (the Qwen3-1.7B shape, random weights).
- Two `on` runs at once under MPS: seed 0's metrics, step-1 log-probs and final weights are those of seed 0 alone.
- A runner call inside another's daemon joins it (one hold's parts of several lengths and losses share one daemon).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from workbench.onoff.mps import CONTROL, mps_daemon

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs {CONTROL}")]

_CHILD = """
import hashlib, json, sys
import torch
sys.path.insert(0, {tests!r})
from helpers import random_gpu_model
from workbench.generation import SamplingParams, generate
from workbench.generation.parity import random_prompts, trainer_logprobs
from workbench.kernels import mode

model = random_gpu_model().pack()
prompts = random_prompts(64, model.config.vocab_size, seed=0)
params = SamplingParams(max_new_tokens=48, seed=0)

def digest(kernels):
    with mode(kernels):
        out = generate(model, prompts, params)
        scored = trainer_logprobs(model, prompts, [c.tokens for c in out.completions])
    h = hashlib.sha256()
    for c, s in zip(out.completions, scored):
        for t in (torch.tensor(c.tokens), c.logprobs, s.cpu()):
            h.update(t.numpy().tobytes())
    return h.hexdigest()

result = {{"sms": torch.cuda.get_device_properties(0).multi_processor_count, "standard": digest("standard")}}
try:
    result["invariant"] = digest("invariant")
except RuntimeError as e:   # a capped share is refused (kernels.mode._check_whole_gpu)
    result["invariant"] = "refused: " + str(e)
print(json.dumps(result))
"""


def _child_command(extra_env: dict) -> tuple[list[str], dict]:
    """The child's command line and environment (this checkout on its path, `extra_env` added)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **extra_env, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return [sys.executable, "-c", _CHILD.format(tests=str(root / "tests"))], env


def _child(extra_env: dict) -> dict:
    command, env = _child_command(extra_env)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_gpu_a_capped_mps_share_is_refused_in_invariant_mode(tmp_path):
    """Invariant bits must not depend on what shares the GPU: a capped share (the process sees fewer SMs) is refused
    in one line. The control shows why: standard mode's bits follow the SMs the process sees."""
    with mps_daemon("on", tmp_path, "cuda", 2):
        full = _child({})
        capped = _child({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
    print(json.dumps({"full": full, "capped": capped}, indent=1))
    assert capped["sms"] < full["sms"], "the 25% share should show this process fewer SMs"
    assert not full["invariant"].startswith("refused"), full["invariant"]
    assert capped["invariant"].startswith("refused: invariant kernels need the whole GPU"), capped["invariant"]
    assert capped["standard"] != full["standard"], "the control: standard mode's cuBLAS should follow the SMs"


@pytest.mark.slow   # 31 s on an H200 (2026-12-03)
def test_gpu_a_second_call_joins_the_running_daemon(tmp_path):
    """Runner calls of one GPU hold (`scripts/device_onoff.sh STEP=parts`) share the daemon their caller started: the
    real daemon's pipe directory holds the control socket the join looks for, an inner call starts none, and a
    process started under it is a client of the outer daemon's server."""
    with mps_daemon("on", tmp_path / "outer", "cuda", 2):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert (Path(pipe) / "control").exists(), sorted(p.name for p in Path(pipe).iterdir())
        with mps_daemon("on", tmp_path / "inner", "cuda", 2) as on:
            assert on and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe
            assert not (tmp_path / "inner" / "mps-log").exists(), "the inner call started a daemon of its own"
            command, env = _child_command({})
            child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            servers = []
            while child.poll() is None and not servers:   # a server runs while its client does
                servers = subprocess.run([CONTROL], input="get_server_list\n", capture_output=True, text=True,
                                         timeout=60).stdout.split()
                time.sleep(0.5)
            _, err = child.communicate(timeout=400)
        assert child.returncode == 0, err[-3000:]
        assert servers, "no MPS server ran the client: it did not connect to the outer daemon"


_VOLATILE = ("time_", "tokens_per_s")


def _run_record(folder: Path) -> tuple[pd.DataFrame, dict, bytes]:
    """A run's metrics (no timings), its step-1 per-token log-probs and a digest of its last checkpoint's files."""
    from workbench.rl.checkpoint import latest_checkpoint

    metrics = pd.read_csv(folder / "metrics.csv")
    metrics = metrics[~metrics.metric.str.startswith(_VOLATILE)].sort_values(["step", "metric"])
    with np.load(folder / "step1_logprobs.npz") as z:
        step1 = {k: z[k].copy() for k in z.files}
    h = hashlib.sha256()
    last = latest_checkpoint(folder)
    for f in sorted(last.glob("*.safetensors")):   # masters, optimizer state (state.json names the folder)
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return metrics.reset_index(drop=True), step1, h.digest()


@pytest.mark.slow   # 41 s on an H200 (2026-12-02)
def test_gpu_two_runs_at_once_under_mps_keep_each_runs_bits(smollm2, tmp_path):
    from workbench.onoff.config import OnOffConfig
    from workbench.onoff.runner import run_on_off

    common = dict(policy=str(smollm2), arms=("on",), steps=3, task="arithmetic-chat", prompts_per_step=4, group_size=4,
                  max_new_tokens=64, lr=1e-5, max_grad_norm=1.0, device="cuda", progress=False, checkpoint_every=3)
    run_on_off(OnOffConfig(**common, seeds=(0, 1), workers=2, mps="on", out_dir=str(tmp_path / "shared")))
    run_on_off(OnOffConfig(**common, seeds=(0,), workers=1, out_dir=str(tmp_path / "alone")))
    shared, alone = _run_record(tmp_path / "shared/on-seed0"), _run_record(tmp_path / "alone/on-seed0")
    pd.testing.assert_frame_equal(shared[0], alone[0], check_exact=True)
    assert shared[1].keys() == alone[1].keys()
    for k in alone[1]:
        assert shared[1][k].tobytes() == alone[1][k].tobytes(), k
    assert shared[2] == alone[2], "the final weights differ"
    other = _run_record(tmp_path / "shared/on-seed1")
    assert not other[0].value.equals(alone[0].value), "the control: another seed's run differs"
    assert (tmp_path / "shared/mps-log").is_dir()
