"""GGUF -> Hugging Face folders: tiny random models written the way llama.cpp writes them, converted back.

`write_gguf` is an independent re-implementation of llama.cpp's converter for these three
families (names, the q/k permutation for llama, F32 norms, quantised matrices), so the
round trip checks `convert_gguf` against the format, not against itself.
"""

import hashlib
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from workbench.models.checkpoint import CheckpointError
from workbench.models.gguf import MARKER, convert_gguf

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
TOKENS = sorted(ByteLevel.alphabet()) + ["he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GGUF_NAMES = {  # HF suffix -> GGUF name, as llama.cpp's tensor map has them
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def tiny_model(arch: str, tie: bool = False, seed: int = 0):
    """2 layers, 4 heads / 2 kv heads, vocab 260, fp32; every parameter random (norms around 1)."""
    head_dim = {"qwen3": 32}.get(arch, 16)  # qwen3's head_dim differs from hidden / heads, as in Qwen3-0.6B
    cfg = CONFIGS[arch](vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=tie,
                        bos_token_id=258, eos_token_id=259)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    return model


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (rotate_half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{GGUF_NAMES[rest]}"


def write_gguf(path, model, arch: str, qtype=Q.F32, tokenizer: bool = True, drop=(), meta=None):
    """The model as llama.cpp writes it; returns {HF name: the float32 tensor the file holds (HF layout)}."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_license("apache-2.0")
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(TOKENS)
        w.add_token_types([1] * 257 + [3] * 3)
        w.add_token_merges(["h e"])
        w.add_bos_token_id(c.bos_token_id)
        w.add_eos_token_id(c.eos_token_id)
        w.add_chat_template(TEMPLATE)
    held = {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name, x = gguf_name(hf), t.numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if name.endswith("attn_q.weight") else c.num_key_value_heads
            x = llama_permute(x, heads)
        if name in drop:
            continue
        kind = qtype if x.ndim == 2 else Q.F32  # llama.cpp keeps norms and biases in F32
        data = gguf.quants.quantize(x, kind)
        w.add_tensor(name, data, raw_dtype=kind)
        back = gguf.quants.dequantize(data, kind)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            order = llama_permute(np.arange(x.shape[0]), heads)  # row i of the file is original row order[i]
            back = back[np.argsort(order)]
        held[hf] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_round_trip_is_bitwise_and_logits_match(tmp_path, arch):
    model = tiny_model(arch, tie=arch == "qwen3")
    write_gguf(tmp_path / "m.gguf", model, arch, tokenizer=False)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    tensors = load_file(out / "model.safetensors")
    original = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and arch == "qwen3")}
    assert tensors.keys() == original.keys()
    for name, t in original.items():
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [type(model).__name__] and cfg["head_dim"] == model.config.head_dim
    assert json.loads((out / MARKER).read_text())["tokenizer"].startswith("none")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("qtype,tol", [(Q.F16, 1e-3), (Q.BF16, 5e-3), (Q.Q8_0, 1e-2), (Q.Q4_0, 0.15),
                                       (Q.Q4_1, 0.1)], ids=lambda v: getattr(v, "name", str(v)))
def test_quantized_equals_ggufs_dequantize(tmp_path, qtype, tol):
    model = tiny_model("llama")
    held = write_gguf(tmp_path / "m.gguf", model, "llama", qtype=qtype, tokenizer=False)
    tensors = load_file(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf") / "model.safetensors")
    for name, t in model.state_dict().items():
        assert torch.equal(tensors[name], held[name]), name
        assert (tensors[name] - t).abs().max() <= tol * t.abs().max(), name
    record = json.loads((tmp_path / "hf" / MARKER).read_text())
    assert record["quantisation"][qtype.name] == 16 and record["licence"] == "apache-2.0"


def test_tokenizer_and_generation_config(tmp_path):
    model = tiny_model("llama", tie=True)
    write_gguf(tmp_path / "m.gguf", model, "llama", qtype=Q.Q8_0)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", {"licence": "MIT"})
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 259
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert ids[0] == 258 and tok.convert_tokens_to_ids("he") in ids
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 258, "eos_token_id": 259}
    record = json.loads((out / MARKER).read_text())
    assert record["licence"] == "MIT" and record["tokenizer"].startswith("built by transformers")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left behind


def test_linear_rope_scaling_converts_others_refused(tmp_path):
    model = tiny_model("qwen2")
    scaled = {"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 4.0}
    write_gguf(tmp_path / "lin.gguf", model, "qwen2", tokenizer=False, meta=scaled)
    cfg = json.loads((convert_gguf(tmp_path / "lin.gguf", tmp_path / "hf") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.rope_parameters["factor"] == 4.0
    write_gguf(tmp_path / "yarn.gguf", model, "qwen2", tokenizer=False, meta={"qwen2.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match="RoPE scaling 'yarn'.*not supported"):
        convert_gguf(tmp_path / "yarn.gguf", tmp_path / "hf2")


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match=r"g\.gguf: GGUF architecture 'gpt2' is not supported.*'llama'"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_model("qwen3"), "qwen3", tokenizer=False, drop={"blk.1.attn_k_norm.weight"})
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensors \['blk\.1\.attn_k_norm\.weight'\]"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")


def test_tensor_type_without_dequantisation(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "i.gguf"), "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for name, shape in [("attn_norm", (32,)), ("ffn_norm", (32,)), ("attn_q", (32, 32)), ("attn_k", (32, 32)),
                        ("attn_v", (32, 32)), ("attn_output", (32, 32)), ("ffn_gate", (64, 32)),
                        ("ffn_up", (64, 32)), ("ffn_down", (32, 64))]:
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="output_norm.weight has type I32, which gguf .* cannot dequantise"):
        convert_gguf(tmp_path / "i.gguf", tmp_path / "hf")


def test_truncated_file(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", tokenizer=False)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (len(data) - 100, 200, 0):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="t.gguf: not a readable GGUF file.*truncated"):
            convert_gguf(tmp_path / "t.gguf", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "t.gguf"]


def test_existing_folder_is_kept_or_replaced_as_asked(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, tiny_model("llama", seed=1), "llama", tokenizer=False)
    write_gguf(b, tiny_model("llama", seed=2), "llama", tokenizer=False)
    out = convert_gguf(a, tmp_path / "hf")
    assert convert_gguf(a, out, overwrite=False) == out  # the same file converted concurrently: kept
    with pytest.raises(CheckpointError, match="already exists and is not a conversion of this file"):
        convert_gguf(b, out, overwrite=False)
    convert_gguf(b, out)
    sha = json.loads((out / MARKER).read_text())["sha256"]
    assert sha == hashlib.sha256(b.read_bytes()).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["a.gguf", "b.gguf", "hf"]
