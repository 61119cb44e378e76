"""The fp8-rollout arm (`off-fp8`, generation/fp8.py): W8A8 products with vLLM's default scales, the generator's own
fp8 copy of the weights refreshed at each sync, the trainer's bf16 weights untouched, and a mismatch larger than
the engine `off` arm's."""

from __future__ import annotations

import pytest
import torch

from workbench.generation import SamplingParams, generate
from workbench.generation.fp8 import FP8_MAX, Fp8Linear, Fp8Sampler, fp8_linear, quantize_rows, quantize_weight
from workbench.kernels import FUSED_ROWWISE, mode
from workbench.kernels.quantize_fp8 import MIN_TOKEN_SCALE
from workbench.models import build
from workbench.onoff.arms import ARMS, arm_settings
from workbench.rl.config import TrainConfig
from workbench.rl.sync import WeightSync
from workbench.rl.trainer import train


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def test_fp8_product_is_w8a8_with_vllm_scales():
    """Each output element is the exact product of the codes summed, times the token's and the tensor's scales,
    rounded once; the codes are the e4m3 roundings of x / s_a and W / s_w with vLLM's scales."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 48, generator=g) * torch.logspace(-3, 1, 6)[:, None]).to(torch.bfloat16)
    x[2] = 0   # an all-zero token: vLLM's floor on the scale, zeros out
    w = (torch.randn(32, 48, generator=g) * 0.05).to(torch.bfloat16)
    codes, s_w = quantize_weight(w)
    assert s_w == w.float().abs().max() / FP8_MAX, f"seed {seed}"
    assert codes.float().abs().max() == FP8_MAX, f"seed {seed}: the largest weight maps to 448"
    y = fp8_linear(x, codes, s_w.expand(1, 32).contiguous())
    s_a = (x.float().abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(MIN_TOKEN_SCALE)
    q_a = (x.float() / s_a).to(torch.float8_e4m3fn).double()
    exact = (q_a @ codes.double().t()) * s_a.double() * s_w.double()
    assert torch.equal(y[2], torch.zeros_like(y[2])), f"seed {seed}"
    # One bf16 rounding of an fp32 sum of exact products: within 1 bf16 ulp (2^-8 relative) plus the fp32 sum's.
    assert torch.allclose(y.double(), exact, rtol=2**-8, atol=1e-6), f"seed {seed}"
    full = x.float() @ w.float().t()
    bf16_err = (full.to(torch.bfloat16).float() - full).abs().mean()
    assert (y.float() - full).abs().mean() > 4 * bf16_err, f"seed {seed}: fp8's error should exceed bf16 rounding's"


def test_sampler_holds_its_own_copy_and_leaves_the_trainer_weights():
    source = build("tiny", seed=3)
    before = {k: v.clone() for k, v in source.state_dict().items()}
    fp8 = Fp8Sampler(source)
    layer = fp8.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert layer.self_attn.packed() is not None and layer.mlp.packed() is not None, "q/k/v, gate/up laid out as one"
    # q, k and v share one scale (vLLM quantizes its fused qkv parameter whole), as do gate and up.
    attn = layer.self_attn
    assert torch.equal(attn.q_proj.weight_scale[0, :1], attn.v_proj.weight_scale[0, :1])
    assert not torch.equal(attn.q_proj.weight_scale[0, :1], attn.o_proj.weight_scale[0, :1])
    # The quantized input is shared within a fused parameter's projections: the same values as each alone.
    assert attn.q_proj.group is attn.v_proj.group is not attn.o_proj.group
    x = torch.randn(5, source.config.hidden_size).to(torch.bfloat16)
    attn.q_proj(x)
    assert torch.equal(attn.k_proj(x), fp8_linear(x, attn.k_proj.weight, attn.k_proj.weight_scale))
    pointers = [b.data_ptr() for b in fp8.model.buffers()]
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(1.5)
    moved = {k: v.clone() for k, v in source.state_dict().items()}
    fp8.load(source)
    assert all(torch.equal(moved[k], v) for k, v in source.state_dict().items()), "load wrote to the source"
    assert [b.data_ptr() for b in fp8.model.buffers()] == pointers, "a kept decode graph must read the new codes"
    assert torch.equal(fp8.model.model.embed_tokens.weight, source.model.embed_tokens.weight)
    codes, _ = quantize_weight(source.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(layer.mlp.down_proj.weight.view(torch.uint8), codes.view(torch.uint8))
    assert any(not torch.equal(before[k], moved[k]) for k in before)


def test_sync_refreshes_the_fp8_copy(tmp_path):
    model = build("tiny", seed=0)
    cfg = TrainConfig(kernel_mode="standard", sampler_kernels="engine", sampler_precision="fp8")
    sync = WeightSync(cfg, model, tmp_path, "cpu")
    sync(0)
    assert sync.sampler is sync.fp8.model and sync.generator is model
    down = sync.sampler.model.layers[1].mlp.down_proj
    first = down.weight.clone()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1)
    sync(1)
    assert torch.equal(down.weight.view(torch.uint8), (-first.float()).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_generation_differs_from_bf16_engine_generation():
    """Same prompts, seeds and weights: the fp8 sampler's log-probs move away from the bf16 engine's."""
    model = build("tiny", seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    params = SamplingParams(max_new_tokens=5, seed=2)
    with mode("standard", **FUSED_ROWWISE):
        bf16 = generate(model, prompts, params)
        fp8 = generate(Fp8Sampler(model).model, prompts, params)
    first = torch.stack([c.logprobs[0] for c in bf16.completions])   # the first token: the same prefix on both
    first_fp8 = torch.stack([c.logprobs[0] for c in fp8.completions])
    assert (first - first_fp8).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [{"sampler_kernels": "trainer"}, {"adapter": "lora"}, {"sampler_precision": "fp4"}])
def test_fp8_needs_the_engine_and_full_weights(bad):
    settings = {"kernel_mode": "standard", "sampler_kernels": "engine", "sampler_precision": "fp8", **bad}
    with pytest.raises(ValueError, match="sampler_precision"):
        TrainConfig(**settings)


def test_off_fp8_arm_settings():
    assert ARMS["off-fp8"].sampler_precision == "fp8" and ARMS["off"].sampler_precision == "bf16"
    settings = arm_settings("off-fp8", False)
    assert settings["sampler_kernels"] == "engine" and settings["old_logprobs"] == "sampler"
    TrainConfig(**settings)


def _step1(policy, out, arm: str) -> dict:
    cfg = TrainConfig(policy=policy, out_dir=str(out), steps=1, prompts_per_step=4, group_size=4, max_new_tokens=8,
                      checkpoint_every=1, progress=False, **arm_settings(arm, False))
    return train(cfg).set_index("metric")["value"].to_dict()


@pytest.mark.slow
def test_off_fp8_mismatches_more_than_the_engine_off(policy, tmp_path):
    """Step 1, same policy, prompts and seeds: the fp8 sampler's log-probs are further from the bf16 trainer's than
    the bf16 engine's are (KL per token and mean |Δ|; ~40x and ~3.5x over ~40 tokens when written). Fewer tokens
    (2 x 2 x 4) left the two KLs within noise of each other."""
    off = _step1(policy, tmp_path / "off", "off")
    fp8 = _step1(policy, tmp_path / "fp8", "off-fp8")
    assert fp8["sampler_trainer_kl"] > 5 * off["sampler_trainer_kl"], (fp8, off)
    assert fp8["parity_mean_abs_diff"] > 1.5 * off["parity_mean_abs_diff"], (fp8, off)



def _gpu_policy():
    """SmolLM2-135M-Instruct where it is in the model cache (scripts/device_onoff.sh STEP=model), else the
    Qwen3-1.7B shape with random weights."""
    from workbench.models import load_pretrained
    from workbench.models.hub import FetchError, fetch_model

    try:
        return load_pretrained(fetch_model("smollm2-135m-instruct"), device="cuda"), "smollm2-135m-instruct"
    except FetchError:
        from helpers import random_gpu_model
        return random_gpu_model().pack(), "qwen3-1.7B shape, random weights"


def _k3(sampler: list[torch.Tensor], trainer: list[torch.Tensor]) -> float:
    """KL(sampler || trainer) per sampled token (k3: exp(r) - 1 - r, r = trainer - sampler)."""
    r = torch.cat([t.double().cpu() for t in trainer]) - torch.cat([s.double() for s in sampler])
    return float((torch.exp(r) - 1 - r).mean())


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_fp8_arm_mismatches_more_than_engine_off_and_on_stays_bitwise():
    """64 prompts x 128 tokens on an H200: `on` (invariant) generator and trainer the same bits; the engine `off`
    (bf16) mismatches; `off-fp8` (W8A8 on the fp8 tensor cores, torch._scaled_mm) mismatches more. The fp8
    product agrees with the CPU path's formula up to the fp32 sums' order."""
    from workbench.generation.parity import random_prompts, trainer_logprobs

    model, name = _gpu_policy()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g).to("cuda", torch.bfloat16)
    codes, s_w = quantize_weight(torch.randn(960, 576, generator=g).to("cuda", torch.bfloat16) * 0.05)
    scale = s_w.expand(1, 960).contiguous()
    # The tensor cores against the exact products with fp32 sums on the same quantized inputs. Both round an fp32
    # sum to bf16 in other orders: where a sum cancels, one bf16 ulp of the largest output is the most they can part.
    qa, sa = quantize_rows(x)
    on_cores = fp8_linear(x, codes, scale).float()
    exact = ((qa.float() @ codes.float().t()) * (sa * scale)).to(torch.bfloat16).float()
    assert torch.allclose(on_cores, exact, rtol=2**-7, atol=2**-8 * float(exact.abs().max()))
    prompts = random_prompts(64, model.config.vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=128, seed=0)

    def arm(sampler, kernels):
        with mode(*kernels[0], **kernels[1]):
            out = generate(sampler, prompts, params)
        with mode(kernels[2]):
            scored = trainer_logprobs(model, prompts, [c.tokens for c in out.completions])
        return [c.logprobs for c in out.completions], scored

    gen, train_ = arm(model, (("invariant",), {}, "invariant"))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(gen, train_)), f"{name}: on is not bitwise"
    engine = (("standard",), dict(FUSED_ROWWISE), "standard")
    kl_off = _k3(*arm(model, engine))
    kl_fp8 = _k3(*arm(Fp8Sampler(model).model, engine))
    print(f"{name}: KL per token, engine off {kl_off:.3g}, off-fp8 {kl_fp8:.3g}")
    assert kl_off > 0 and kl_fp8 > 2 * kl_off, (name, kl_off, kl_fp8)
