"""Hostile completions of issue 62, one test per attack class: what a run's output does to the trainer (freeze,
crash, CPU), kernel memory no rlimit counts (xattrs, inodes, memfd), runs sharing one identity (threads,
keyrings), and each bypass of the Python guards. Kernel-layer tests run with the guards off on the chain this
machine has, and are skipped with the reason where that layer is not there."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import Future

import pytest
from test_sandbox_attacks import accept_the_chain_here, jail  # noqa: F401 (fixtures)

from workbench.sandbox import Isolation, Limits, Sandbox, launch
from workbench.sandbox import reading
from workbench.tasks.humaneval import HumanEval

FAST = Limits(timeout_s=5, cpu_s=3)
ADD = {"task_id": "Test/add", "entry_point": "add", "prompt": 'def add(a, b):\n    """a + b"""\n',
       "canonical_solution": "    return a + b\n",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"}
JUDGED = dict(ADD, task_id="Test/judged", test=("def check(candidate):\n    for i in range(3):\n"
                                                "        assert abs(candidate(i, 1) - (i + 1)) < 1e-9\n"))
DEADLINE_S = 240
"""For the subprocess that meets the freezes: generous (a freeze is 2^60 steps, not a slow machine)."""


def _rows(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (ADD, JUDGED)))
    return str(path)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    task = HumanEval(_rows(tmp_path_factory.mktemp("problems")), limits=FAST, workers=4)
    yield task
    task.close()




def test_results_that_would_freeze_the_trainer_score_zero(tmp_path):
    """A shared nested list (x = [x, x] sixty times: 2^60 leaves to repr, compare or hash, in C with the GIL held),
    a self-nested tuple in a set and as a dict key, a set of ints that all hash alike, 1 MiB of tiny frames, and
    ints of 4,096 digits, returned by solutions and sent to the reader directly. Run in a subprocess with a
    deadline: a freeze there is a failure here, not a hung test run."""
    script = textwrap.dedent(f"""
        import marshal, sys
        from workbench.sandbox import Limits, reading, values
        from workbench.tasks.humaneval import HumanEval
        task = HumanEval({_rows(tmp_path)!r}, limits=Limits(timeout_s=5, cpu_s=3), workers=2)
        dag = "x = [1]\\nfor _ in range(60):\\n    x = [x, x]\\n"
        solutions = {{
            "list": "def add(a, b):\\n" + "".join("    " + l + "\\n" for l in dag.splitlines()) + "    return x\\n",
            "set": "def add(a, b):\\n    t = (1,)\\n    for _ in range(60):\\n        t = (t, t)\\n"
                   "    return [t]\\n",
            "raised": "def add(a, b):\\n" + "".join("    " + l + "\\n" for l in dag.splitlines())
                      + "    raise ValueError(x)\\n",
            "frames": "import os, marshal\\ndef add(a, b):\\n    f = marshal.dumps(('value', 1))\\n"
                      "    for fd in range(3, 10):\\n        try:\\n"
                      "            os.write(fd, (len(f).to_bytes(4, 'big') + f) * 60000)\\n"
                      "        except OSError:\\n            pass\\n    return a + b\\n",
            "digits": "def add(a, b):\\n    return [10 ** 4095] * 60\\n",
        }}
        for name, solution in solutions.items():
            scores = [task.rewards([solution], [p])[0] for p in task.items]
            print(name, scores, task.failures, sep="|")
        t = (1,)
        for _ in range(60):
            t = (t, t)
        record = bytearray(marshal.dumps([t]))
        record[0] = (record[0] & 0x80) | ord("<")  # the list made a set: hashing it would walk 2^60 leaves
        M = (1 << 61) - 1
        colliding = bytearray(marshal.dumps(list(range(0, 61000 * M, M))))
        colliding[0] = (colliding[0] & 0x80) | ord("<")
        for name, data in (("set of a DAG", bytes(record)), ("colliding hashes", bytes(colliding)),
                           ("DAG as a dict key", b"{{" + marshal.dumps(t) + marshal.dumps(1) + b"0")):
            try:
                values.loads(data)
                print(name, "read", sep="|")
            except ValueError:
                print(name, "refused", sep="|")
        tiny = marshal.dumps(("value", 1))
        print("frames read", len(reading.frames((len(tiny).to_bytes(4, "big") + tiny) * 60000, 2)), sep="|")
        task.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split("|", 1) for line in done.stdout.strip().splitlines())
    for name in ("list", "set", "raised", "frames", "digits"):
        assert lines[name] == "[0.0, 0.0]|0", (name, done.stdout)
    assert lines["set of a DAG"] == lines["colliding hashes"] == lines["DAG as a dict key"] == "refused", done.stdout
    assert lines["frames read"] == "2", done.stdout


def test_a_verdict_never_raises_nor_grows(task):
    """An int past Python's 4,300-digit limit on text, huge and odd values: the verdict's text is short and
    writing it raises nothing; a solution returning one scores 0 and the trainer goes on."""
    from workbench.sandbox.checks import _verdict

    for value in (10 ** 5000, "x" * 10 ** 6, [[1] * 10 ** 5] * 10, {i: i for i in range(10 ** 4)}, b"y" * 10 ** 6):
        why = _verdict(("value", value), "==", 3)
        assert why.startswith("returned") and len(why) < 600, why[:100]
        assert len(_verdict(("raised", value, value), "==", 3)) < 600
    assert len(reading.show(type("Bad", (), {"__repr__": lambda self: 1 / 0})())) < 200
    assert task.rewards(["def add(a, b):\n    return 10 ** 5000\n"], [task.items[0]]) == [0.0]


def test_one_failing_check_gets_zero_and_is_counted(task, monkeypatch):
    """The step's batch survives a check that raises (the sandbox failing, a grader bug): that completion gets 0,
    `failures` counts it, the others keep their rewards."""
    real = task.submit
    broken = Future()
    broken.set_exception(RuntimeError("the sandbox could not start"))

    def submit(completion, problem):
        if "BROKEN" in completion:
            return broken
        if "RAISES" in completion:
            raise ValueError("extraction failed")
        return real(completion, problem)

    monkeypatch.setattr(task, "submit", submit)
    good = ADD["prompt"] + ADD["canonical_solution"]
    plain = task.items[0]
    assert task.rewards([good, "# BROKEN", "# RAISES", good], [plain] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert task.failures == 2 and task.failures_total >= 2
    assert task.rewards([good], [plain]) == [1.0] and task.failures == 0


def test_kernel_memory_of_a_run_is_bounded(jail):
    """Extended attributes and inodes on every tmpfs of the run (guards off): both stop at the inode cap
    (tmpfs charges xattrs to it), far below what uncapped tmpfs took (256 MiB of xattrs, 310k inodes)."""
    program = textwrap.dedent("""
        import os
        stored = files = 0
        for d in ('/home', '/tmp', '/var/tmp', '/dev/shm'):
            try:
                open(f'{d}/x', 'w').close()  # its own file: user xattrs on a sticky folder of root's are refused
                for i in range(1 << 20):
                    os.setxattr(f'{d}/x', f'user.k{i}', bytes(60000))
                    stored += 60000
            except OSError:
                pass
            try:
                for i in range(1 << 20):
                    os.mknod(f'{d}/n{i}')
                    files += 1
            except OSError:
                pass
        print(stored >> 20, files)
    """)
    result = jail.run(program)
    stored_mb, files = map(int, result.stdout.split())
    assert files <= 4 * FAST.inodes, result
    assert stored_mb <= 4 * (FAST.inodes >> 10) + 4, result  # 1 KiB of xattr space per inode


def test_memfd_keyrings_and_namespaces_are_refused(jail):
    """memfd (memory outside every tmpfs and RLIMIT_AS), a key added to the user's keyring for a later run to
    read, and new namespaces: the seccomp filter refuses each (guards off, ctypes calls the kernel directly)."""
    if not jail.isolation.seccomp:
        pytest.skip("no seccomp binding here (pip install pyseccomp)")
    program = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        out = []
        try:
            os.memfd_create('x')
            out.append('memfd')
        except OSError as e:
            out.append(e.errno)
        for call in ((248, b'user', b'left-by-a-run', b'secret', 6, -4),  # add_key into the user keyring
                     (250, 0, -4, 0, 0, 0),  # keyctl(GET_KEYRING_ID, the user keyring)
                     (272, 0x10000000, 0, 0, 0, 0),  # unshare(CLONE_NEWUSER)
                     (298, 0, 0, -1, -1, 0),  # perf_event_open
                     (425, 8, 0, 0, 0, 0)):  # io_uring_setup
            out.append(libc.syscall(*call) == -1 and ctypes.get_errno())
        print(out)
    """)
    assert jail.run(program).stdout.strip() == str([1] * 6).encode()


def test_concurrent_runs_have_their_own_identity(task, jail):
    """Threads: one run holding every thread its limit allows, while a correct sibling that starts one thread
    is checked (it scored 0 when all runs were nobody). Identity: two runs at once have different uids."""
    attacker = ("def add(a, b):\n    import threading, time\n    held = []\n    threading.stack_size(1 << 16)\n    try:\n        while True:\n"
                "            t = threading.Thread(target=time.sleep, args=(3,))\n            t.start()\n"
                "            held.append(t)\n    except RuntimeError:\n        pass\n    if held:\n        time.sleep(1.5)\n"
                "    return len(held)\n")
    sibling = ("import threading\ndef add(a, b):\n    out = []\n    t = threading.Thread(target=lambda: out.append(a + b))"
               "\n    t.start()\n    t.join()\n    return out[0]\n")
    flood = task.submit(attacker, task.items[0])
    time.sleep(0.5)  # the attacker holds its threads by now (ordering only: nothing is timed)
    assert task.rewards([sibling], [task.items[0]]) == [1.0]
    held = flood.result().error  # 'unit 0: returned <threads it held>, expected == 3'
    # It ran into its limit (a few of the uid's slots can be the run's own other tasks, more on a loaded machine).
    assert int(held.split()[3].rstrip(',')) >= FAST.processes - 8, held
    ids = [Future(), Future()]
    uids = Sandbox(FAST, guards=False)
    runs = [threading.Thread(target=lambda f=f: f.set_result(uids.run("import os, time\ntime.sleep(0.5)\n"
                                                                       "print(os.getuid())").stdout)) for f in ids]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert ids[0].result() != ids[1].result(), [f.result() for f in ids]


def test_the_guards_hold_against_their_own_frame(tmp_path):
    """A refused open's traceback reaches the hook's frame: everything reachable from it is rebound or mutated
    (function code and closure cells, lists, counters), then fork, writing outside home and import gc are still
    refused. Without the kernel layers: the guards alone."""
    plain = Sandbox(FAST, isolation=Isolation("", (), os.getuid(), guards=True))
    target = tmp_path / "escape"
    program = textwrap.dedent(f"""
        import os
        try:
            open('/etc/hostname')
        except PermissionError as e:
            tb = e.__traceback__
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        touched = 0
        for frame in [f for f in frames if f.f_code.co_name == 'guard']:
            for name, value in list(frame.f_locals.items()):
                if type(value).__name__ == 'function':  # its cells are shared with the hook's
                    for cell in value.__closure__ or ():
                        if callable(cell.cell_contents):
                            cell.cell_contents = lambda *a, **k: True
                    touched += 1
                elif type(value).__name__ == 'count':  # the writes counter: up only
                    next(value)
        out = {{}}
        for name, act in (('fork', os.fork), ('write', lambda: open({str(target)!r}, 'w')),
                          ('gc', lambda: __import__('gc'))):
            try:
                pid = act()
                out[name] = 'done'
                if name == 'fork' and pid == 0:
                    os._exit(0)
            except PermissionError:
                out[name] = 'refused'
        print(len([f for f in frames if f.f_code.co_name == 'guard']), touched, out)
    """)
    result = plain.run(program)
    assert result.stdout.startswith(b"1 "), result  # the hook's frame was reached
    assert result.stdout.strip().endswith(b"{'fork': 'refused', 'write': 'refused', 'gc': 'refused'}"), result
    assert not target.exists()


def test_the_guards_refuse_ctypes_leftovers_and_dotted_names():
    """ctypes classes left from entering the jail (found through type.__subclasses__), dlsym through them, and a
    denied module loaded under another dotted name: all refused with the guards on."""
    sandbox = Sandbox(FAST)
    program = textwrap.dedent("""
        import sys, types, os
        out = {}
        def walk(cls, seen):
            for sub in type.__subclasses__(cls):
                if sub not in seen:
                    seen.add(sub)
                    walk(sub, seen)
            return seen
        found = {c.__name__: c for c in walk(object, set()) if 'ctypes' in (c.__module__ or '')}
        out['leftover'] = sorted(n for n in ('CDLL', 'PyDLL', '_SimpleCData') if n in found)
        for name, act in (('dlopen', lambda: found['CDLL'](None)),
                          ('cdata', lambda: found['c_char'].from_address(id(out)) if 'c_char' in found else 1 / 0)):
            try:
                act()
                out[name] = 'done'
            except PermissionError:
                out[name] = 'refused'
            except Exception as e:
                out[name] = type(e).__name__
        dynload = next(p for p in sys.path if p.endswith('lib-dynload'))
        pkg = types.ModuleType('alias')
        pkg.__path__ = [dynload]
        sys.modules['alias'] = pkg
        try:
            __import__('alias._posixshmem')
            out['dotted'] = 'done'
        except PermissionError:
            out['dotted'] = 'refused'
        print(out)
    """)
    result = sandbox.run(program)
    seen = eval(result.stdout)  # noqa: S307 (a dict of str printed by the run)
    assert seen["dotted"] == "refused", seen
    for name in ("dlopen", "cdata"):
        assert seen[name] in ("refused", "AttributeError", "KeyError", "ZeroDivisionError"), seen
        assert seen[name] != "done", seen
    if seen["leftover"]:  # the jail loaded ctypes: its classes are still reachable, and useless
        assert seen["dlopen"] == "refused", seen


def test_a_chain_that_cannot_isolate_refuses_untrusted_code(monkeypatch):
    """Without the jail, no untrusted code runs unless the chain is accepted by name; accepted, one line says
    what is unprotected (a wrong solution could copy the canonical answer out of the installed data)."""
    monkeypatch.setattr(launch, "CANDIDATES", tuple(c for c in launch.CANDIDATES if c[0] != "jail"))
    monkeypatch.setattr(launch, "probe", launch.probe.__wrapped__)
    monkeypatch.delenv(launch.ACCEPT_ENV, raising=False)
    weaker = launch.probe(True)
    with pytest.raises(RuntimeError, match=f"refusing .* {launch.ACCEPT_ENV}={re.escape(weaker.name)}$"):
        Sandbox(FAST)
    monkeypatch.setenv(launch.ACCEPT_ENV, weaker.name)
    with pytest.warns(UserWarning, match="canonical answer") as said:
        assert Sandbox(FAST).run("print(1)").stdout == b"1\n"
    assert len([w for w in said if "running untrusted code" in str(w.message)]) == 1


def test_the_slot_cgroups_or_one_line_saying_why_not(tmp_path, monkeypatch):
    """Where the host delegates cgroup v2 memory and pids, each slot's group gets memory.max and pids.max (the
    child joins it first thing); where not, one line says so, once per process."""
    from workbench.sandbox import cgroup

    groups = cgroup.SlotGroups(tmp_path, 123 << 20, 7)
    assert groups.path(2) == str(tmp_path / "slot-2") == groups.path(2)
    assert (tmp_path / "slot-2" / "memory.max").read_text() == str(123 << 20)
    assert (tmp_path / "slot-2" / "pids.max").read_text() == "7"
    monkeypatch.setattr(cgroup, "_parent", cgroup._parent.__wrapped__)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        parent = cgroup._parent()
    if parent is None:
        assert len(said) == 1 and "no memory cgroup" in str(said[0].message), said
    else:
        assert not said and {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split())


def test_an_unreadable_result_is_a_zero_verdict_and_logged(task, caplog):
    """The freeze's bytes (x = [x, x] sixty times, 610 bytes of marshal) on a run's channel: the check's verdict
    is "unreadable result", reward 0, one warning logged, nothing raised."""
    import marshal

    from workbench.sandbox.checks import run_check
    from workbench.sandbox.sandbox import RunResult

    x = [1]
    for _ in range(60):
        x = [x, x]
    frame = marshal.dumps(("value", x))

    class Channel:
        limits = FAST

        def run(self, *args, **kwargs):
            return RunResult(0, b"", b"", False, False, channel=len(frame).to_bytes(4, "big") + frame)

    with caplog.at_level("WARNING"):
        result = run_check(Channel(), "", task.items[0].test, "add")
    assert result.scores() == {"binary": 0.0, "partial": 0.0} and result.error.startswith(reading.UNREADABLE)
    assert reading.UNREADABLE in caplog.text
