"""The vLLM backend's parts that need no vLLM: the weight layout, checksums, seeds, the clear error
when vLLM is missing (the workbench itself imports without it), and the workbench model's vLLM glue
run against fakes of what vLLM hands a model (cache layout, attention metadata, weights)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import subprocess
import sys
import time

import pytest
import torch

from workbench.__main__ import main
from workbench.generation.vllm_backend import (
    BackendUnavailable,
    VLLMGenerator,
    from_vllm_layout,
    one_start_at_a_time,
    request_seed,
    require_vllm,
    to_vllm_layout,
)
from workbench.models import build, weights_checksum


def _hold_the_start_lock(path, spans):
    with one_start_at_a_time(path):
        begin = time.monotonic()
        time.sleep(0.3)
        spans.append((begin, time.monotonic()))


def test_engine_starts_on_one_host_take_turns(tmp_path):
    """Two processes starting engines at once: the second profiles only after the first has finished (vLLM
    would otherwise count the first's KV cache as its own use and find no memory for its cache)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        spans = manager.list()
        procs = [ctx.Process(target=_hold_the_start_lock, args=(tmp_path / "start.lock", spans)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        spans = sorted(spans)
    assert [p.exitcode for p in procs] == [0, 0] and len(spans) == 2
    (_, first_end), (second_begin, _) = spans
    assert first_end <= second_begin, "the two starts overlapped"


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
    qwen2 = build(dataclasses.replace(cfg, model_type="qwen2", qk_norm=False, attention_bias=True)).state_dict()
    fused2 = to_vllm_layout(qwen2)
    assert fused2["model.layers.0.self_attn.qkv_proj.bias"].shape == (q + 2 * kv,)
    back2 = from_vllm_layout(fused2, {k: tuple(v.shape) for k, v in qwen2.items()})
    assert weights_checksum(back2) == weights_checksum(qwen2)
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
            "workbench.generation.vllm_backend, workbench.teach.compare; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_compare_embedded_is_bitwise_in_invariant_mode(tmp_path, capsys):
    assert main(["compare", "--prompt-ids", "5", "9", "3", "--tokens", "4", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bitwise identical: True, different tokens 0 / 4" in out and out.count(" ok\n") == 4
    assert (tmp_path / "comparison.csv").exists()
    with pytest.raises(SystemExit):
        main(["compare", "--backend", "sglang"])


class _FakeAttention(torch.nn.Module):
    """Stands in for vLLM's Attention layer: holds the layer's KV cache, as vLLM binds it."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, cache_config, prefix):
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.prefix = prefix


def _fake_vllm(monkeypatch, ctx: dict) -> None:
    import types

    names = ["vllm", "vllm.forward_context", "vllm.model_executor", "vllm.model_executor.layers",
             "vllm.model_executor.layers.attention"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["vllm.forward_context"].get_forward_context = lambda: ctx["now"]
    mods["vllm.model_executor.layers.attention"].Attention = _FakeAttention
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def test_workbench_model_in_a_fake_vllm_gives_the_trainer_bits(monkeypatch):
    """The vLLM glue of `vllm_model.py` on CPU, vLLM replaced by fakes of what it hands the model:
    FlashAttention's cache layout and metadata, a profiling run without metadata, weight loading."""
    from types import SimpleNamespace

    from helpers import PagedSim
    from workbench.generation.vllm_model import WorkbenchCausalLM
    from workbench.kernels import linear, token_logprobs
    from workbench.models.checkpoint import config_to_hf

    ctx = {}
    _fake_vllm(monkeypatch, ctx)
    trainer = build("tiny", dtype=torch.bfloat16, seed=5)
    cfg = trainer.config
    hf = config_to_hf(cfg, torch.bfloat16)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: hf)),
                                  cache_config=None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)             # as vLLM builds a model: in its dtype, then loads weights
    try:
        model = WorkbenchCausalLM(vllm_config=vllm_config)
    finally:
        torch.set_default_dtype(default)
    assert model.load_weights(trainer.state_dict().items()) == set(dict(model.named_parameters()))
    assert all(layer.self_attn.packed() is not None and layer.mlp.packed() is not None
               for layer in model.model.layers), "the loaded weights sit in the packed buffers"
    with pytest.raises(KeyError, match="does not"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.ones(1))])
    # FlashAttention's layout: logical (pages, Hkv, page, 2D), stored page-major as (pages, page, Hkv, 2D).
    for layer in model.model.layers:
        store = torch.full((24, 16, cfg.num_key_value_heads, 2 * cfg.head_dim), float("nan"), dtype=torch.bfloat16)
        layer.self_attn.attn.kv_cache = store.permute(0, 2, 1, 3)
    ctx["now"] = SimpleNamespace(attn_metadata=None, slot_mapping={})
    assert model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])).shape == (3, cfg.hidden_size)  # profiling

    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (20, 9)]
    sim = PagedSim(1, 24, 16, cfg.num_key_value_heads, cfg.head_dim, seed=2)
    rows = {}
    with torch.no_grad():
        for step in ([(0, (0, 12)), (1, (0, 9))], [(0, (12, 19))], [(0, (19, 20))]):
            ids, pos, cache = sim.step([(s, seqs[s][a:b]) for s, (a, b) in step])
            meta = SimpleNamespace(query_start_loc=cache.cu_q, seq_lens=cache.kv_len, block_table=cache.block_table,
                                   slot_mapping=cache.slots, max_query_len=cache.max_q)
            ctx["now"] = SimpleNamespace(attn_metadata={n: meta for n in model.layer_names},
                                         slot_mapping={n: cache.slots for n in model.layer_names})
            hidden = model(ids, pos)
            last = cache.cu_q[1:].long() - 1
            lp_rows = model.compute_logits(hidden[last])
            for i, (s, (a, b)) in enumerate(step):
                rows[(s, b - 1)] = (hidden[last[i]], lp_rows[i])
        lens = torch.tensor([20, 9], dtype=torch.int32)
        ids = torch.zeros((2, 20), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        hidden = trainer.hidden_states(ids, seq_lens=lens)
        logits = linear(hidden, trainer.lm_head_weight)
        for (s, p), (h, lp) in rows.items():
            assert torch.equal(h, hidden[s, p]), f"sequence {s}, position {p}"
            tok = torch.tensor([int(lp.argmax())])
            assert torch.equal(lp[tok], token_logprobs(logits[s, p][None], tok))
        model.sampling_temperature = 0.7  # VLLMGenerator sets it per call: rows of the tempered distribution
        tempered = model.compute_logits(hidden[0, :5])
        tok = torch.arange(5) * 7
        assert torch.equal(tempered[torch.arange(5), tok], token_logprobs(logits[0, :5], tok, 0.7))


def test_workbench_model_runs_decode_steps_in_full_cuda_graphs_unless_eager_or_standard(monkeypatch, tmp_path):
    """The engine options VLLMGenerator hands vLLM: the workbench model's decode steps as full CUDA graphs with no
    torch.compile, eager when asked or in standard mode (its paged attention reads lengths on the host)."""
    import types

    import workbench.generation.vllm_backend as backend

    built = []
    fake = types.SimpleNamespace(LLM=lambda **kw: built.append(kw),
                                 ModelRegistry=types.SimpleNamespace(register_model=lambda *a: None))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(backend, "require_vllm", lambda: None)
    for name in ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.setenv(name, "")  # VLLMGenerator sets them; restored after the test
    (tmp_path / "config.json").write_text("{}")
    for kwargs in ({}, {"enforce_eager": True}, {"kernel_mode": "standard"}):
        VLLMGenerator(tmp_path, **kwargs)
    graphs, *eager = built
    assert graphs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert graphs["enforce_eager"] is False and graphs["attention_config"] == {"backend": "FLASH_ATTN"}
    assert all(kw["block_size"] == 64 for kw in built)  # a page per decode attention K/V tile
    assert all(kw["enforce_eager"] and "compilation_config" not in kw for kw in eager)
