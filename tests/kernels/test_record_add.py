"""`record_add`, the decode step's bookkeeping in one kernel: the PyTorch form's results exactly (fresh random
records, rows in any order, some already done, several stop tokens), in the interpreter and on a GPU (at a decode
batch of 256)."""

import pytest
import torch

from helpers import seed_for
from workbench.kernels.record import record_add, record_add_reference


def check_record_add(device, b=37, n=9, n_stop=3, salt=0):
    seed = seed_for(salt)
    g = torch.Generator().manual_seed(seed)
    size = b + 5                                        # the record holds more requests than the step's rows
    state = (torch.randint(0, 50, (size, n), generator=g), torch.randn(size, n, generator=g),
             torch.randn(size, n, generator=g), torch.randint(0, n, (size,), generator=g),
             torch.rand(size, generator=g) < 0.3)
    rows = torch.randperm(size, generator=g)[:b]
    column = torch.tensor(int(torch.randint(0, n, (), generator=g)))
    tok = torch.randint(0, 50, (b,), generator=g)
    lp, slp = torch.randn(b, generator=g), torch.randn(b, generator=g)
    stop = torch.randint(0, 50, (n_stop,), generator=g)
    tok[::4] = stop[-1]                                 # some rows hit a stop token for sure
    args = [t.to(device) for t in (rows, column, tok, lp, slp, stop)]
    mine = [t.clone().to(device) for t in state]
    theirs = [t.clone().to(device) for t in state]
    record_add(*mine, *args)
    record_add_reference(*theirs, *args)
    for name, a, w in zip(("tokens", "raw", "sampled", "n_out", "done"), mine, theirs):
        assert torch.equal(a, w), f"seed {seed}: {name} differs from the PyTorch form"
    assert bool(mine[4][rows[::4]].all()), f"seed {seed}: a row that drew a stop token is not done"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_record_add_is_the_pytorch_form(device):
    for i in range(3):
        check_record_add(device, salt=i)
    if device == "cuda":
        check_record_add(device, b=256, n=40, n_stop=2)


@pytest.mark.parametrize("device", DEVICES)
def test_one_row_and_one_stop_token(device):
    check_record_add(device, b=1, n=4, n_stop=1)
