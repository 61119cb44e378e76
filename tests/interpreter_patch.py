"""A test-infrastructure speed-up for Triton's interpreter (TRITON_INTERPRET=1), applied by conftest.py: inside one
kernel launch, a nested @triton.jit helper call (a kernel's own helpers, and triton.language's: `tl.sum`, `tl.max`,
...) skips re-patching triton.language once every triton.language module the helper's globals hold has been patched
in this launch.

Why it changes no bits: `GridExecutor.__call__` patches the kernel's triton.language modules (`_patch_lang`) once per
launch and restores them when the launch ends. `InterpretedFunction.__call__` (a helper called by the kernel, once per
program and call site) calls `_patch_lang(helper)` again and drops the scope it returns, so nothing it sets is ever
restored during the launch. A module already patched has no builtin left to wrap (each is a plain lambda now), so
patching it again only sets the other patched attributes (range, static_range, tensor.__bool__, reduce, ...) to a
fresh copy of the same closure: it costs time (`inspect.getmembers` over triton.language, 15-20% of an interpreted
run) and changes nothing. The first call that names a module this launch has not patched yet (`triton.language.core`,
the globals of `tl.sum`, where the kernel's module holds only `triton.language`) runs Triton's own path, as does
every helper call of a launch with pre-run hooks (they run before the launch patches).

Also `_get_np_dtype` (a Triton dtype's numpy storage dtype: a pure function of the dtype, called for every
interpreted op) builds its 18-entry table on each call; its answers are kept per scalar dtype (a block's answer is
its element dtype's, as in Triton's body).

And the interpreter's integer overflow check is off (`InterpreterOptions.sanitize_overflow`: every int32 add, sub
and mul of a kernel redone in int64 and asserted in range, ~16% of an interpreted run), as it is on a GPU, where
Triton checks only with debug=True. It only asserts, so no value changes; the tests' tensors are far below 2^31
elements, where an int32 offset could overflow.

And `_convert_float` (the bit-level float conversion behind every bf16 <-> fp32 cast, ~25 numpy operations on each
call, about a tenth of an interpreted run on the tests' small blocks) takes a shortcut for bf16 -> fp32 and for
fp32 -> bf16 without rounding (the interpreter's plain `.to`), which share their exponent's width and bias: for a
normal number, an infinity, a NaN or a zero, Triton's arithmetic keeps the sign and exponent and shifts the mantissa
by 16 bits (the downcast truncating), which is the bit pattern shifted by 16. A block holding a subnormal, where
Triton's own renormalisation gives other bits, and every other conversion run Triton's body.
tests/test_interpreter_patch.py checks the shortcut against Triton's function on every bf16 pattern and every fp32
sign, exponent and high mantissa.

Guarded: the functions this reasoning reads are pinned by the SHA-256 of their source (triton 3.7.1). Another Triton
fails the session at start-up with a message (`pytest.UsageError`), never silently: re-check the reasoning above
against the new source, then update `PINNED`. WORKBENCH_PLAIN_INTERPRETER=1 turns the speed-up off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import threading

PINNED = {
    "_patch_lang": "e5beeba74ada4829",
    "_patch_builtin": "3c21c270fa61fb24",
    "_patch_attr": "e0c1b7d65a2463cd",
    "_patch_lang_tensor": "1475c3a06f26820e",
    "_patch_lang_core": "72864625d91b5cd0",
    "_patch_reduce_scan": "ff294418b913c41c",
    "InterpretedFunction.__call__": "f2446df462640049",
    "GridExecutor.__call__": "a8a9450a0a0406a3",
    "_LangPatchScope": "1b26f629cd7367a8",
    "_get_np_dtype": "8f20d41e3207891a",
    "InterpreterOptions": "942c1a93071739ca",
    "_convert_float": "b466f779f6e2f7f1",
}


def _source_hashes(interp) -> dict[str, str]:
    out = {}
    for name in PINNED:
        obj = interp
        for part in name.split("."):
            obj = getattr(obj, part, None)
        out[name] = "missing" if obj is None else hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
    return out


def install() -> None:
    """Install the speed-up; raises RuntimeError if Triton's interpreter is not the pinned one."""
    from triton.runtime import interpreter as interp

    if getattr(interp.InterpretedFunction, "_workbench_memo", False):
        return   # installed already (tests/subprocess_site/sitecustomize.py in this process)
    got = _source_hashes(interp)
    changed = {k: v for k, v in got.items() if v != PINNED[k]}
    if changed:
        raise RuntimeError(
            f"tests/interpreter_patch.py: Triton's interpreter internals changed ({sorted(changed)}; triton "
            f"{__import__('triton').__version__}). Re-check the module docstring's reasoning against the new source "
            f"and update PINNED, or set WORKBENCH_PLAIN_INTERPRETER=1 to run without the speed-up.")
    langs_of_interest = (interp.tl, interp.tl.core)

    def langs(fn) -> frozenset[int]:
        # the modules `_patch_lang(fn)` would patch (the same test as Triton's own)
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs_of_interest)

    # Per thread (Triton's patching is process-wide; a thread's launch runs its helpers on that thread), the modules
    # patched so far in each launch in progress, innermost last.
    state = threading.local()
    grid_call = interp.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        if self.pre_run_hooks:
            return grid_call(self, *args, **kwargs)
        stack = state.__dict__.setdefault("launches", [])
        stack.append(set(langs(self.fn)))   # what the launch's own `_patch_lang(self.fn)` patches first
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper_call(self, *args, **kwargs):
        # This is a device function call (Triton's body, with the re-patch skipped where it would change nothing)
        stack = state.__dict__.get("launches")
        needed = langs(self.fn)
        if not (stack and needed <= stack[-1]):
            interp._patch_lang(self.fn)
            if stack:
                stack[-1] |= needed
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    np_dtype, known = interp._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, interp.tl.block_type) else tt_dtype
        if isinstance(scalar, interp.tl.pointer_type):   # a pointer, or a block of them: one answer (uint64)
            scalar = "pointer"
            if scalar not in known:
                known[scalar] = np_dtype(tt_dtype)
        elif scalar not in known:
            known[scalar] = np_dtype(scalar)
        return known[scalar]

    interp._get_np_dtype = get_np_dtype
    interp._convert_float = fast_convert_float(interp._convert_float, interp.tl)
    interp.interpreter_builder.options = dataclasses.replace(interp.interpreter_builder.options,
                                                             sanitize_overflow=False)
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper_call
    interp.InterpretedFunction._workbench_memo = True


def fast_convert_float(convert, tl):
    """`convert` (Triton's `_convert_float`) with the shortcut of the module docstring: the same bits, the same
    dtype and shape."""
    import numpy as np

    # (input dtype, output dtype) -> (the input's bits, the magnitude mask, the smallest normal's pattern, the shift);
    # filled at the first call: a process's start-up (tests/subprocess_site) installs this while triton.language is
    # still being imported.
    shortcuts = {}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if not shortcuts:
            shortcuts.update({(tl.bfloat16, tl.float32): (np.uint16, 0x7FFF, 1 << 7, 16),
                              (tl.float32, tl.bfloat16): (np.uint32, 0x7FFFFFFF, 1 << 23, -16)})
        how = shortcuts.get((input_dtype, output_dtype))
        if how is None or (how[3] < 0 and rounding_mode is not None):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        bits_dtype, magnitude_mask, smallest_normal, shift = how
        bits = np.frombuffer(input.tobytes(), dtype=bits_dtype)
        magnitude = bits & magnitude_mask
        if ((magnitude > 0) & (magnitude < smallest_normal)).any():
            return convert(input, input_dtype, output_dtype, rounding_mode)
        out = bits.astype(np.uint32) << shift if shift > 0 else (bits >> -shift).astype(np.uint16)
        return out.reshape(input.shape)

    convert_float.triton = convert
    return convert_float
