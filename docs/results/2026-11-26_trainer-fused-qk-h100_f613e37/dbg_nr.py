import sys, torch
from workbench.kernels import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, mode
nr = sys.modules["workbench.kernels.norm_rope"]
rn = sys.modules["workbench.kernels.rmsnorm"]
g = torch.Generator().manual_seed(1)
b, t, h, d = 4, 1024, 16, 128
x = (torch.randn(b, t, h, d, generator=g) * 3).cuda().bfloat16()
for wname, w in (("ones", torch.ones(d).cuda().bfloat16()), ("rand", ((torch.randn(d, generator=g) * 0.2).bfloat16() + 1).cuda())):
    pos = torch.randint(0, 4096, (b, t), generator=g).cuda()
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 1e6, device="cuda"))
    with mode("invariant"):
        out, rstd = nr._forward(x, w, cos, sin, 1e-6)
        y, _, rstd2 = rn._forward(x.contiguous(), w, 1e-6, None)
        ref = apply_rope(y.view(x.shape), cos, sin)
        # norm only: norm_rope with cos=1, sin=0
        n1, _ = nr._forward(x, w, torch.ones_like(cos), torch.zeros_like(sin), 1e-6)
    print(wname, "rstd equal", torch.equal(rstd.view(-1), rstd2), "rstd diff count", (rstd.view(-1) != rstd2).sum().item())
    print(wname, "norm-only equal", torch.equal(n1, y.view(x.shape)), (n1 != y.view(x.shape)).sum().item())
    dif = (out != ref)
    print(wname, "out differ", dif.sum().item(), "of", out.numel())
    if dif.any():
        i = dif.nonzero()[0].tolist()
        print(" first", i, out[tuple(i)].item(), ref[tuple(i)].item())
        # which half
        print(" first-half diffs", dif[..., :64].sum().item(), "second-half", dif[..., 64:].sum().item())
