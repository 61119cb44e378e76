"""Compile-only (no GPU): the decode product in Gluon with a cluster of C CTAs, x's [64, BK] tile in a shared layout
that every CTA holds whole (a zero CGA basis), each CTA its own BN_CTA rows of the weights. Counts the PTX's
multicast TMA loads. `python gluon_product.py C BN_CTA [mc]`, under triton 3.6.0 or 3.7.1 (`PYTHONPATH`).
- triton >= 3.7: x's tile loaded with `multicast=True` when the third argument is `mc`, the barriers laid out per
  CTA (`allocate_mbarrier`), each expecting its own CTA's bytes.
- triton 3.6: its API has no `multicast`; one barrier a stage, expecting the cluster's bytes.
Not a kernel to run: no CTA waits for its peers before a stage is reloaded, which a multicast load into the peers'
shared memory would need."""
import re
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, fence_async_shared
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

C = int(sys.argv[1])            # CTAs a cluster
BN_CTA = int(sys.argv[2])       # columns a CTA
MC = len(sys.argv) > 3 and sys.argv[3] == "mc"
NEW_API = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)
BM, BK, STAGES = 64, 128, 4
BN = BN_CTA * C


def bases(n, dim_size, dim, rank=2):
    # CTA bases splitting `dim` over n CTAs (log2 n bases, in units of a CTA's share of the dimension)
    out, k = [], 1
    while k < n:
        b = [0] * rank
        b[dim] = k
        out.append(b)
        k *= 2
    return out


A_CGA = [[0, 0]] * (C.bit_length() - 1)         # x's tile: every CTA holds the whole of it (broadcast)
B_CGA = bases(C, BN, 0)                         # the weights' [BN, BK]: each CTA its BN/C rows
ACC_CGA = bases(C, BN, 1)                       # the accumulator [BM, BN]: each CTA its BN/C columns

# The two APIs' helpers are chosen here, not under a constexpr `if`: triton hashes a kernel by resolving every
# name it uses, so a 3.7-only name fails under 3.6 even in a branch that is never compiled.
if NEW_API:
    @gluon.jit
    def alloc_bars(STAGES: gl.constexpr):
        return mbarrier.allocate_mbarrier(batch=STAGES)

    @gluon.jit
    def load_x(a_desc, k, bar, dest, MULTICAST: gl.constexpr):
        tma.async_copy_global_to_shared(a_desc, [0, k], bar, dest, multicast=MULTICAST)
else:
    @gluon.jit
    def alloc_bars(STAGES: gl.constexpr):
        return gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

    @gluon.jit
    def load_x(a_desc, k, bar, dest, MULTICAST: gl.constexpr):
        tma.async_copy_global_to_shared(a_desc, [0, k], bar, dest)


@gluon.jit
def kern(a_desc, b_desc, c_desc, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
         ACC_LAYOUT: gl.constexpr, MULTICAST: gl.constexpr, BYTES: gl.constexpr):
    off_n = gl.program_id(0) * BN
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    bars = alloc_bars(STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    n_k = gl.cdiv(K, BK)
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), BYTES)
        load_x(a_desc, i * BK, bars.index(i), a_s.index(i), MULTICAST)
        tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], bars.index(i), b_s.index(i))
    acc = gl.zeros([BM, BN], gl.float32, ACC_LAYOUT)
    phase = 0
    for k in range(n_k):
        s = k % STAGES
        mbarrier.wait(bars.index(s), phase)
        acc = warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), acc)
        nxt = k + STAGES
        if nxt < n_k:
            mbarrier.expect(bars.index(s), BYTES)
            load_x(a_desc, nxt * BK, bars.index(s), a_s.index(s), MULTICAST)
            tma.async_copy_global_to_shared(b_desc, [off_n, nxt * BK], bars.index(s), b_s.index(s))
        if s == STAGES - 1:
            phase ^= 1
    c_s = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_s.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [0, off_n], c_s)
    tma.store_wait(0)


def shared(cga):
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=cga)


acc_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN_CTA, 16],
                                  cga_layout=ACC_CGA)
sig = {"a_desc": f"tensordesc<bf16[{BM},{BK}],{shared(A_CGA)!r}>",
       "b_desc": f"tensordesc<bf16[{BN},{BK}],{shared(B_CGA)!r}>",
       "c_desc": f"tensordesc<bf16[{BM},{BN}],{shared(ACC_CGA)!r}>", "K": "i32",
       **dict.fromkeys(("BM", "BN", "BK", "STAGES", "ACC_LAYOUT", "MULTICAST", "BYTES"), "constexpr")}
# The bytes each barrier waits for: its own CTA's under 3.7's per-CTA barriers, the cluster's under 3.6's one.
nbytes = (BM * BK + (BN_CTA if NEW_API else BN) * BK) * 2
src = GluonASTSource(fn=kern, signature=sig, constexprs=dict(BM=BM, BN=BN, BK=BK, STAGES=STAGES, ACC_LAYOUT=acc_l,
                                                             MULTICAST=MC, BYTES=nbytes))
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_ctas": C, "num_warps": 4})
ptx = out.asm["ptx"].splitlines()
loads = [line.strip() for line in ptx if "cp.async.bulk.tensor" in line]
print(triton.__version__, "C", C, "BN/CTA", BN_CTA,
      "multicast lines:", sum(".multicast::cluster" in line for line in loads),
      "tma loads:", sum("global.mbarrier" in line for line in loads),
      "wgmma:", sum("wgmma.mma_async" in line for line in ptx))
for line in loads:
    print("  ", line[:160])
print(re.findall(r"\.reqnctapercluster[^\n]*", out.asm["ptx"]), "smem", out.metadata.shared)
