"""Compile-only (no GPU): a plain Triton TMA product [64, K] x [K, BN] for sm90 with num_ctas = C, and count the
PTX's multicast TMA loads. `python triton_num_ctas.py C BN`."""
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def kernel(a_desc, b_desc, c_desc, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    off_n = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([0, kk * BLOCK_K])
        b = tl.trans(b_desc.load([off_n, kk * BLOCK_K]))
        acc = tl.dot(a, b, acc)
    c_desc.store([0, off_n], acc.to(tl.bfloat16))


ctas, bn = int(sys.argv[1]), int(sys.argv[2])
sig = {"a_desc": "tensordesc<bf16[64,128]>", "b_desc": f"tensordesc<bf16[{bn},128]>",
       "c_desc": f"tensordesc<bf16[64,{bn}]>", "K": "i32",
       **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K"), "constexpr")}
src = ASTSource(fn=kernel, signature=sig, constexprs={"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": 128})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_ctas": ctas, "num_warps": 4, "num_stages": 4}).asm["ptx"]
loads = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
print("ctas", ctas, "BN", bn, "multicast lines:", sum(".multicast::cluster" in line for line in loads),
      "tma loads:", len(loads), "wgmma:", ptx.count("wgmma.mma_async"))
for line in loads:
    print("  ", line[:150])
print(re.findall(r"\.reqnctapercluster[^\n]*|\.explicitcluster", ptx))
