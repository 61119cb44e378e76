"""Weight sync across processes: the trainer's source rank broadcasts its bf16 weights into every receiving
rank's model, then every rank's digest is compared with the source's.

The weights travel as one byte stream: every tensor of the model, in name order, viewed as bytes and cut into
flat buckets of `bucket_bytes` (a tensor may span buckets, so every bucket but the last is full). Bytes, not
values, so the receivers get the source's exact bits whatever the dtype. Two bucket buffers alternate: the
source packs bucket i + 1 while bucket i is on the wire, and a receiver copies bucket i into its weights (one
`copy_` per tensor piece) while bucket i + 1 arrives; nothing larger than two buckets is ever allocated, never a
full-model copy. The buffers live on the model's device (GPU memory over NCCL, CPU over gloo).

Before the payload, every rank's header (the version, the byte count and a hash of the names, shapes and dtypes)
is all-gathered, so a rank whose model has another layout is named before any byte moves, and every rank raises
the same error instead of some ranks blocking in a broadcast. The version travels from the source: a receiver
learns which update its weights are.

The check after the sync is a digest per tensor, computed where the weights are and all-gathered (one small
tensor per rank, one host transfer): the sum of the tensor's bits read as int16 words, and the sum of its rows'
word sums weighted by the row index. Any single changed element changes the first; swapped rows change the
second. It is a checksum, not a hash: `weights_equal` (both copies on one device) stays the bitwise check.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Bytes per bucket: large enough that NCCL runs near its bandwidth, small enough that the two buffers (512 MiB)
fit beside a generator's KV cache."""

_ROW_WEIGHT_MODULUS = 65521
"""Row weights are 1 + (row mod this prime), below 2**16: with int16 words below 2**15, a tensor's weighted sum
stays below 2**62 (no int64 overflow) up to 2**31 words, a 4 GiB tensor."""

_Piece = tuple[torch.Tensor, int, int, int]  # (a tensor's byte view, its first byte, its end byte, bucket offset)


@dataclass(frozen=True)
class SyncResult:
    """What one weight sync did, the same on every rank of the group."""

    version: int
    """The source's weight version (updates applied), now every rank's."""
    bytes: int
    """Payload bytes each receiver got."""
    buckets: int
    """Broadcasts the payload took."""
    seconds: float
    """Wall time of the broadcast and the copies into the weights (device work finished)."""
    check_seconds: float
    """Wall time of the digest check (0 when it was skipped)."""


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a sync moves: the model's state dict in name order, each storage once (tied weights move under
    their first name), detached views sharing the model's memory."""
    out, seen = [], set()
    for name, t in sorted(model.state_dict().items()):
        if type(t) is not torch.Tensor:
            raise ValueError(f"{name} is a {type(t).__name__}, not a plain tensor: a sharded (FSDP2/DTensor) model "
                             "cannot be broadcast as is; broadcast from a model holding the full weights")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous; the sync copies weights as flat bytes")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def _matching(name: str, like: torch.Tensor, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """weights[name], to send in the place of the model's `like`. No error here, on the source alone, where the
    receivers already wait in the header exchange: a missing tensor (empty in its place) or another shape or dtype
    changes the source's layout hash, which every rank then reports alike."""
    t = weights.get(name)
    return torch.empty(0, dtype=like.dtype, device=like.device) if t is None else t.contiguous().to(like.device)


def _layout_hash(named: list[tuple[str, torch.Tensor]]) -> int:
    text = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"the model's weights are on several devices {sorted(map(str, devices))}; a sync moves one "
                         "device's weights")
    return devices.pop() if devices else torch.device("cpu")


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if not dist.is_initialized():
        raise RuntimeError("a weight broadcast needs a process group: call workbench.distributed.launch.init() "
                           "under torchrun first")
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def _gather(x: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> torch.Tensor:
    """x from every rank of the group, stacked in group order (all_gather with a list: gloo and NCCL both)."""
    out = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out, x, group=group)
    return torch.stack(out)


def _exchange_header(named: list[tuple[str, torch.Tensor]], version: int | None, src: int,
                     group: dist.ProcessGroup | None) -> int:
    """All-gathers every rank's (version, bytes, layout); raises on every rank alike if a layout differs from the
    source's or the source has no version. Returns the source's version."""
    ranks = _group_ranks(group)
    if src not in ranks:
        raise ValueError(f"source rank {src} is not in the sync's group {ranks}")
    nbytes = sum(t.nbytes for _, t in named)
    mine = torch.tensor([-1 if version is None else version, nbytes, _layout_hash(named)], dtype=torch.int64,
                        device=_device(named))
    headers = _gather(mine, group, len(ranks)).cpu().tolist()
    theirs = headers[ranks.index(src)]
    if theirs[0] < 0:
        raise ValueError(f"weight sync: source rank {src} passed no version (or a negative one); the source "
                         "passes the number of updates its weights have, the receivers None")
    differ = [r for r, h in zip(ranks, headers) if h[1:] != theirs[1:]]
    if differ:
        raise ValueError(f"weight sync (version {theirs[0]}): ranks {differ} hold a model of another layout "
                         f"(names, shapes or dtypes) than source rank {src} ({theirs[1]} bytes); build every "
                         "rank's model from the same config, in the same dtype")
    return theirs[0]


def _buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[list[_Piece], int]]:
    """The byte stream cut into buckets: (pieces, bytes used) per bucket."""
    pieces: list[_Piece] = []
    used = 0
    for _, t in named:
        view = t.reshape(-1).view(torch.uint8)
        pos = 0
        while pos < view.numel():
            n = min(view.numel() - pos, bucket_bytes - used)
            pieces.append((view, pos, pos + n, used))
            pos, used = pos + n, used + n
            if used == bucket_bytes:
                yield pieces, used
                pieces, used = [], 0
    if pieces:
        yield pieces, used


def _pack(pieces: list[_Piece], buf: torch.Tensor) -> None:
    for view, start, end, at in pieces:
        buf[at:at + end - start].copy_(view[start:end])


def _unpack(pieces: list[_Piece], buf: torch.Tensor) -> None:
    for view, start, end, at in pieces:
        view[start:end].copy_(buf[at:at + end - start])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def broadcast_weights(model: nn.Module, version: int | None = None, *, src: int = 0,
                      group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      check: bool = True, weights: Mapping[str, torch.Tensor] | None = None) -> SyncResult:
    """Every rank of `group` (default: all) calls this with its own model of the same layout: rank `src` sends its
    weights and its `version` (the updates they hold), every other rank (version=None) receives them in place.
    `weights` (the source only): send these tensors, by the model's names, instead of the model's own (a version the
    source keeps beside its model: a policy lag's older weights).
    With `check`, the digests are compared afterwards (`verify_weights`). A layout mismatch is a ValueError, a
    digest mismatch a RuntimeError, raised on every rank alike."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    named = named_weights(model)
    if weights is not None:
        named = [(n, _matching(n, t, weights)) for n, t in named]
    device = _device(named)
    t0 = time.perf_counter()
    version = _exchange_header(named, version, src, group)
    sending = dist.get_rank() == src
    buckets = list(_buckets(named, bucket_bytes))
    nbytes = sum(t.nbytes for _, t in named)
    bufs = [torch.empty(min(bucket_bytes, nbytes), dtype=torch.uint8, device=device)
            for _ in range(min(2, len(buckets)))]
    works: list = [None] * len(buckets)

    def post(i: int) -> None:
        pieces, used = buckets[i]
        buf = bufs[i % len(bufs)][:used]
        if sending:
            _pack(pieces, buf)
        works[i] = dist.broadcast(buf, src=src, group=group, async_op=True)

    with torch.no_grad():
        for i in range(len(bufs)):
            post(i)
        for i in range(len(buckets)):
            # The buffer of bucket i is free again (sent, or copied out) only after this wait: the next post reuses it.
            works[i].wait()
            if not sending:
                _unpack(buckets[i][0], bufs[i % len(bufs)][:buckets[i][1]])
            if i + len(bufs) < len(buckets):
                post(i + len(bufs))
    _synchronize(device)
    seconds = time.perf_counter() - t0
    check_seconds = 0.0
    if check:
        t1 = time.perf_counter()
        _compare_digests(named, version, src, group)
        check_seconds = time.perf_counter() - t1
    return SyncResult(version=version, bytes=nbytes, buckets=len(buckets), seconds=seconds,
                      check_seconds=check_seconds)


def weights_digest(model: nn.Module) -> torch.Tensor:
    """[tensors, 2] int64 on the weights' device, in `named_weights` order: per tensor, the sum of its bits read as
    int16 words (int8 for 1-byte dtypes), and the sum of its rows' word sums weighted by 1 + row index (mod a
    prime). Exact integer sums, so equal bits give equal digests on every device."""
    return digest(named_weights(model))


def digest(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """`weights_digest` of any named tensors (each contiguous, all on one device), in the order given."""
    rows = []
    for _, t in named:
        words = t.reshape(-1).view(torch.int8 if t.element_size() == 1 else torch.int16)
        n_rows = t.shape[0] if t.dim() > 1 and t.numel() > 0 else 1
        per_row = words.reshape(n_rows, -1).sum(1, dtype=torch.int64)
        weight = torch.arange(n_rows, device=t.device, dtype=torch.int64).remainder_(_ROW_WEIGHT_MODULUS).add_(1)
        rows.append(torch.stack([per_row.sum(), (per_row * weight).sum()]))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack(rows)


def verify_weights(model: nn.Module, version: int | None = None, *, src: int = 0,
                   group: dist.ProcessGroup | None = None) -> int:
    """Checks that every rank of `group` holds the weights of rank `src` (every rank calls it; the source passes
    its version, the others None): the layouts, then the digests are all-gathered and compared. A mismatch raises
    the same error on every rank, naming the ranks and the first differing tensors. Returns the source's version."""
    named = named_weights(model)
    version = _exchange_header(named, version, src, group)
    _compare_digests(named, version, src, group)
    return version


def _compare_digests(named: list[tuple[str, torch.Tensor]], version: int, src: int,
                     group: dist.ProcessGroup | None) -> None:
    ranks = _group_ranks(group)
    digests = _gather(digest(named), group, len(ranks)).cpu()
    ref = digests[ranks.index(src)]
    bad = {r: [named[i][0] for i in torch.nonzero((d != ref).any(1)).flatten().tolist()]
           for r, d in zip(ranks, digests) if not torch.equal(d, ref)}
    if bad:
        first = {r: names[:3] for r, names in bad.items()}
        raise RuntimeError(f"weight sync (version {version}): ranks {sorted(bad)} hold other bits than source rank "
                           f"{src} after the sync (first differing tensors per rank: {first}); the transport or a "
                           "receiver's copy changed them. Run the sync again; if the same ranks fail again, take "
                           "their GPUs out of the job (a memory or link fault) before training on.")
