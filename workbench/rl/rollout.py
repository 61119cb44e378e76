"""One step's rollouts in the losses' layout, and their micro-batches.

`RolloutBatch` holds B sequences (prompt + completion token ids) and, per completion position (column t
is the t-th completion token, right-padded to the longest completion), the generator's log-probs and the
mask of real tokens: the [B, T] contract of `losses.py`.

`micro_batches` cuts any subset of the sequences into forwards of at most `max_tokens` tokens: sorted by
length (longest first, ties by index), taken greedily. Padded, each micro-batch is [b, T] right-padded to its
own longest sequence and the budget counts the padding; packed (`PackedSequences`, what the workbench's own
model runs), its sequences sit end to end in one row [1, N] and the budget counts real tokens only, so no
forward or backward work goes to padding. A sequence longer than the budget gets a micro-batch of its own.
The split is a function of the lengths and the budget only, so a run is reproducible; in `invariant` mode a
token's log-prob does not depend on it at all, nor on the layout (every kernel is batch-invariant, padding is
never read by a real token, and packed attention gives each sequence the padded kernel's bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..models.transformer import PackedSequences


@dataclass
class MicroBatch:
    index: torch.Tensor
    """[b] rows of the RolloutBatch."""
    ids: torch.Tensor
    """[b, T] prompt + completion ids, right-padded; packed: [1, N], the b sequences end to end."""
    lens: torch.Tensor
    """[b] int32 sequence lengths."""
    rows: torch.Tensor
    """[n] the sequence (0..b-1) of each completion token (n = real completion tokens)."""
    positions: torch.Tensor
    """[n] the position whose hidden state predicts the token (its own position - 1); packed: that position's
    column of the row [1, N]."""
    columns: torch.Tensor
    """[n] the token's column in the [b, width] completion layout."""
    targets: torch.Tensor
    """[n] the completion tokens."""
    width: int
    """The longest completion in this micro-batch."""
    packed: PackedSequences | None = None
    """The packed layout of `ids` (cu_seqlens, each token's position), or None: padded."""


@dataclass
class RolloutBatch:
    prompts: list[list[int]]
    completions: list[list[int]]
    behavior: torch.Tensor
    """[B, T] fp32: the generator's log-probs of the tokens it sampled (0 on padding)."""
    mask: torch.Tensor
    """[B, T] fp32: 1 on real completion tokens."""
    pad_id: int

    @classmethod
    def from_generation(cls, prompts: list[list[int]], completions, pad_id: int, device) -> RolloutBatch:
        """From the generator's `Completion`s (each with its `tokens` and `sampled_logprobs`)."""
        width = max(len(c.tokens) for c in completions)
        behavior = torch.zeros(len(completions), width)
        mask = torch.zeros(len(completions), width)
        for i, c in enumerate(completions):
            behavior[i, : len(c.tokens)] = c.sampled_logprobs
            mask[i, : len(c.tokens)] = 1
        return cls([list(p) for p in prompts], [list(c.tokens) for c in completions], behavior.to(device),
                   mask.to(device), pad_id)

    def spread(self, flat: torch.Tensor) -> torch.Tensor:
        """[B, T] fp32 on the batch's device from one value per real completion token, row after row (0 on
        padding)."""
        out = torch.zeros_like(self.mask)
        out[self.mask.bool()] = flat.to(self.device)
        return out

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def device(self) -> torch.device:
        return self.mask.device

    def micro_batches(self, index: torch.Tensor | None, max_tokens: int, packed: bool = False) -> list[MicroBatch]:
        """The rows `index` (default all) cut into micro-batches of at most `max_tokens` tokens: padded ones
        (counting the padding), or packed ones (real tokens only)."""
        return [self._micro_batch(g, packed) for g in self.row_groups(index, max_tokens, packed)]

    def row_groups(self, index: torch.Tensor | None, max_tokens: int, packed: bool = False) -> list[list[int]]:
        """The rows of each micro-batch `micro_batches` cuts (host only: how many there will be, cheaply)."""
        rows = list(range(len(self))) if index is None else [int(i) for i in index]
        length = {i: len(self.prompts[i]) + len(self.completions[i]) for i in rows}
        order = sorted(rows, key=lambda i: (-length[i], i))
        groups, current, tokens = [], [], 0
        for i in order:
            # Longest first: a padded group's width is its first member's length.
            tokens = tokens + length[i] if packed else (len(current) + 1) * length[current[0] if current else i]
            if current and tokens > max_tokens:
                groups.append(current)
                current, tokens = [], length[i]
            current.append(i)
        if current:
            groups.append(current)
        return groups

    @cached_property
    def _padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([B, longest] prompt + completion ids right-padded, [B] prompt lengths, [B] completion lengths) on
        the host, built once: the micro-batches are cut from them with tensor ops (a Python loop over the
        tokens kept the GPU idle; BENCHMARKS.md, "Numbers behind the code")."""
        plen = torch.tensor([len(p) for p in self.prompts], dtype=torch.long)
        clen = torch.tensor([len(c) for c in self.completions], dtype=torch.long)
        ids = torch.full((len(self), int((plen + clen).max())), self.pad_id, dtype=torch.long)
        for i, (p, c) in enumerate(zip(self.prompts, self.completions)):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        return ids, plen, clen

    def _micro_batch(self, rows: list[int], packed: bool) -> MicroBatch:
        all_ids, plen, clen = self._padded
        index = torch.tensor(rows, dtype=torch.long)
        p, n = plen[index], clen[index]
        lens = p + n
        ids = all_ids[index, : int(lens.max())]
        r = torch.repeat_interleave(torch.arange(len(rows)), n)           # each completion token's sequence
        col = torch.arange(len(r)) - torch.repeat_interleave(n.cumsum(0) - n, n)
        pos = p[r] - 1 + col                                                # the position that predicts it
        if packed:   # [1, N]: the sequences end to end; a position's column is its sequence's first token's + it
            first = lens.cumsum(0) - lens
            flat = ids[torch.arange(ids.shape[1])[None, :] < lens[:, None]]
            layout = [torch.cat([first, lens.sum()[None]]),                            # cu_seqlens
                      torch.arange(len(flat)) - torch.repeat_interleave(first, lens)]    # each token's position
            at = first[r] + pos
        else:
            flat, layout, at = ids.flatten(), [], pos
        # One host-to-device copy for all the index tensors, from pinned memory so that it is queued behind the
        # previous micro-batch's backward instead of waiting for it (a copy from pageable memory syncs).
        parts = [index, r, at, col, ids[r, pos + 1], lens, *layout, flat]
        host = torch.cat(parts)
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        else:
            host = host.to(self.device)
        index, r, at, col, tgt, lens_d, *layout, flat = host.split([len(x) for x in parts])
        if not packed:
            return MicroBatch(index, flat.view(ids.shape), lens_d.to(torch.int32), r, at, col, tgt, int(n.max()))
        return MicroBatch(index, flat[None], lens_d.to(torch.int32), r, at, col, tgt, int(n.max()),
                          PackedSequences(layout[0].to(torch.int32), layout[1], ids.shape[1]))
