"""Offline choice of the row-wise kernels' launch configs (GPU only): the
log-prob forward's vocabulary chunk and warps, its backward block, and the
RMSNorm backward's rows per program. The chosen values are written into the
kernel files by hand; nothing is tuned at run time.

    python tools/tune/tune_rowwise.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))  # bench/timing.py
from timing import copy_gbs, gpu_ms, with_grad  # noqa: E402

from workbench.kernels import logprobs, rmsnorm  # noqa: E402
from workbench.kernels.registry import REGISTRY  # noqa: E402


def _args(name, rows):
    return REGISTRY[name].make_inputs(rows, "real", torch.Generator().manual_seed(0), "cuda", torch.bfloat16)


def main() -> None:
    copy = max(copy_gbs())
    print(f"copy {copy:.0f} GB/s")
    base = dict(logprobs._GPU_CONFIG)
    for rows in (4096, 64):
        nbytes = rows * 151936 * 2
        for chunk, warps in itertools.product((2048, 4096, 8192), (2, 4, 8)):
            logprobs._GPU_CONFIG = dict(base, chunk_v=chunk, forward_num_warps=warps)
            ms = gpu_ms(lambda: (lambda a=_args("token_logprobs", rows): REGISTRY["token_logprobs"].invariant(*a)),
                        nbytes)
            print(f"logprobs fwd rows={rows} chunk={chunk} warps={warps}: {nbytes / ms / 1e6 / copy:.2f} of copy")
    for block, warps in itertools.product((1024, 2048, 4096), (4, 8)):
        logprobs._GPU_CONFIG = dict(base, backward_block_v=block, backward_num_warps=warps)
        nbytes = 4096 * 151936 * 2 * 3
        ms = gpu_ms(lambda: with_grad(REGISTRY["token_logprobs"].invariant, list(_args("token_logprobs", 4096)), (0,)),
                    nbytes)
        print(f"logprobs fwd+bwd block={block} warps={warps}: {nbytes / ms / 1e6 / copy:.2f} of copy")
    logprobs._GPU_CONFIG = base
    for rows_per_prog, tile in ((8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (16, 8), (32, 4), (32, 8)):
        rmsnorm._GPU_BACKWARD = {"rows": rows_per_prog, "tile_rows": tile}
        nbytes = 8192 * 2048 * 2 * 5
        ms = gpu_ms(lambda: with_grad(REGISTRY["rms_norm"].invariant, list(_args("rms_norm", 8192)), (0, 1)), nbytes)
        print(f"rms_norm fwd+bwd rows/program={rows_per_prog} tile={tile}: {nbytes / ms / 1e6 / copy:.2f} of copy")

if __name__ == "__main__":
    main()
