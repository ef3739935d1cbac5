"""Whether Gluon (Triton's explicit-layout language, in the same wheel as Triton: triton.experimental.gluon) builds and
runs the flush's operand path on this GPU (session 12): the [V, K] fp32 state of one program in a blocked layout,
converted to fp16 and stored once into shared memory; then, from that one shared copy, P = Sn^T Q (a transposed view
of the buffer as the A operand) and Y = Sn P (the buffer as the A operand), with ``mma_v2`` (``mma.sync``, fp32
accumulation) at 8 warps. One program per state, 64 states; the products are compared with torch's fp32 products of
the same fp16 operands (P rounded to fp16 between them, as the flush does).

This is the piece of a shared-memory flush that the ``tl`` kernel cannot express (it converts the state into each
product's operand layout separately, and keeps it in registers): a fast path for sm_90 written in Gluon would need no
new dependency. AOT-compiled for sm_90 on the CPU; run on the GPU:

    PYTHONPATH=$PWD python bench/experiments/gluon_smoke.py
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

V, K, BR, NW = 128, 128, 16, 8


@gluon.jit
def products_kernel(s_ptr, q_ptr, p_ptr, y_ptr, V: gl.constexpr, K: gl.constexpr, BR: gl.constexpr,
                    NW: gl.constexpr):
    pid = gl.program_id(0)
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    shared: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])

    o_v = gl.arange(0, V, layout=gl.SliceLayout(1, blk))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, blk))
    o_r = gl.arange(0, BR, layout=gl.SliceLayout(0, blk))
    b_s = gl.load(s_ptr + pid * V * K + o_v[:, None] * K + o_k[None, :])  # [V, K] fp32
    sn = gl.allocate_shared_memory(gl.float16, [V, K], shared, b_s.to(gl.float16))
    b_q = gl.load(q_ptr + o_v[:, None] * BR + o_r[None, :])  # [V, BR] fp16

    # P = Sn^T Q  [K, BR]: the transposed view of the one shared copy as the A operand
    b_p = mma_v2(sn.permute((1, 0)).load(op_a), gl.convert_layout(b_q, op_b), gl.zeros([K, BR], gl.float32, mma))
    # Y = Sn P  [V, BR], P rounded to fp16 between the products
    b_y = mma_v2(sn.load(op_a), gl.convert_layout(b_p.to(gl.float16), op_b), gl.zeros([V, BR], gl.float32, mma))

    b_p = gl.convert_layout(b_p, blk)
    b_y = gl.convert_layout(b_y, blk)
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(1, blk))
    gl.store(p_ptr + pid * K * BR + o_kk[:, None] * BR + o_r[None, :], b_p)
    gl.store(y_ptr + pid * V * BR + o_v[:, None] * BR + o_r[None, :], b_y)


def main() -> int:
    import triton

    dev = torch.device("cuda")
    n = 64
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(n, V, K, generator=gen).to(dev)
    q = (torch.randn(V, BR, generator=gen) / V ** 0.5).to(torch.float16).to(dev)
    p = torch.full((n, K, BR), float("nan"), device=dev)  # poisoned
    y = torch.full((n, V, BR), float("nan"), device=dev)
    products_kernel[(n,)](s, q, p, y, V, K, BR, NW, num_warps=NW)
    torch.cuda.synchronize()
    sn = s.to(torch.float16).float()
    p_ref = sn.transpose(1, 2) @ q.float()
    y_ref = sn @ p_ref.to(torch.float16).float()
    # the sums' order differs from torch's: compare against the products' own scale
    e_p = ((p - p_ref).abs().amax() / p_ref.abs().amax()).item()
    e_y = ((y - y_ref).abs().amax() / y_ref.abs().amax()).item()
    ok = bool(torch.isfinite(p).all() and torch.isfinite(y).all()) and e_p < 1e-5 and e_y < 2e-3
    print(f"gluon smoke ({torch.cuda.get_device_name()}, triton {triton.__version__}): {n} programs, "
          f"max |P - P_ref| / max |P_ref| = {e_p:.2e}, max |Y - Y_ref| / max |Y_ref| = {e_y:.2e} "
          f"(Y within the fp16 rounding of P, whose sums differ in order): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
