"""The vLLM backend's parts that need no vLLM: the weight layout, checksums, seeds, and the clear
error when vLLM is missing (the workbench itself imports without it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from workbench.__main__ import main
from workbench.generation.vllm_backend import (
    BackendUnavailable,
    VLLMGenerator,
    from_vllm_layout,
    request_seed,
    require_vllm,
    to_vllm_layout,
)
from workbench.models import build, weights_checksum


def test_layout_fuses_qkv_and_gate_up_and_round_trips():
    state = build("tiny", dtype=torch.bfloat16, seed=2).state_dict()
    fused = to_vllm_layout(state)
    cfg = build("tiny").config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = fused["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (q + 2 * kv, cfg.hidden_size)
    assert torch.equal(qkv[q : q + kv], state["model.layers.1.self_attn.k_proj.weight"])
    gate_up = fused["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[cfg.intermediate_size :], state["model.layers.0.mlp.up_proj.weight"])
    assert not any(k.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for k in fused)
    back = from_vllm_layout(fused, {k: tuple(v.shape) for k, v in state.items()})
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert weights_checksum(back) == weights_checksum(state)
    changed = dict(state)
    changed["model.norm.weight"] = state["model.norm.weight"].clone()
    changed["model.norm.weight"][0] += 1
    assert weights_checksum(changed) != weights_checksum(state)
    with pytest.raises(KeyError, match="missing beside"):
        to_vllm_layout({"a.q_proj.weight": torch.ones(1)})


def test_request_seeds_depend_on_the_request_only():
    assert request_seed(3, 7) == request_seed(3, 7) != request_seed(3, 8)
    assert 0 <= request_seed(10**9, 10**9) < 2**31


def test_missing_vllm_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, as where it is not installed
    with pytest.raises(BackendUnavailable, match=r"vLLM 0.26.0 pins torch 2.11.0"):
        require_vllm()
    assert main(["compare", "--backend", "vllm", "--prompt-ids", "1", "2", "--out-dir", str(tmp_path)]) == 2
    assert "the vllm backend needs vLLM" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint"):
        VLLMGenerator(tmp_path / "nowhere")


def test_the_workbench_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None; import workbench.__main__, workbench.rl.trainer, "
            "workbench.generation.vllm_backend, workbench.compare; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_compare_embedded_is_bitwise_in_invariant_mode(tmp_path, capsys):
    assert main(["compare", "--prompt-ids", "5", "9", "3", "--tokens", "4", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bitwise identical: True, different tokens 0 / 4" in out and out.count(" ok\n") == 4
    assert (tmp_path / "comparison.csv").exists()
    with pytest.raises(SystemExit):
        main(["compare", "--backend", "sglang"])
