"""Compile-only (no GPU): a plain Triton TMA product [64, K] x [K, BN] for sm90 with num_ctas = C, and count the
PTX's multicast TMA loads. `python triton_num_ctas.py C BN`."""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def k(a_desc, b_desc, c_desc, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    off_n = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([0, kk * BLOCK_K])
        b = tl.trans(b_desc.load([off_n, kk * BLOCK_K]))
        acc = tl.dot(a, b, acc)
    c_desc.store([0, off_n], acc.to(tl.bfloat16))

import sys
nctas = int(sys.argv[1]); BN = int(sys.argv[2])
sig = {"a_desc": "tensordesc<bf16[64,128]>", "b_desc": f"tensordesc<bf16[{BN},128]>", "c_desc": f"tensordesc<bf16[64,{BN}]>", "K": "i32",
       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
src = ASTSource(fn=k, signature=sig, constexprs={"BLOCK_M": 64, "BLOCK_N": BN, "BLOCK_K": 128})
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_ctas": nctas, "num_warps": 4, "num_stages": 4})
ptx = out.asm["ptx"]
import re
print("ctas", nctas, "BN", BN, "multicast lines:", sum(".multicast::cluster" in l for l in ptx.splitlines()), "tma loads:", sum("cp.async.bulk.tensor" in l for l in ptx.splitlines()), "wgmma:", sum("wgmma.mma_async" in l for l in ptx.splitlines()))
for l in ptx.splitlines():
    if "cp.async.bulk.tensor" in l: print("  ", l.strip()[:150])
print(re.findall(r"\.reqnctapercluster[^\n]*|\.explicitcluster", ptx))
