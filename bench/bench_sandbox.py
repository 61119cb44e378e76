"""Sandboxed reward throughput (CPU): HumanEval's 164 canonical solutions checked in the sandbox, in
completions/s, by worker count (the pool's default is two per core); the same honest batch on the sandbox of an
earlier commit (--before, default the tree before issue 62's isolation: bounded reading, uid per slot, seccomp,
tmpfs inode caps) and on this one, alternating in the same run; and where one check's time goes, from a bare
`python -I -S -c pass` up to the full launch chain this machine supports, and a check graded in this process
against one run by the judge (one child at a time, median of --repeats).

    python bench/bench_sandbox.py [--out FILE.md] [--repeats 20] [--rounds 2] [--before REV]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from workbench.sandbox import Isolation, Limits, Sandbox
from workbench.sandbox.checks import run_check
from workbench.sandbox.launch import interpreter
from workbench.tasks.humaneval import HumanEval


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm: page cache, the probe
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def startup_rows(repeats: int) -> list[str]:
    """One child at a time: what each layer of the launch chain adds."""
    best = Sandbox().isolation
    python = str(interpreter()[0])
    items = HumanEval().items
    plain = next(p for p in items if p.test.calls)
    judged = next(p for p in items if not p.test.calls)
    layers = [("bare `python -I -S -c pass` (subprocess.run)",
               lambda: subprocess.run([python, "-I", "-S", "-c", "pass"], check=True))]
    trials = [("Sandbox.run('pass'): rlimits, scrubbed env, temp home, no guards",
               Isolation("", (), os.getuid(), False)),
              ("+ guards (audit hook)", Isolation("", (), os.getuid(), True))]
    spaces = tuple(n for n in best.namespaces if n != "mnt")  # a mount namespace comes only with the jail
    if spaces:
        trials.append((f"+ {', '.join(spaces)} namespaces", Isolation("", spaces, os.getuid(), True)))
    if best.drop:
        how = "mount namespace, private root" if best.drop == "jail" else "setpriv"
        trials.append((f"+ {how}, slot uid ({best.drop}): the chain in use here", best))
    for name, isolation in trials:
        sandbox = Sandbox(isolation=isolation)
        layers.append((name, lambda s=sandbox: s.run("pass")))
    sandbox = Sandbox(isolation=best)
    for problem, how in ((plain, "plain calls, graded here"), (judged, "two interpreters, the judge grades")):
        layers.append((f"one HumanEval check ({problem.task_id}, canonical: {how}), chain in use",
                       lambda p=problem: run_check(sandbox, p.answer, p.test, p.entry_point)))
    rows = ["| one child at a time | ms (median) |", "|---|---:|"]
    rows += [f"| {name} | {_median_ms(fn, repeats):.1f} |" for name, fn in layers]
    return rows


def throughput_rows(rounds: int) -> list[str]:
    """All 164 canonical solutions, `rounds` times (the task's result cache is bypassed: a fresh task per round)."""
    cores = os.cpu_count() or 1
    rows = ["| workers | completions/s | all passed |", "|---:|---:|---|"]
    for workers in sorted({1, 2, cores, 2 * cores}):
        rates, passed = [], True
        for _ in range(rounds):
            task = HumanEval(limits=Limits(), workers=workers)
            assert task.pool.sandbox.isolation  # the probe, outside the timing
            start = time.perf_counter()
            results = [f.result() for f in [task.submit(p.answer, p) for p in task.items]]
            rates.append(len(results) / (time.perf_counter() - start))
            passed &= all(r.score("binary") == 1.0 for r in results)
            task.close()
        rows.append(f"| {workers} | {statistics.median(rates):.1f} | {'yes' if passed else 'NO'} |")
    return rows


BEFORE = "b4f0ed4"
"""The last commit before issue 62's changes to the sandbox."""


def before_after_rows(rev: str, rounds: int) -> list[str]:
    """The pool's default workers on all 164 canonical solutions, with `workbench/sandbox` as of `rev` (extracted
    with git into a temporary package) and as now, alternating, `rounds` times each."""
    here = Path(__file__).resolve().parents[1]
    tmp = tempfile.mkdtemp(prefix="bench-sandbox-before-")
    archive = subprocess.run(["git", "-C", str(here), "archive", rev, "workbench/sandbox"], capture_output=True)
    if archive.returncode != 0:
        return [f"(before/after skipped: git archive {rev} failed: {archive.stderr.decode().strip()})"]
    with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    os.rename(Path(tmp, "workbench", "sandbox"), Path(tmp, "sandbox_before"))
    sys.path.insert(0, tmp)
    old = importlib.import_module("sandbox_before")  # HumanEval was part of the sandbox package then
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(rounds):
        for label, task_class, limits in (("before", old.HumanEval, old.Limits), ("after", HumanEval, Limits)):
            task = task_class(limits=limits())
            assert task.pool.sandbox.isolation  # the probe, outside the timing
            start = time.perf_counter()
            results = [f.result() for f in [task.submit(p.answer, p) for p in task.items]]
            rates[label].append(len(results) / (time.perf_counter() - start))
            assert all(r.score("binary") == 1.0 for r in results), label
            task.close()
    before, after = (statistics.median(rates[k]) for k in ("before", "after"))
    return [f"| honest batch, {task.pool.workers} workers | checks/s (median of {rounds}) |", "|---|---:|",
            f"| before ({rev}) | {before:.1f} |", f"| after (this tree) | {after:.1f} |",
            f"| change | {100 * (after / before - 1):+.1f}% |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", default=BEFORE, help="the commit whose sandbox is the 'before' of the comparison")
    a = ap.parse_args()
    isolation = Sandbox().isolation
    plain = sum(bool(p.test.calls) for p in HumanEval().items)
    lines = [(f"CPU: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}; "
              f"Python {platform.python_version()}; load average {os.getloadavg()[0]:.2f} at the start"),
             f"Isolation: {isolation.describe()}",
             f"Tests graded in this process (plain calls): {plain} of 164; the rest by the judge", "",
             *before_after_rows(a.before, max(a.rounds, 3)), "", *throughput_rows(a.rounds), "",
             *startup_rows(a.repeats)]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
