"""Numerical constants of the flush (SPEC §1). Every backend uses these values."""

QMAX = 127.0  # int8 code range is [-QMAX, QMAX]
EPS = 1e-12  # floor of the column and row scales
FLOOR = 1e-6  # relative pivot floor of CholeskyQR: L_ii^2 >= FLOOR * G_ii
TINY = 1e-30  # absolute floor of a pivot (a zero column of Y)
PNMIN = 1e-20  # GDN: floor of the cumulative gate product
# step_packed's gates (SPEC §6.2): torch.nn.functional.softplus's threshold, above which softplus(x) is x
SOFTPLUS_THRESHOLD = 20.0
FP16_MAX = 65504.0  # the factors saturate here (SPEC §4)
BASE_WORDS = 12288  # fp32 words before slot 0's region in the pool's raw buffer

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_RINGS = (8, 16, 32)
SUPPORTED_RANKS = (1, 2, 3, 4)
# 1.5 * 2^23: adding it to an fp32 |x| <= 2^22 rounds x half to even and leaves the integer in the low mantissa bits
# (the kernels' quantisation; libdevice's rint differs in the interpreter)
ROUND_MAGIC = 12582912.0
