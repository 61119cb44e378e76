"""GGUF files (llama.cpp's format) -> Hugging Face model folders that `transformers` loads.

The ggml project's own reader (`gguf.GGUFReader`, `gguf.quants.dequantize`) does the
reading; this module only maps names, undoes llama.cpp's q/k permutation and writes the
folder. Numerics: every GGUF tensor type is dequantised to float32 (a Q4_1 or Q8_0 block
is `scale * q (+ min)` computed in float32, F16/BF16 widen exactly), so the float32
safetensors hold exactly the values llama.cpp computes with; nothing is re-rounded.
Folders are written beside the target and renamed into place: a crash leaves no half folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .checkpoint import CheckpointError, config_to_hf
from .config import ModelConfig

# GGUF architectures that convert (each is the transformers model_type of the same name); llama.cpp
# permutes q/k only for those in _PERMUTED.
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_PERMUTED = {"llama"}
MARKER = "workbench_source.json"
"""Written last into a converted folder: its presence means the folder is complete."""

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED = object()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                              "it may be truncated or not a GGUF: download it again") from None


def _field(reader, key: str, where: Path, default=_REQUIRED):
    if key not in reader.fields:
        if default is _REQUIRED:
            raise CheckpointError(f"{where}: GGUF metadata has no {key!r}, which the conversion needs")
        return default
    return reader.fields[key].contents()


def _f32(x: float) -> float:
    """GGUF stores eps and rope theta as float32; the shortest decimal that is the same float32 (1e-05, not
    9.99999974737875e-06) reads better and rounds to the identical float32 wherever it is used."""
    return float(str(np.float32(x)))


def _rope_scaling(reader, arch: str, where: Path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", where, "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor", where, None)
    legacy = _field(reader, f"{arch}.rope.scale_linear", where, None)  # older files spell linear scaling so
    if kind == "none" and legacy not in (None, 1.0):
        kind, factor = "linear", legacy
    if kind == "none":
        return None
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise CheckpointError(f"{where}: RoPE scaling {kind!r} (factor {factor}) is not supported; "
                          "only none or linear scaling converts")


def hf_config(reader, where: Path) -> dict:
    """config.json for the file's architecture, in the layout transformers 4.x and 5.x both read (rope_theta and
    rope_scaling at the top level)."""
    arch = _field(reader, "general.architecture", where)
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: GGUF architecture {arch!r} is not supported; "
                              f"workbench converts {sorted(ARCHITECTURES)} (dense decoder-only models)")
    if _field(reader, f"{arch}.expert_count", where, 0):
        raise CheckpointError(f"{where}: a mixture-of-experts {arch} model; only dense models convert")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{where}: no token_embd.weight tensor; the file is incomplete")
    hidden = int(_field(reader, f"{arch}.embedding_length", where))
    heads = _field(reader, f"{arch}.attention.head_count", where)
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", where, heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise CheckpointError(f"{where}: per-layer head counts ({heads}, {kv_heads}) are not supported")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", where, hidden // heads))
    rotary = _field(reader, f"{arch}.rope.dimension_count", where, head_dim)
    if rotary != head_dim:
        raise CheckpointError(f"{where}: RoPE on {rotary} of {head_dim} head dimensions (partial rotary) "
                              "is not supported")
    tok = {k: _field(reader, f"tokenizer.ggml.{k}_token_id", where, None) for k in ("bos", "eos", "padding")}
    try:
        model = ModelConfig(
            model_type=arch,
            vocab_size=int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]),
            hidden_size=hidden,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", where)),
            num_hidden_layers=int(_field(reader, f"{arch}.block_count", where)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", where)),
            rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", where, 10000.0)),  # llama.cpp's default
            rope_scaling=_rope_scaling(reader, arch, where),
            qk_norm=arch == "qwen3",
            attention_bias=arch == "qwen2",
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", where)),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    # The family's config.json, written by the one function that writes them (`config_to_hf`).
    cfg = config_to_hf(model, torch.float32)
    cfg |= {"bos_token_id": tok["bos"], "eos_token_id": tok["eos"], "pad_token_id": tok["padding"]}
    return cfg


def _expected_shapes(arch: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, by GGUF name, with its torch shape (GGUF lists dims reversed)."""
    h, i, d, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (v, h)
    layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
             "attn_output.weight": (h, q), "ffn_norm.weight": (h,), "ffn_gate.weight": (i, h),
             "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)}
    if arch == "qwen2":
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch == "qwen3":
        layer |= {"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)}
    for n in range(cfg["num_hidden_layers"]):
        shapes |= {f"blk.{n}.{k}": s for k, s in layer.items()}
    return shapes


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: it interleaves each head's two rotary halves (HF rotate_half layout) into
    pairs; reshaping to (head, pair, 2) and swapping back restores the halves. A pure reindexing, exact."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, cfg: dict, where: Path) -> dict[str, torch.Tensor]:
    """All tensors dequantised to float32 under Hugging Face names, checked against the config's shapes."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture", where)
    expected = _expected_shapes(arch, cfg)
    present = {t.name: t for t in reader.tensors}
    missing = [n for n in expected if n not in present]
    if missing:
        raise CheckpointError(f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} in all) for a {cfg['num_hidden_layers']}-layer {arch} model")
    extra = sorted(set(present) - set(expected))
    if extra:
        hint = " (llama3-style RoPE frequency scaling is not supported)" if "rope_freqs.weight" in extra else ""
        raise CheckpointError(f"{where}: tensors {extra[:5]} have no place in a plain {arch} model{hint}")
    out = {}
    for name, shape in expected.items():
        t = present[name]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{where}: tensor {name} has type {t.tensor_type.name}, which gguf "
                                  f"{_gguf_version()} cannot dequantise ({e}); use a file with F32/F16/BF16, "
                                  "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 or K-quant tensors") from None
        if w.shape != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {w.shape}, the metadata implies {shape}")
        if arch in _PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if name.endswith("attn_q.weight") else cfg["num_key_value_heads"]
            w = _unpermute(w, heads)
        layer, _, rest = name.removeprefix("blk.").partition(".")
        hf_name = _TOP[name] if name in _TOP else f"model.layers.{layer}.{_LAYER[rest]}"
        out[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return out


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _write_tokenizer(path: Path, reader, cfg: dict, folder: Path) -> str | None:
    """The tokenizer transformers builds from the GGUF's vocabulary, merges and chat template; pad = the file's
    padding token, else eos (generation pads finished rows; the pad id is never trained on)."""
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds for a vocabulary it cannot build
        raise CheckpointError(f"{path}: transformers could not build the tokenizer ({type(e).__name__}: {e})") \
            from None
    pad = cfg["pad_token_id"] if cfg["pad_token_id"] is not None else cfg["eos_token_id"]
    if tok.pad_token is None and pad is not None:
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    tok.save_pretrained(folder)
    return f"built by transformers {transformers.__version__} from the GGUF (pad {tok.pad_token!r})"


def scratch_dir(out: Path) -> Path:
    """A fresh hidden folder beside `out`, named with host and pid; stale ones of dead processes on this host (a
    killed fetch leaves its scratch behind) are removed first."""
    host = socket.gethostname().replace("-", "_")
    prefix = f".{out.name}.tmp-{host}-"
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(prefix + "*"):
        pid = stale.name.removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{prefix}{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def converted_sha256(folder: Path) -> str | None:
    """The GGUF sha256 a complete conversion records, or None when `folder` is not one."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        return None


def _publish(tmp: Path, out: Path, sha256: str, overwrite: bool) -> None:
    old = None
    if overwrite and out.exists():
        old = tmp.with_name(tmp.name + "-old")
        os.replace(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if converted_sha256(out) != sha256:
            raise CheckpointError(f"{out} already exists and is not a conversion of this file; "
                                  "delete it or convert with overwrite=True") from None
        shutil.rmtree(tmp)  # a concurrent conversion of the same file got there first: keep it
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, provenance: dict | None = None,
                 overwrite: bool = True) -> Path:
    """Write a Hugging Face folder (config.json, float32 model.safetensors, generation_config.json, tokenizer,
    workbench_source.json) for a llama / qwen2 / qwen3 GGUF file. `provenance` adds fields to the source record
    (source, licence, sha256 when already known). `overwrite=False` keeps an existing conversion of the same file
    (concurrent fetches) and refuses to replace anything else."""
    path, out = Path(gguf_path), Path(out_dir)
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {path}")
    reader = _open(path)
    cfg = hf_config(reader, path)
    tensors = hf_tensors(reader, cfg, path)
    record = {"source": str(path.resolve()), "licence": _field(reader, "general.license", path, None)} | (
        provenance or {})
    record.setdefault("sha256", file_sha256(path))
    tmp = scratch_dir(out)
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tokenizer = _write_tokenizer(path, reader, cfg, tmp)
        record |= {"gguf": path.name, "architecture": _field(reader, "general.architecture", path),
                   "quantisation": dict(Counter(t.tensor_type.name for t in reader.tensors)),
                   "dtype": "float32", "tokenizer": tokenizer or "none in the GGUF: no tokenizer written",
                   "converted_by": f"workbench.models.gguf with gguf {_gguf_version()}"}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")  # last: marks the folder complete
        for f in tmp.iterdir():  # mkdtemp and the safetensors writer make owner-only files; a cache is shared
            f.chmod(0o644)
        tmp.chmod(0o755)
        _publish(tmp, out, record["sha256"], overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
