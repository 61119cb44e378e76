"""Wrong inputs get an error that says what is wrong."""

import pytest
import torch

from workbench.kernels import (apply_rope, entropy, linear, rms_norm, rope_cos_sin, rope_inv_freq, silu_mul,
                               token_logprobs)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("mode_name", ["invariant", "standard"])
def test_linear_errors(mode_name):
    from workbench.kernels import mode

    with mode(mode_name):
        with pytest.raises(ValueError, match="last dimension must equal weight's K = 8"):
            linear(rand(3, 7), rand(5, 8))
        with pytest.raises(TypeError, match="dtype torch.float16"):
            linear(rand(3, 8, dtype=torch.float16), rand(5, 8, dtype=torch.float16))
        with pytest.raises(TypeError, match="one dtype per call"):
            linear(rand(3, 8), rand(5, 8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="must be 2-D"):
            linear(rand(3, 8), rand(5, 8, 1))
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            linear([[1.0]], rand(1, 1))


def test_rms_norm_errors():
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(rand(8, 6).t(), rand(8))
    with pytest.raises(ValueError, match="weight must be 1-D of x's last dimension"):
        rms_norm(rand(4, 6), rand(5))
    with pytest.raises(ValueError, match="eps must be a positive number"):
        rms_norm(rand(4, 6), rand(6), eps=0.0)
    with pytest.raises(TypeError, match="torch.int64"):
        rms_norm(torch.ones(4, 6, dtype=torch.int64), rand(6))


def test_silu_mul_errors():
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(rand(4, 6), rand(4, 7))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_mul(rand(6, 4).t(), rand(6, 4).t())


def test_rope_errors():
    cos, sin = rope_cos_sin(torch.arange(5), rope_inv_freq(8, 10000.0))
    with pytest.raises(TypeError, match="fp32 tensor"):
        apply_rope(rand(5, 2, 8), cos.bfloat16(), sin)
    with pytest.raises(ValueError, match=r"shape \(5, 4\)"):
        apply_rope(rand(5, 2, 8), cos[:4], sin[:4])
    with pytest.raises(ValueError, match="even head_dim"):
        apply_rope(rand(5, 2, 7), cos, sin)
    with pytest.raises(TypeError, match="positions must be integers"):
        rope_cos_sin(torch.arange(5).float(), rope_inv_freq(8, 10000.0))
    with pytest.raises(ValueError, match="not supported; supported: default, linear, llama3"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_logprob_errors():
    logits = rand(3, 10)
    with pytest.raises(ValueError, match=r"tokens must have shape \(3,\)"):
        token_logprobs(logits, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64 or int32"):
        token_logprobs(logits, torch.zeros(3))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"):
        token_logprobs(logits, torch.tensor([0, 10, 2]))
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.int64), temperature=0.0)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        entropy(rand(10, 3).t())


def test_masked_vocabulary_and_temperature():
    """-inf logits (a masked vocabulary) are exact zeros of probability; T scales the logits."""
    logits = rand(4, 700)
    logits[:, 300:] = float("-inf")
    tokens = torch.randint(0, 300, (4,))
    for t in (1.0, 0.7):
        lp = token_logprobs(logits, tokens, temperature=t)
        ref = torch.log_softmax(logits[:, :300].double() / t, -1).gather(-1, tokens[:, None])[:, 0]
        assert torch.allclose(lp.double(), ref, atol=1e-5)
        ent = entropy(logits, temperature=t)
        p = torch.softmax(logits[:, :300].double() / t, -1)
        assert torch.allclose(ent.double(), -(p * p.log()).sum(-1), atol=1e-5)
    x = logits.clone().requires_grad_(True)
    (token_logprobs(x, tokens) + entropy(x)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, 300:] == 0).all()


def test_strided_weight_and_in_place_outputs():
    """A strided RMSNorm weight gives the right answer; log-prob outputs may be modified in place."""
    x, wbig = rand(5, 8), rand(16)
    ref = rms_norm(x, wbig[::2].contiguous())
    assert torch.equal(rms_norm(x, wbig[::2]), ref)
    logits = rand(3, 40).requires_grad_(True)
    lp = token_logprobs(logits, torch.tensor([1, 2, 3]))
    lp.mul_(2)
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_silu_mul_up_gradient_uses_the_forward_rounding():
    g, u = rand(4, 300, dtype=torch.bfloat16), rand(4, 300, dtype=torch.bfloat16)
    g.requires_grad_(True)
    u.requires_grad_(True)
    out = silu_mul(g, u)
    dout = torch.ones_like(out)
    out.backward(dout)
    s = (g.detach().float() / (1 + torch.exp(-g.detach().float()))).bfloat16().float()
    assert torch.allclose(u.grad.float(), s, rtol=0, atol=2 ** -7 * s.abs().max().item())


def test_nested_overrides_merge():
    from workbench.kernels import get_mode, mode

    with mode("invariant", linear="standard"), mode(rms_norm="standard"):
        assert get_mode("linear") == "standard" and get_mode("rms_norm") == "standard"
        assert get_mode("silu_mul") == "invariant"
    with mode("invariant", linear="standard"), mode("standard"):
        assert get_mode("linear") == "standard" and get_mode("rms_norm") == "standard"


def test_attention_length_and_head_errors():
    from workbench.kernels import attention, attention_with_cache

    q, k = rand(2, 5, 2, 16), rand(2, 5, 1, 16)
    with pytest.raises(ValueError, match=r"seq_lens` must lie in \[0, 5\]"):
        attention(q, k, k, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="must be a multiple"):
        attention(rand(2, 5, 3, 16), k.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1))
    with pytest.raises(ValueError, match="power of two"):
        attention(rand(2, 5, 2, 12), rand(2, 5, 1, 12), rand(2, 5, 1, 12))
    with pytest.raises(ValueError, match=r"kv_len` must lie in \[0, 5\]"):
        attention_with_cache(q[:, :1], k, k, torch.tensor([0, 1]), torch.tensor([1, 9]))
