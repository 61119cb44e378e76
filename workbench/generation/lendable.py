"""Device memory at fixed addresses that can be lent out: the kept KV caches' pages, handed to the update between
rollouts (`DecodeGraphs.lend`).

A captured decode step reads its KV cache by address, so a cache kept for the next rollout must stay where it is;
held through the update it may not fit beside it (at the 1.7B shape, 256 sequences of 1,152 positions take ~34 GB,
beside the update's fp32 masters, AdamW moments and activations on one 80 GB GPU). The ways considered:

- a fresh cache and fresh graphs every rollout (`keep_graphs=False`): the memory goes back to PyTorch's allocator,
  at the price of a capture per compaction size and step;
- `torch.cuda.MemPool`: the cache allocated in a pool of its own, the update's allocations routed into that pool
  while it is lent, the cache allocated again afterwards. Neither half is promised by the caching allocator: a
  tensor the update makes that outlives it (its metrics, a workspace or table built on first use, AdamW's state
  at its first step) stays in the pool's segments, and its best-fit search may place the new cache elsewhere;
- CUDA's virtual memory API, chosen here: the addresses are reserved once (cuMemAddressReserve) and physical pages
  mapped there (cuMemCreate, cuMemMap) while the generator owns them; lent, the pages are unmapped, which returns
  them to the driver, so the update allocates through PyTorch's allocator as ever, with nothing asked of it.
  Taking them back hands PyTorch's unused cached blocks to the driver (`torch.cuda.empty_cache`) and maps fresh
  pages at the same addresses: every captured graph stays valid, and a shortage is an error, not a silent move.

The contents do not survive a lend (fresh pages hold whatever was there): the generator zeroes the cache a call
reads, as it does on every reuse, and overwrites the compacted ones whole (`DecodeGraphs`). On a CPU the contract is
the same with the buffer's storage shrunk to nothing and grown back (no graph reads an address there), so the
lending logic runs in the CPU tests.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

# The CUDA driver API's values (cuda.h): pinned device memory, located on a device, read-write access, the minimum
# granularity, and CUDA_ERROR_OUT_OF_MEMORY.
_PINNED, _ON_DEVICE, _READ_WRITE, _MINIMUM, _OUT_OF_MEMORY = 1, 1, 3, 0, 2


class _Prop(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("device", ctypes.c_int), ("win32_metadata", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location_type", ctypes.c_int), ("device", ctypes.c_int), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")   # loaded already by PyTorch's CUDA runtime
    u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    for name, args in (("cuMemGetAllocationGranularity", [p(size), p(_Prop), ctypes.c_int]),
                       ("cuMemAddressReserve", [p(u64), size, size, u64, u64]),
                       ("cuMemAddressFree", [u64, size]),
                       ("cuMemCreate", [p(u64), size, p(_Prop), u64]),
                       ("cuMemMap", [u64, size, size, u64, u64]),
                       ("cuMemRelease", [u64]),
                       ("cuMemSetAccess", [u64, size, p(_Access), size]),
                       ("cuMemUnmap", [u64, size]),
                       ("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result == 0:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    message = f"{what} failed: {(name.value or b'?').decode()}"
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{message}; the borrower's tensors must be freed before take_back() (with "
                                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PyTorch can release more)")
    raise RuntimeError(message)


class _Pages:
    """A reserved address range and whether physical pages are mapped at it; freed with its owner (finalizer)."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.mapped = device, False
        self.prop = _Prop(type=_PINNED, location_type=_ON_DEVICE, device=device.index)
        grain = ctypes.c_size_t()
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(grain), ctypes.byref(self.prop), _MINIMUM),
               "cuMemGetAllocationGranularity")
        self.nbytes = -(-nbytes // grain.value) * grain.value
        address = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(address), self.nbytes, 0, 0, 0), "cuMemAddressReserve")
        self.address = address.value

    def map(self) -> None:
        handle = ctypes.c_uint64()
        _check(_driver().cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self.prop), 0),
               f"mapping {self.nbytes / 2**30:.1f} GiB of device memory for the KV cache (cuMemCreate)")
        try:
            _check(_driver().cuMemMap(self.address, self.nbytes, 0, handle.value, 0), "cuMemMap")
        finally:   # the mapping holds the pages from here on; unmapping returns them to the driver
            _check(_driver().cuMemRelease(handle.value), "cuMemRelease")
        self.mapped = True
        access = _Access(location_type=_ON_DEVICE, device=self.device.index, flags=_READ_WRITE)
        _check(_driver().cuMemSetAccess(self.address, self.nbytes, ctypes.byref(access), 1), "cuMemSetAccess")

    def unmap(self) -> None:
        torch.cuda.synchronize(self.device)   # no queued kernel may read the pages after this
        _check(_driver().cuMemUnmap(self.address, self.nbytes), "cuMemUnmap")
        self.mapped = False

    def free(self) -> None:
        if self.mapped:
            self.unmap()
        _check(_driver().cuMemAddressFree(self.address, self.nbytes), "cuMemAddressFree")


class _Span:
    """The address range as a CUDA array (what `torch.as_tensor` wraps without a copy)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


class LendableMemory:
    """`nbytes` of memory on `device` (`tensor`, uint8) whose addresses stay while it is lent (`lend`: the memory
    goes back to the device's free memory, the contents are lost) and taken back (`take_back`: fresh memory at the
    same addresses, contents undefined). Nothing may read or write `tensor` while it is lent."""

    def __init__(self, nbytes: int, device):
        self.device = torch.device(device)
        self.lent = False
        if self.device.type != "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._pages = None
            return
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(self.device)   # the CUDA context exists and is this thread's
        self._pages = _Pages(self.device, nbytes)
        span = _Span(self._pages.address, self._pages.nbytes)
        # Freed with the last tensor that views it (the tensor keeps `span` alive), never under a live view.
        weakref.finalize(span, self._pages.free)
        self._pages.map()
        with torch.cuda.device(self.device):
            self.tensor = torch.as_tensor(span, device=self.device)[:nbytes]
        if self.tensor.data_ptr() != self._pages.address:   # a copy would be memory that lending never frees
            raise RuntimeError("LendableMemory: torch.as_tensor copied the mapped memory instead of viewing it")

    def lend(self) -> None:
        if self.lent:
            raise RuntimeError("LendableMemory.lend: already lent; take_back() first")
        if self._pages is None:
            self.tensor.untyped_storage().resize_(0)
        else:
            self._pages.unmap()
        self.lent = True

    def take_back(self) -> None:
        if not self.lent:
            raise RuntimeError("LendableMemory.take_back: not lent")
        if self._pages is None:
            self.tensor.untyped_storage().resize_(self.tensor.numel())
        else:
            # What the borrower freed is still held by PyTorch's allocator: give it to the driver, then map.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._pages.map()
        self.lent = False
