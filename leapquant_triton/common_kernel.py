"""What the flush, step and states kernels share: the SPEC's constants as compile-time values (a ``@triton.jit``
function can read only constexpr globals) and where a (slot, head) pair's values lie in the pool."""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from leapquant import constants

QMAX = tl.constexpr(constants.QMAX)
EPS = tl.constexpr(constants.EPS)
FLOOR = tl.constexpr(constants.FLOOR)
TINY = tl.constexpr(constants.TINY)
PNMIN = tl.constexpr(constants.PNMIN)
FP16_MAX = tl.constexpr(constants.FP16_MAX)
# adding 1.5 * 2^23 rounds an fp32 |x| <= 2^22 half to even, in the interpreter too (unlike libdevice's rint)
ROUND_MAGIC = tl.constexpr(constants.ROUND_MAGIC)
# its bits: an integer n in the low mantissa bits, as ROUND_MAGIC_BITS + n, is the fp32 ROUND_MAGIC + n
ROUND_MAGIC_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", constants.ROUND_MAGIC))[0])


@triton.jit
def _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg, i_sh, K: tl.constexpr, V: tl.constexpr,
                   L: tl.constexpr, IS_KDA: tl.constexpr):
    """The pair's checkpoint region at word ``o_reg`` (codes as the [V, K] tile, s_k | s_v, uq) and its kbuf, ubuf,
    w, pcum and gbuf rows (row ``i_sh``)."""
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    p_c = codes + o_reg * 4 + o_v[:, None] * K + o_k[None, :]
    return (p_c, skv + o_reg, uq + o_reg * 2, kbuf + i_sh * (L * K), ubuf + i_sh * (L * V), w + i_sh * L,
            pcum + i_sh * (K if IS_KDA else 1), gbuf + i_sh * (L * K))
