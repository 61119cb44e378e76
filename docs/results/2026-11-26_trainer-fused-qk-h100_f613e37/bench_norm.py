"""Scratch: q/k norm + rope at 16k tokens, unfused vs fused, configs."""
import sys
import torch
sys.path.insert(0, "bench")
from timing import gpu_ms, copy_gbs
from workbench.kernels import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, mode
from workbench.kernels import norm_rope as nr_mod
nr = sys.modules["workbench.kernels.norm_rope"]
rn = sys.modules["workbench.kernels.rmsnorm"]
print("copy GB/s", max(copy_gbs()))
T = 16384
def make(h, grad, fused):
    def mk():
        x = torch.randn(T, h, 128, device="cuda", dtype=torch.bfloat16) * 3
        w = (torch.randn(128, device="cuda") * 0.2 + 1).bfloat16()
        pos = torch.arange(T, device="cuda") % 1024
        cos, sin = rope_cos_sin(pos, rope_inv_freq(128, 1e6, device="cuda"))
        dout = torch.randn_like(x)
        if grad:
            x.requires_grad_(); w.requires_grad_()
        def f():
            with mode("invariant"):
                y = nr.norm_rope(x, w, cos, sin) if fused else apply_rope(rms_norm(x, w), cos, sin)
                if grad:
                    torch.autograd.backward(y, dout)
        return f
    return mk
for h in (16, 8):
    nb = T * h * 128 * 2
    for grad in (False, True):
        for fused in (False, True):
            ms = gpu_ms(make(h, grad, fused), nb * 3)
            floor = nb * (2 if not grad else 5) / (max(copy_gbs()) * 1e6)
            print(f"h={h} grad={grad} fused={fused}: {ms:.4f} ms (floor {floor:.4f})", flush=True)
# configs
for blk in (1024, 2048, 4096):
    for tiles in (4, 8, 16):
        nr._GPU_BLOCK, nr._GPU_TILES = blk, tiles
        tot = sum(gpu_ms(make(h, True, True), T*h*128*6) for h in (16, 8))
        print(f"fused fwd+bwd q+k block={blk} tiles={tiles}: {tot:.4f} ms", flush=True)
nr._GPU_BLOCK, nr._GPU_TILES = 2048, 8
for tile in (1024, 2048, 4096):
    rn._HEAD_TILE = tile
    for cfg in ({"rows": 64, "tile_rows": 16}, {"rows": 128, "tile_rows": 16}, {"rows": 32, "tile_rows": 8}, {"rows": 64, "tile_rows": 8}):
        rn._GPU_BACKWARD_HEADS = cfg
        tot = 0
        for h in (16, 8):
            def mk(h=h):
                x = (torch.randn(T, h, 128, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
                w = (torch.randn(128, device="cuda") * 0.2 + 1).bfloat16().requires_grad_()
                dout = torch.randn_like(x)
                def f():
                    with mode("invariant"):
                        torch.autograd.backward(rms_norm(x, w), dout)
                return f
            tot += gpu_ms(mk, T*h*128*6)
        print(f"rms_norm heads fwd+bwd fwd_tile={tile} bwd={cfg}: {tot:.4f} ms", flush=True)
