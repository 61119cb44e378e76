"""The seccomp filter of every sandboxed child: system calls no solution needs, which reach kernel state shared
beyond the run (keyrings), make new namespaces or mounts, or open large kernel attack surface, fail with EPERM.

The filter is built once in the trainer with libseccomp's Python binding (the `seccomp` module Debian ships as
python3-seccomp, else `pyseccomp` from PyPI, the same API over ctypes) and exported as BPF; the child loads
those bytes with prctl before any untrusted code runs (child.py `load_filter`). Where neither binding nor
libseccomp is there, `bpf` is None and one line at start-up says so.
"""

from __future__ import annotations

import errno
import functools
import tempfile
import warnings

DENIED = (
    # Keyrings are per user and outlive a run: a key left by one run is read by a later one of the same uid.
    "add_key", "keyctl", "request_key",
    # Another process's memory, namespaces and mounts (the jail is made before the filter is loaded).
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root",
    "open_tree", "move_mount", "fsopen", "fsmount",
    # Large kernel surfaces no solution needs.
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # Anonymous shared memory outside every tmpfs cap and outside RLIMIT_AS (where no memory cgroup counts it).
    "memfd_create", "memfd_secret",
)
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
"""clone's namespace flags (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME): clone with any
of them is denied like unshare. clone3 passes its flags in memory, which seccomp cannot read, so it answers
ENOSYS and the C library falls back to clone (as under Docker's default profile)."""


def _binding():
    try:
        import seccomp
    except ImportError:
        try:
            import pyseccomp as seccomp
        except (ImportError, OSError, AttributeError):  # OSError/AttributeError: no libseccomp to load
            return None
    return seccomp


@functools.cache
def bpf() -> bytes | None:
    """The filter as BPF (struct sock_filter items), or None where it cannot be built (said once)."""
    seccomp = _binding()
    if seccomp is None:
        warnings.warn("sandbox: no seccomp filter (neither python3-seccomp nor pyseccomp with libseccomp is "
                      "installed): keyrings, namespaces, ptrace, bpf, io_uring and memfd stay open to sandboxed "
                      "code; pip install pyseccomp", stacklevel=2)
        return None
    deny = seccomp.ERRNO(errno.EPERM)
    flt = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED:
        try:
            flt.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):  # a call this architecture or libseccomp does not know
            continue
    for flag in _CLONE_NEW:
        flt.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()
