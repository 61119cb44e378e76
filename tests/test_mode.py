import threading

import pytest
import torch

from workbench.kernels import REGISTRY, get_mode, linear, mode, set_mode
from workbench.kernels import matmul as mm


def test_default_is_invariant_and_context_restores():
    assert get_mode() == "invariant"
    with mode("standard"):
        assert get_mode() == "standard" and get_mode("linear") == "standard"
        with mode("invariant", linear="standard"):
            assert get_mode("linear") == "standard" and get_mode("rms_norm") == "invariant"
        assert get_mode("linear") == "standard"
    assert get_mode("linear") == "invariant"


def test_override_keeps_the_current_default():
    with mode("standard"), mode(rms_norm="invariant"):
        assert get_mode("linear") == "standard" and get_mode("rms_norm") == "invariant"


def test_set_mode_then_back():
    set_mode("standard", entropy="invariant")
    try:
        assert get_mode("linear") == "standard" and get_mode("entropy") == "invariant"
    finally:
        set_mode("invariant")
    assert get_mode("entropy") == "invariant"


def test_modes_are_per_thread():
    seen = {}

    def worker():
        seen["thread"] = get_mode()

    with mode("standard"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["thread"] == "invariant"


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="unknown kernel mode 'fast'"):
        with mode("fast"):
            pass
    with pytest.raises(ValueError, match="unknown op 'matmul'"):
        set_mode("invariant", matmul="standard")
    with pytest.raises(ValueError, match="for op 'linear'"):
        set_mode("invariant", linear="exact")


def test_mode_picks_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(mm, "linear_standard", lambda x, w, b=None: calls.append("standard") or x @ w.t())
    monkeypatch.setattr(mm, "linear_invariant", lambda x, w, b=None: calls.append("invariant") or x @ w.t())
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with mode("standard"):
        linear(x, w)
    with mode("standard", linear="invariant"):
        linear(x, w)
    linear(x, w)
    assert calls == ["standard", "invariant", "invariant"]


def test_the_switch_names_the_registrys_mode_switch_ops_alone():
    from workbench.kernels.mode import OPS

    assert set(OPS) == {n for n, op in REGISTRY.items() if op.mode_switch}, "mode.OPS derives from the registry"
    for op in REGISTRY.values():
        assert callable(op.invariant) and callable(op.reference)
        assert isinstance(op.tile_config(), dict)
    with pytest.raises(ValueError, match="unknown op 'logsumexp'"):  # it follows token_logprobs' switch
        with mode("invariant", logsumexp="standard"):
            pass


def test_a_capped_mps_share_is_refused_in_invariant_mode(monkeypatch):
    """Invariant bits need the whole GPU (a capped share changed them on an H200): one line, and standard runs."""
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")
    with pytest.raises(RuntimeError, match="invariant kernels need the whole GPU.*=25"):
        with mode("invariant"):
            pass
    with mode("standard"):
        assert get_mode() == "standard"
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    with mode("invariant"):
        assert get_mode() == "invariant"
