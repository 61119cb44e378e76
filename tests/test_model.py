"""The model (each family) against `transformers`, its checkpoints, and the training/prefill/decode triangle (CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from helpers import rel_err
from workbench.kernels import mode
from workbench.models import (
    SIZES,
    CheckpointError,
    KVCache,
    RopeScaling,
    build,
    config,
    config_to_hf,
    load_pretrained,
    merge_gate_up,
    save_pretrained,
    split_gate_up,
)
from workbench.models.decoding import DecodingModel
from workbench.titan.weights import hf_to_titan, titan_to_hf

TINY = SIZES["tiny"]
_LLAMA = dataclasses.replace(TINY, model_type="llama", qk_norm=False, rope_theta=10_000.0)
VARIANTS = {
    "qwen3-tied-gqa2": TINY,
    "qwen3-untied-gqa1": dataclasses.replace(TINY, tie_word_embeddings=False, num_key_value_heads=4),
    "qwen3-tied-gqa4": dataclasses.replace(TINY, num_key_value_heads=1, num_hidden_layers=3),
    "qwen2-bias": dataclasses.replace(TINY, model_type="qwen2", qk_norm=False, attention_bias=True),
    "llama-untied": dataclasses.replace(_LLAMA, tie_word_embeddings=False),
    # original_max_position_embeddings small enough that the scaling moves frequencies the test reaches.
    "llama3-rope-scaling": dataclasses.replace(_LLAMA, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
    "llama-linear-rope": dataclasses.replace(_LLAMA, rope_scaling=RopeScaling("linear", 2.0)),
    "mistral": dataclasses.replace(_LLAMA, model_type="mistral", tie_word_embeddings=False),
}


def _hf_model(cfg, seed: int, tmp_path) -> transformers.PreTrainedModel:
    """A random model of cfg's family made and saved by transformers itself."""
    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg, torch.float32))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    assert type(model).__name__ == hf_cfg.architectures[0]
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0; make them random too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape))
    model.save_pretrained(tmp_path / "hf")
    return model


def _ids(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_load_pretrained_matches_transformers_fp32(name, tmp_path):
    cfg = VARIANTS[name]
    hf = _hf_model(cfg, seed=1, tmp_path=tmp_path)
    ours = load_pretrained(tmp_path / "hf", dtype=torch.float32)
    for seq in (7, 13):
        ids = _ids(2, seq, cfg.vocab_size, seed=seq)
        with torch.no_grad():
            ref = hf(ids).logits
            assert rel_err(ours(ids), ref) < 1e-5
            with mode("standard"):
                assert rel_err(ours(ids), ref) < 1e-5


@pytest.mark.parametrize("name", ["qwen3-tied-gqa2", "qwen2-bias", "llama-untied"])
def test_bf16_logits_close_to_transformers(name, tmp_path):
    hf = _hf_model(VARIANTS[name], seed=2, tmp_path=tmp_path).to(torch.bfloat16)
    ours = load_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    ids = _ids(3, 11, TINY.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf(ids).logits
        with mode("standard"):
            assert rel_err(ours(ids), ref) < 2e-2
        assert rel_err(ours(ids), ref) < 4e-2  # the interpreter truncates every bf16 rounding


@pytest.mark.parametrize("name", ["qwen3-untied-gqa1", "qwen2-bias", "llama3-rope-scaling", "mistral"])
def test_transformers_loads_what_we_save(name, tmp_path):
    ours = build(VARIANTS[name], dtype=torch.float32, seed=4)
    save_pretrained(ours, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(hf).__name__ == config_to_hf(VARIANTS[name], torch.float32)["architectures"][0]
    ids = _ids(2, 9, TINY.vocab_size, seed=5)
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < 1e-5


def test_save_load_round_trip_is_bitwise(tmp_path):
    model = build("tiny", dtype=torch.bfloat16, seed=6)
    save_pretrained(model, tmp_path / "a")
    again = load_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    for (n1, a), (n2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_torchtitan_names_round_trip_bitwise():
    state = build(VARIANTS["qwen3-untied-gqa1"], seed=7).state_dict()
    titan = hf_to_titan(state)
    assert "layers.0.attention.wq.weight" in titan and "tok_embeddings.weight" in titan
    assert "layers.1.feed_forward.w3.weight" in titan and "output.weight" in titan
    back = titan_to_hf(titan)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="no torchtitan/HF name"):
        hf_to_titan({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(1)})


def test_merged_gate_up_round_trip():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    merged = merge_gate_up(gate, up)
    assert merged.shape == (12, 4)
    g2, u2 = split_gate_up(merged)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize("name", ["qwen3-tied-gqa2", "qwen2-bias"])
def test_model_gradients_match_fp64_transformers(name, tmp_path):
    hf = _hf_model(VARIANTS[name], seed=8, tmp_path=tmp_path).double()
    ours = load_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = _ids(2, 10, TINY.vocab_size, seed=9)
    g = torch.randn(2, 10, TINY.vocab_size, generator=torch.Generator().manual_seed(10))
    (ours(ids).double() * g).sum().backward()
    (hf(ids).logits * g.double()).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, hf_grads[name].grad) < 1e-4, name


def _prefill_then_decode(model, ids, lens, prefill: int, cache_len: int, poison: bool):
    """Logits of every real token through the generator's view of the model (`DecodingModel`): the first `prefill`
    tokens in one cached step, then one token per step."""
    b = ids.shape[0]
    decoding = DecodingModel(model)
    cache = KVCache.allocate(model.config, b, cache_len, "cpu", dtype=next(model.parameters()).dtype)
    if poison:  # stale memory must never leak in
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    out = torch.full((*ids.shape, model.config.vocab_size), float("nan"))
    start = torch.zeros(b, dtype=torch.int32)
    first = torch.clamp(lens, max=prefill).to(torch.int32)
    out[:, :prefill] = decoding(ids[:, :prefill], first, cache, start).float()
    for t in range(prefill, ids.shape[1]):
        step = decoding(ids[:, t:t + 1], torch.ones(b, dtype=torch.int32), cache,
                        torch.full((b,), t, dtype=torch.int32))
        out[:, t] = step[:, 0].float()
    return out


def test_training_prefill_and_decode_logits_are_bitwise_equal():
    """A token's logits: training forward over a padded batch == prefill == decode step, and alone == in a batch."""
    model = build("tiny", dtype=torch.bfloat16, seed=11)
    lens = torch.tensor([13, 6, 10], dtype=torch.int32)
    ids = _ids(3, 13, TINY.vocab_size, seed=12)
    with torch.no_grad():
        train = model(ids, seq_lens=lens).float()
        cached = _prefill_then_decode(model, ids, lens, prefill=5, cache_len=32, poison=True)
        alone = model(ids[1:2, :6]).float()
    for b in range(3):
        n = int(lens[b])
        assert torch.equal(cached[b, :n], train[b, :n]), f"sequence {b}: decode differs from training"
    assert torch.equal(alone[0], train[1, :6]), "a sequence alone differs from the same in a padded batch"


@pytest.mark.parametrize("name", ["qwen3-tied-gqa2", "qwen2-bias", "llama-untied"])
def test_packed_products_are_the_bits_of_separate_ones(name):
    """The generator's view of the model (`DecodingModel`) runs q/k/v as one product over the packed weights,
    and gate/up as another (with the fused norm/rope/cache write): the same logits, bitwise, as the separate
    products of the model's own forward against a cache, whose real tokens are the training forward's; a model
    moved by .to() holds them apart again and its view runs them one by one."""
    model = build(VARIANTS[name], dtype=torch.bfloat16, seed=13)
    assert all(layer.self_attn.packed() is not None for layer in model.model.layers)
    assert all(layer.mlp.packed() is not None for layer in model.model.layers)
    ids = _ids(3, 9, TINY.vocab_size, seed=14)
    lens = torch.tensor([9, 4, 7], dtype=torch.int32)
    zero = torch.zeros(3, dtype=torch.int32)

    def cache(m):
        return KVCache.allocate(m.config, 3, 9, "cpu", dtype=m.lm_head_weight.dtype)

    with mode("invariant"):
        with torch.no_grad():
            packed = DecodingModel(model)(ids, lens, cache(model), zero)
            separate = model(ids, seq_lens=lens, cache=cache(model), start=zero)
        train = model(ids, seq_lens=lens).detach()
    assert torch.equal(packed, separate)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(packed[b, :n], train[b, :n]), f"sequence {b}"
    moved = model.to(torch.float32)
    assert all(layer.self_attn.packed() is None for layer in moved.model.layers)
    assert all(layer.mlp.packed() is None for layer in moved.model.layers)
    with mode("invariant"), torch.no_grad():
        got = DecodingModel(moved)(ids, lens, cache(moved), zero)
        torch.testing.assert_close(got, separate.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("shape", ["smollm2-135M", "qwen2-0.5B"])
def test_real_shapes_training_prefill_and_decode_are_bitwise_equal(shape):
    """One layer with SmolLM2-135M's heads (head_dim 64, 9 over 3) and Qwen2-0.5B's (q/k/v biases, 14 over 2),
    narrow residual and MLP widths and a small vocabulary (the interpreter's time goes with the widths): a
    token's logits are the same bits in training, prefill and decode. The GPU test runs the full widths."""
    cfg = dataclasses.replace(config(shape), num_hidden_layers=1, vocab_size=384, hidden_size=128,
                              intermediate_size=128)
    model = build(cfg, dtype=torch.bfloat16, seed=21)
    lens = torch.tensor([7, 3], dtype=torch.int32)
    ids = _ids(2, 7, cfg.vocab_size, seed=22)
    with torch.no_grad():
        train = model(ids, seq_lens=lens).float()
        cached = _prefill_then_decode(model, ids, lens, prefill=4, cache_len=8, poison=True)
    for b in range(2):
        assert torch.equal(cached[b, : lens[b]], train[b, : lens[b]]), f"sequence {b}"


def test_standard_mode_runs_the_same_paths():
    model = build("tiny", dtype=torch.float32, seed=13)
    lens = torch.tensor([9, 4], dtype=torch.int32)
    ids = _ids(2, 9, TINY.vocab_size, seed=14)
    with torch.no_grad(), mode("standard"):
        train = model(ids, seq_lens=lens)
        cached = _prefill_then_decode(model, ids, lens, prefill=3, cache_len=16, poison=False)
    for b in range(2):
        n = int(lens[b])
        assert rel_err(cached[b, :n], train[b, :n]) < 1e-5


def _write_checkpoint(tmp_path, cfg=TINY):
    d = tmp_path / "ckpt"
    save_pretrained(build(cfg, dtype=torch.float32, seed=15), d)
    return d


def test_bad_checkpoints_say_what_is_wrong(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_pretrained(tmp_path / "nowhere")
    d = _write_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is a file"):
        load_pretrained(d / "config.json")
    cfg = json.loads((d / "config.json").read_text())

    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="reads the model types qwen3, qwen2, llama, mistral"):
        load_pretrained(d)
    for change, error in [({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn' is not"),
                          ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 RoPE scaling lacks"),
                          ({"use_sliding_window": True}, "sliding-window attention"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                          ({"attention_bias": True}, "attention_bias=True"),
                          ({"num_key_value_heads": 3}, "must be a multiple")]:
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=error):
            load_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="missing qwen3 fields"):
        load_pretrained(d)
    (d / "config.json").write_text(json.dumps(cfg))

    tensors = load_file(d / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(missing, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing.*up_proj"):
        load_pretrained(d)
    bad_shape = dict(tensors, **{"model.norm.weight": torch.ones(65)})
    save_file(bad_shape, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.norm.weight: the model has shape \(64,\)"):
        load_pretrained(d)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_pretrained(d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="never .bin / pickle"):
        load_pretrained(d)


def test_configs():
    assert config("qwen3-1.7B").hidden_size == 2048 and config("qwen3-1.7B").tie_word_embeddings
    assert config("qwen3-8B").num_attention_heads == 32 and not config("qwen3-8B").tie_word_embeddings
    assert config("smollm2-135M").model_type == "llama" and config("qwen2-0.5B").attention_bias
    with pytest.raises(ValueError, match="unknown model shape"):
        config("2B")
    with pytest.raises(ValueError, match="must be a multiple"):
        dataclasses.replace(TINY, num_key_value_heads=3)
    with pytest.raises(ValueError, match="must be positive"):
        dataclasses.replace(TINY, hidden_size=0)


def test_sharded_checkpoint_from_transformers(tmp_path):
    torch.manual_seed(16)
    hf = _hf_model(TINY, seed=16, tmp_path=tmp_path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "sharded", dtype=torch.float32)
    ids = _ids(1, 8, TINY.vocab_size, seed=17)
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < 1e-5
    (tmp_path / "sharded" / sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))[0]).unlink()
    with pytest.raises(CheckpointError, match="listed in the index is missing"):
        load_pretrained(tmp_path / "sharded")


def test_tokenizer_travels_with_the_checkpoint(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from workbench.models import load_tokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["12 + 34 = 46", "7 * 8 = 56", "the answer is 42"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    save_pretrained(build("tiny", seed=18), tmp_path / "ckpt", tokenizer=fast)
    again = load_tokenizer(tmp_path / "ckpt")
    assert again("12 + 34 = 46")["input_ids"] == fast("12 + 34 = 46")["input_ids"]
    with pytest.raises(CheckpointError, match="no tokenizer could be loaded"):
        load_tokenizer(tmp_path / "elsewhere")


def test_a_hub_id_is_not_a_folder():
    with pytest.raises(CheckpointError, match="fetch-model NAME"):
        load_pretrained("Qwen/Qwen3-0.6B")


def test_one_cast_path_rounds_to_nearest_even():
    from workbench.bf16 import round_to_bf16
    from workbench.models import copy_weights

    model = build("tiny", dtype=torch.bfloat16, seed=None)
    masters = {k: torch.randn(v.shape) * 3 for k, v in model.state_dict().items()}
    copy_weights(masters, model)
    for name, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), round_to_bf16(masters[name]).view(torch.int16)), name
    with pytest.raises(KeyError, match="missing"):
        copy_weights({k: v for k, v in masters.items() if "norm" not in k}, model)


def test_start_positions_need_a_cache():
    model = build("tiny", seed=19)
    with pytest.raises(ValueError, match="need a KV cache"):
        model(_ids(1, 3, TINY.vocab_size, seed=20), start=torch.tensor([2]))


def test_paged_steps_give_the_training_forward_bits_and_its_logprobs():
    """vLLM's way of running a model (`vllm_model.py`), without vLLM: flattened steps mixing a prefill, a
    chunked prefill and decodes over shuffled pages give each token the training forward's hidden
    state, and `logprob_rows` of its logits the trainer's `token_logprobs`, bit for bit."""
    from helpers import PagedSim
    from workbench.kernels import linear, logprob_rows, token_logprobs

    model = build("tiny", seed=3)
    decoding = DecodingModel(model)   # vLLM's model runs its paged steps through this view
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (15, 12, 9)]
    sim = PagedSim(cfg.num_hidden_layers, 32, 8, cfg.num_key_value_heads, cfg.head_dim, seed=1)
    schedule = [[(0, (0, 11)), (1, (0, 4))],                      # a prefill and the first chunk of another
                [(1, (4, 7)), (2, (0, 4)), (0, (11, 12))],        # the chunk's rest, a prefill, a decode
                *[[(s, (n, n + 1)) for s, n in ((0, 12 + i), (1, 7 + i), (2, 4 + i))] for i in range(3)]]
    rows = {}
    with torch.no_grad():
        for step in schedule:
            ids, pos, cache = sim.step([(s, seqs[s][a:b]) for s, (a, b) in step])
            hidden = decoding.hidden_states_paged(ids, pos, cache)
            for (s, (a, b)), h in zip(step, torch.split(hidden, [b - a for _, (a, b) in step])):
                for i in range(b - a):
                    rows[(s, a + i)] = h[i]
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        ids = torch.zeros((3, 15), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        train = model.hidden_states(ids, seq_lens=lens)
        for (s, p), h in rows.items():
            assert torch.equal(h, train[s, p]), f"sequence {s}, position {p}"
        keys = sorted(rows)
        paged_logits = linear(torch.stack([rows[k] for k in keys]), model.lm_head_weight)
        rolled = torch.roll(ids, -1, 1)
        targets = torch.stack([rolled[s, p] for s, p in keys])
        for t in (1.0, 0.7):
            got = logprob_rows(paged_logits, t).gather(1, targets[:, None])[:, 0]
            want = token_logprobs(linear(train, model.lm_head_weight), rolled, t)
            assert torch.equal(got, torch.stack([want[s, p] for s, p in keys]))
    with mode("standard"):
        logits = torch.randn(3, 50, generator=g)
        assert torch.allclose(logprob_rows(logits), torch.log_softmax(logits, -1))


def test_weights_equal_compares_bits_in_groups():
    """Bitwise (a -0.0 for a 0.0 differs, a NaN equals its copy), whatever the grouping of the concatenations."""
    from workbench.models import weights_equal

    g = torch.Generator().manual_seed(0)
    a = {f"w{i}": torch.randn(3, 5, generator=g).to(dt) for i, dt in enumerate([torch.bfloat16] * 3 + [torch.float32])}
    a["nan"] = torch.tensor([float("nan"), 0.0])
    for group_bytes in (1, 40, 2**20):
        b = {k: v.clone() for k, v in a.items()}
        assert weights_equal(a, b, group_bytes)
        b["nan"][1] = -0.0
        assert not weights_equal(a, b, group_bytes)
        b = {k: v.clone() for k, v in a.items()}
        b["w1"].view(torch.int16)[2, 4] ^= 1  # the last bit of one bf16
        assert not weights_equal(a, b, group_bytes)
        assert not weights_equal(a, {**b, "w1": b["w1"].float()}, group_bytes)
        assert not weights_equal(a, {k: v for k, v in b.items() if k != "w0"}, group_bytes)
