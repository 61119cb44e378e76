"""Shared checks for the kernel tests."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import subprocess

import torch


def random_gpu_model(shape: str = "qwen3-1.7B", seed: int = 0):
    """A bf16 model of a real shape with random weights drawn on the GPU (N(0, 0.02), norms at 1): the CPU draw of
    `build` takes minutes at this size."""
    from workbench.models import build

    m = build(shape, device="meta", dtype=torch.bfloat16, seed=None).to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return m


def logprobs_off(generate, by: float = 1e-3):
    """`generate` with every completion's sampled log-probs moved by `by`: what a broken generator kernel hands the
    parity check."""
    def off(*args, **kw):
        out = generate(*args, **kw)
        for c in out.completions:
            c.sampled_logprobs += by
        return out
    return off


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype, on_gpu: bool) -> float:
    """Relative-norm tolerance vs fp64: fp32 results, or one bf16 rounding (two in the interpreter, which truncates)."""
    if dtype == torch.float32:
        return 2e-5
    return 6e-3 if on_gpu else 1.2e-2


def take_rows(args: tuple, row_args: tuple[int, ...], index) -> tuple:
    return tuple(a[index] if i in row_args else a for i, a in enumerate(args))


def pad_rows(args: tuple, row_args: tuple[int, ...], before: int, after: int) -> tuple:
    """Zero rows around the batch (token ids 0)."""
    out = []
    for i, a in enumerate(args):
        if i in row_args:
            z = torch.zeros((1, *a.shape[1:]), dtype=a.dtype, device=a.device)
            a = torch.cat([z.expand(before, *a.shape[1:]), a, z.expand(after, *a.shape[1:])])
        out.append(a)
    return tuple(out)


def forward_backward(fn, args: tuple, grad_args: tuple[int, ...], upstream=None, seed: int = 7):
    """Output and the gradients of sum(out * G), G fixed random (or given as `upstream`)."""
    args = tuple(
        a.detach().clone().requires_grad_(True) if i in grad_args else a for i, a in enumerate(args)
    )
    out = fn(*args)
    if not grad_args:
        return out.detach(), []
    g = upstream
    if g is None:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.double() * g.to(out.device).double()).sum().backward()
    return out.detach(), [args[i].grad for i in grad_args]


def check_against_fp64(op, args: tuple, on_gpu: bool) -> None:
    """The op's output and every gradient against its fp64 reference, within the dtype's tolerance."""
    out, grads = forward_backward(op.invariant, args, op.grad_args)
    if not out.is_floating_point() or op.contract == "exact":  # token ids, copies, the record: the same bits
        assert torch.equal(out, op.reference(*args).to(out.device)), f"{op.name} forward"
        return
    ref_args = tuple(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    ref, ref_grads = forward_backward(op.reference, ref_args, op.grad_args)
    # A fused op rounds where its unfused ops do: two or three roundings in a row.
    # The inputs' dtype sets the tolerance: fp32 log-probs of bf16 logits carry the logits' rounding.
    dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), out.dtype)
    tol = tolerance(dtype, on_gpu) * (2 if op.contract == "the unfused ops' bits" else 1)
    assert rel_err(out, ref) < tol, f"{op.name} forward: {rel_err(out, ref):.3g} vs fp64"
    for i, g, rg in zip(op.grad_args, grads, ref_grads):
        assert g.dtype == args[i].dtype, f"{op.name}: grad of arg {i} has dtype {g.dtype}"
        assert rel_err(g, rg) < 3 * tol, f"{op.name}: grad of arg {i}: {rel_err(g, rg):.3g} vs fp64"


class PagedSim:
    """A toy of vLLM's KV-cache manager: per-layer page pools (NaN-poisoned, page ids handed out in a
    random order) and flattened steps over several sequences, for `DecodingModel.hidden_states_paged`
    and `attention_paged`."""

    def __init__(self, layers: int, n_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 device="cpu", dtype=torch.bfloat16, seed: int = 0):
        shape = (n_pages, page_size, kv_heads, head_dim)
        self.pages = [(torch.full(shape, float("nan"), device=device, dtype=dtype),
                       torch.full(shape, float("nan"), device=device, dtype=dtype)) for _ in range(layers)]
        self.free = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.page_size, self.device = page_size, device
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]):
        """(input_ids [N], positions [N], PagedKVCache) for these (sequence, new tokens) chunks."""
        from workbench.models.transformer import PagedKVCache

        ids, pos, slots, cu, kv = [], [], [], [0], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.page_size < start + len(tokens):
                table.append(self.free.pop())
            for i, t in enumerate(tokens):
                p = start + i
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.page_size] * self.page_size + p % self.page_size)
            self.lens[seq] = start + len(tokens)
            cu.append(cu[-1] + len(tokens))
            kv.append(self.lens[seq])
        width = max(len(self.tables[s]) for s, _ in chunks)
        table = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        as_t = lambda x, dt: torch.tensor(x, device=self.device, dtype=dt)  # noqa: E731
        cache = PagedKVCache(self.pages, as_t(cu, torch.int32), as_t(kv, torch.int32), as_t(table, torch.int32),
                             as_t(slots, torch.int64), max(len(t) for _, t in chunks))
        return as_t(ids, torch.long), as_t(pos, torch.long), cache


def same_bits(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, tensors compared as bytes (NaN and -0.0 as bits)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_bits, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    return a == b


def same_completions(a, b) -> bool:
    """Two lists of `Completion`s: the same tokens, finish reasons and log-probs, bit for bit."""
    def fields(cs):
        return [(c.tokens, c.finish_reason, c.logprobs, c.sampled_logprobs) for c in cs]
    return same_bits(fields(a), fields(b))


def once_per_run(tmp_path_factory, name: str, compute):
    """compute(folder)'s value, computed once for the whole pytest run: the first xdist worker to ask computes it
    (into `folder`, under a lock) and saves it there; a worker that asks later loads it (one that asks meanwhile
    waits, no longer than computing it itself would take). A session fixture is otherwise set up once per worker,
    and a module fixture again at each of xdist's switches between modules (conftest's longest-first order makes
    them frequent). Under xdist the workers' base folders share a parent that is this run's own; alone, the
    session's base."""
    import os

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / name
    with FileLock(f"{folder}.lock"):
        if not (folder / "value.pt").exists():
            folder.mkdir(exist_ok=True)
            torch.save(compute(folder), folder / "value.pt")
    return torch.load(folder / "value.pt", weights_only=False)


@functools.cache
def _head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no-git"


def seed_for(salt: object = "", bound: int = 2**31) -> int:
    """The seed of a randomised test, in [0, bound): fixed by HEAD's commit, pytest's current test and `salt` (to
    draw several in one test), so a failure reproduces on rerun and CI is not red at random; a fresh one each call
    under WORKBENCH_RANDOM_SEEDS=1 (a scheduled job's hunt for rare failures). Put it in every failure message."""
    if os.environ.get("WORKBENCH_RANDOM_SEEDS") == "1":
        return random.SystemRandom().randrange(bound)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    digest = hashlib.sha256(f"{_head()}:{test}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % bound
