"""The sandbox and the HumanEval task: hostile completions score 0 and leave this process unharmed, each kernel
layer holds on its own (guards off), the Python guards hold without the kernel layers, HumanEval's canonical
solutions pass, partial credit follows its rule, and code is found in completions."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from test_sandbox_attacks import accept_the_chain_here  # noqa: F401 (a fixture)

from workbench.rl.config import TrainConfig
from workbench.sandbox import Isolation, Limits, Sandbox, extract_code, instrument_test, solution_program
from workbench.tasks import TASKS, make_task
from workbench.tasks.humaneval import HumanEval, read_problems

FAST = Limits(timeout_s=2, cpu_s=2)
ADD = {"task_id": "Test/add", "entry_point": "add", "prompt": 'def add(a, b):\n    """a + b"""\n',
       "canonical_solution": "    return a + b\n",
       "test": ("def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
                "    assert True, 'a constant: no unit'\n    assert candidate(-1, 1) == 0\n"
                "    assert candidate(2, 2) == 4\n")}


def _problems(tmp_path, *rows):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def humaneval():
    task = HumanEval(limits=FAST)  # the pool's default: two workers per core
    yield task
    task.close()


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST)


@pytest.fixture
def add_task(tmp_path):
    task = HumanEval(_problems(tmp_path, ADD), limits=FAST, workers=2)
    yield task, task.items[0]
    task.close()


@pytest.fixture
def secret(tmp_path):
    """A file outside the sandbox, in a folder only this user may enter (like ~/.ssh)."""
    folder = tmp_path / "dot-ssh"
    folder.mkdir(mode=0o700)
    path = folder / "id_ed25519"
    path.write_text("PRIVATE-KEY-43f1")
    return path


@pytest.fixture
def listener():
    """A TCP port listening on this machine's loopback: reachable unless the network is cut."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def test_hostile_completions_score_zero_and_this_process_survives(add_task, secret, listener):
    task, problem = add_task
    body = "def add(a, b):\n    {}\n    return a + b\n"
    hostile = {
        "infinite loop": body.format("while True: pass"),
        "fork bomb": body.format("import os\n    while True: os.fork()"),
        "10 GB": body.format("x = bytearray(10 * 2**30)"),
        "1 GB print": body.format("for _ in range(1024): print('x' * 2**20)"),
        "~/.ssh": body.format("import os; open(os.path.expanduser('~/.ssh/id_ed25519')).read()"),
        "secret file": body.format(f"open({str(secret)!r}).read()"),
        "socket": body.format(f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=1)"),
        "kill parent": body.format("import os; os.kill(os.getppid(), 9)"),
        "kill group": body.format("import os; os.killpg(os.getpgid(0), 9)"),
        "exit": body.format("import sys; sys.exit(0)"),
        "hard exit": body.format("import os; os._exit(0)"),
    }
    rewards = task.rewards(list(hostile.values()), [problem] * len(hostile))
    assert dict(zip(hostile, rewards)) == dict.fromkeys(hostile, 0.0) and task.failures == 0
    assert task.reward(body.format("pass"), problem) == 1.0, "the same function, harmless, passes"
    assert os.getppid() > 1 and secret.read_text() == "PRIVATE-KEY-43f1"


def test_partial_credit_follows_the_rule(add_task, tmp_path):
    task, problem = add_task
    assert problem.test.units == 4 and problem.test.calls, "assert True is no unit; the rest are plain calls"
    assert task.scores("def add(a, b):\n    return a * b\n", problem) == {"binary": 0.0, "partial": 0.5}
    assert task.scores(ADD["prompt"] + ADD["canonical_solution"], problem) == {"binary": 1.0, "partial": 1.0}
    wrong = task.submit("def add(a, b):\n    return a * b\n", problem).result()
    assert wrong.error == "unit 0: returned 2, expected == 3"
    # A failing set-up statement stops `check`: the units before it count, binary is 0.
    stops = dict(ADD, test="def check(candidate):\n    assert candidate(1, 2) == 3\n    x = 1 / 0\n"
                           "    assert candidate(0, 0) == 0\n")
    loop = dict(ADD, test="def check(candidate):\n    for i in range(5):\n        assert candidate(i, 1) == i + 1\n"
                          "    assert candidate(2, 2) == 4\n")
    other = HumanEval(_problems(tmp_path, stops, loop), limits=FAST, workers=2, reward="partial")
    try:
        first, second = other.items
        assert other.scores(ADD["canonical_solution"], first) == {"binary": 0.0, "partial": 0.5}
        assert second.test.units == 2 and not second.test.calls, "a loop of asserts is one unit, run by the judge"
        assert other.rewards(["def add(a, b):\n    return 4 if a == 2 else a\n"], [second]) == [0.5]
    finally:
        other.close()


def test_instrumenting_refuses_tests_it_cannot_score():
    with pytest.raises(ValueError, match="exactly one top-level `def check"):
        instrument_test("assert 1 == 1\n")
    with pytest.raises(ValueError, match="asserts nothing"):
        instrument_test("def check(candidate):\n    assert True\n")


def test_canonical_solutions_pass(humaneval):
    """All 164 (their throughput is bench/bench_sandbox.py's, not a unit test's)."""
    problems = humaneval.items
    assert len(problems) == 164
    futures = [humaneval.submit(p.answer, p) for p in problems]
    results = [f.result() for f in futures]
    failed = [(p.task_id, r.error) for p, r in zip(problems, results) if r.scores() != {"binary": 1.0, "partial": 1.0}]
    assert not failed
    wrong = [humaneval.submit(p.code + "    return None\n", p) for p in problems[:8]]
    assert all(f.result().scores() == {"binary": 0.0, "partial": 0.0} for f in wrong)


def test_code_is_found_in_completions(humaneval):
    problem = humaneval.items[0]  # has_close_elements, after `from typing import List`
    body = problem.answer[len(problem.code):]
    function = "def has_close_elements(numbers, threshold):\n" + body
    completions = {
        "fenced": f"Here it is:\n```python\n{function}```\nIt compares every pair.",
        "second fence defines it": f"```\nprint('demo')\n```\nthen\n```py\n{function}```",
        "unclosed fence": f"```python\n{function}",
        "bare, with prose after": f"Sure.\n{function}\nThis runs in O(n^2).\nAnother line of prose.",
        "body only (continuation)": body + "\n\ndef unrelated():\n    return 1 / 0\n",
        "fenced body at column 0": "```python\n" + "\n".join(line[4:] for line in body.splitlines()) + "\n```",
    }
    rewards = humaneval.rewards(list(completions.values()), [problem] * len(completions))
    assert dict(zip(completions, rewards)) == dict.fromkeys(completions, 1.0)
    assert extract_code(completions["bare, with prose after"], "has_close_elements") == (function, False)
    program = solution_program(completions["body only (continuation)"], problem.code, problem.entry_point)
    assert program == problem.code + body.rstrip("\n") + "\n" and "unrelated" not in program
    assert humaneval.reward("I do not know.", problem) == 0.0


def test_the_task_is_registered(tmp_path):
    assert {"humaneval", "humaneval-partial"} <= set(TASKS)
    assert TrainConfig(task="humaneval-partial", policy="some-model").data.task == "humaneval-partial"
    task = make_task("humaneval-partial", seed=3, source=str(_problems(tmp_path, ADD, dict(ADD, task_id="Test/2"))))
    try:
        assert task.kind == "partial" and len(task) == 2
        assert task.problems(3, start=1)[2] == task.problems(1, start=1)[0], "the stream wraps around"
        assert task.eval_problems(5) == task.items and "```python\ndef add(a, b):" in task.items[0].prompt
    finally:
        task.close()
    with pytest.raises(ValueError, match="no task_id"):
        read_problems(_problems(tmp_path, {"prompt": "x"}))
    with pytest.raises(ValueError, match="reward must be one of"):
        HumanEval(reward="some")


def test_run_limits_output_time_and_environment(sandbox, monkeypatch):
    flood = "import sys\nwhile True: sys.stdout.write('x' * 4096)"
    capped = Sandbox(Limits(timeout_s=5, output_bytes=1 << 16)).run(flood)
    assert capped.output_capped and len(capped.stdout) == 1 << 16 and not capped.timed_out
    slept = Sandbox(Limits(timeout_s=0.5)).run("import time\ntime.sleep(30)")
    assert slept.timed_out and slept.returncode != 0
    monkeypatch.setenv("WORKBENCH_TEST_TOKEN", "hunter2")
    seen = sandbox.run("import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))")
    child = json.loads(seen.stdout)
    assert set(child["env"]) <= {"PATH", "HOME", "LANG", "LD_LIBRARY_PATH"}
    assert child["env"]["HOME"] == child["cwd"] != os.path.expanduser("~")
    if sandbox.isolation.drop == "jail":  # its home is a tmpfs of its own mount namespace
        sandbox.run("open('left', 'w').write('x')")
        assert child["cwd"] == "/home" and sandbox.run("import os; print(os.listdir())").stdout == b"[]\n"
    else:
        assert not Path(child["cwd"]).exists(), "the run's temporary folder is removed"
    assert sandbox.run("x = bytearray(10 * 2**30)").stderr.rstrip().endswith(b"MemoryError")
    assert b"File too large" in sandbox.run("open('f', 'wb').write(b'x' * (17 << 20))").stderr
    print(sandbox.isolation.describe())


def test_the_python_guards_hold_without_the_kernel_layers(secret, listener, tmp_path):
    plain = Sandbox(FAST, isolation=Isolation("", (), os.getuid(), guards=True))
    kept, made = str(secret), str(tmp_path / "made")
    for program in (f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=1)",
                    "import os; os.kill(os.getppid(), 9)", "import os; os.fork()", "import subprocess",
                    f"print(open({kept!r}).read())", "open('/tmp/wb-sandbox-escape', 'w')",
                    "import ctypes", f"import os; os.remove({kept!r})", f"import os; os.truncate({kept!r}, 0)",
                    f"import os; os.rename({kept!r}, {made!r})", f"import os; os.link({kept!r}, {made!r})",
                    f"import os; os.symlink({kept!r}, {made!r})", f"import os; os.mkdir({made!r})",
                    f"import os; os.rmdir({str(secret.parent)!r})", "import _posixshmem",
                    "from multiprocessing import shared_memory"):
        result = plain.run(program)
        assert b"PermissionError: sandbox:" in result.stderr and result.returncode == 1, program
    assert not Path("/tmp/wb-sandbox-escape").exists() and not Path(made).exists()
    assert secret.read_text() == "PRIVATE-KEY-43f1"


def test_the_kernel_layers_hold_without_the_guards(secret, listener):
    bare = Sandbox(Limits(timeout_s=5, processes=16), guards=False)
    isolation = bare.isolation
    if "net" not in isolation.namespaces and isolation.uid == os.getuid():
        pytest.skip(f"no namespaces and no other user here: the guards are the only layer ({isolation.describe()})")
    if "net" in isolation.namespaces:  # this machine's loopback is not the child's
        connect = bare.run(f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=1)")
        assert connect.returncode == 1 and b"Traceback" in connect.stderr, connect
    if "pid" in isolation.namespaces or isolation.uid != os.getuid():  # this process is unseen, or not its to kill
        kill = bare.run(f"import os; print(os.getppid()); os.kill({os.getpid()}, 9)")
        assert b"ProcessLookupError" in kill.stderr or b"PermissionError" in kill.stderr, kill
        assert kill.stdout.split() == [b"0"] or "pid" not in isolation.namespaces, "the parent is invisible"
    if isolation.uid != os.getuid():
        read = bare.run(f"print(open({str(secret)!r}).read())").stderr
        assert b"Permission denied" in read or b"No such file" in read, read
    if isolation.uid != 0:  # root ignores RLIMIT_NPROC
        bomb = bare.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
                        "except OSError:\n    print('stopped after', n)\n")
        assert bomb.stdout.startswith(b"stopped after") and not bomb.timed_out
        assert int(bomb.stdout.split()[-1]) <= 64, "RLIMIT_NPROC: 16 beyond the user's count at the start"


def test_the_trainer_rewards_a_step_through_the_sandbox(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workbench.models import ModelConfig, build, save_pretrained
    from workbench.rl.trainer import train
    from workbench.tasks.humaneval import HumanEval as Task

    asked, batch = [], Task.rewards
    monkeypatch.setattr(Task, "rewards", lambda self, c, p: asked.append(len(c)) or batch(self, c, p))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([ADD["prompt"]] * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                                    special_tokens=["<|endoftext|>", "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<unk>")
    model = build(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              max_position_embeddings=512), device="cpu", dtype=torch.bfloat16, seed=0)
    save_pretrained(model, tmp_path / "ckpt", tokenizer=tok)
    cfg = TrainConfig(policy=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "run"), task="humaneval-partial",
                      task_source=str(_problems(tmp_path, ADD)), steps=1, prompts_per_step=2, group_size=2,
                      max_new_tokens=4, kernel_mode="standard", progress=False)
    metrics = set(train(cfg).metric)
    assert asked == [4], "one batch call for the step's 4 completions"
    assert {"accuracy_binary", "accuracy_partial", "reward_mean"} <= metrics
