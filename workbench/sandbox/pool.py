"""`SandboxPool`: sandboxed runs in parallel, as futures, each request run once.

Threads suffice: each one only starts a child process and waits on its pipes, so the work is in the children
and the GIL is free. Results are kept by key (a GRPO group often holds the same completion several times, and a
trainer asks `scores` and `reward` of the same completion), the futures themselves, so a second request for a
key in flight waits on the first run instead of starting another.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self

from .sandbox import Limits, Sandbox


class SandboxPool:
    """`workers` children at a time (default: two per CPU core: a run spends about as long waiting on the kernel,
    which makes and tears down its namespaces, as computing, so one per core leaves the cores half idle).
    Nothing starts until the first `submit`: then the sandbox is made (the isolation probe) and the threads."""

    def __init__(self, limits: Limits | None = None, workers: int | None = None, guards: bool = True,
                 cache_size: int = 4096):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.limits, self.guards, self.cache_size = limits or Limits(), guards, cache_size
        self.workers = workers or 2 * (os.cpu_count() or 1)
        self._lock = threading.RLock()
        self._sandbox: Sandbox | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._done: OrderedDict[Hashable, Future] = OrderedDict()

    @property
    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(self.limits, self.guards)
            return self._sandbox

    def submit(self, key: Hashable, fn: Callable, *args) -> Future:
        """`fn(sandbox, *args)` on a pool thread, or the future of an earlier request with the same key."""
        sandbox = self.sandbox
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")
            future = self._executor.submit(fn, sandbox, *args)
            self._done[key] = future
            # Reentrant lock: a future already done runs this callback here, inside the lock.
            future.add_done_callback(lambda f: f.exception() is not None and self._forget(key, f))
            if len(self._done) > self.cache_size:
                self._done.popitem(last=False)
            return future

    def _forget(self, key: Hashable, future: Future) -> None:
        """A run that raised (not a failing solution: the sandbox itself) is tried again when asked again."""
        with self._lock:
            if self._done.get(key) is future:
                del self._done[key]

    def close(self) -> None:
        """Wait for the runs in flight and stop the threads (a later submit starts new ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
