"""The interpreter speed-up of tests/interpreter_patch.py in the processes the tests start (torch.multiprocessing
spawns, `python -m workbench train`, notebook kernels): conftest.py puts this folder first on PYTHONPATH, so Python
imports this module at start-up. It only waits for `triton.runtime.interpreter` to be imported and installs the
speed-up right after (the same pinned-source guard: another Triton fails the process, loudly)."""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "triton.runtime.interpreter"
_PATCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interpreter_patch.py")


class _AfterInterpreterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch_spec = importlib.util.spec_from_file_location("workbench_tests_interpreter_patch", _PATCH)
            patch = importlib.util.module_from_spec(patch_spec)
            patch_spec.loader.exec_module(patch)
            patch.install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("WORKBENCH_PLAIN_INTERPRETER") != "1" \
        and _TARGET not in sys.modules:
    sys.meta_path.insert(0, _AfterInterpreterImport())
