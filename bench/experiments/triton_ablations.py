# experiment: where the Triton kernel's time goes, by leaving stages out. Writes copies of
# leapquant_triton/kernel.py with one or more stages removed (for timing only: their results are wrong, and the
# sweep's parity lines for them fail, as they must) into a folder, then prints the sweep command that times them
# beside the kernel itself (bench/experiments/triton_sweep.py, on the GPU machine).
# Usage: python bench/experiments/triton_ablations.py [OUT_DIR]   (default .device)
import os
import sys

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "leapquant_triton", "kernel.py")

# (text of kernel.py, replacement): each must occur exactly once
NO_SUBSPACE = [("    for it in tl.static_range(ITERS):\n        b_q16 = tl.load(p_qt",
                "    for it in tl.static_range(0):\n        b_q16 = tl.load(p_qt")]
NO_CHOLQR = [(("        _cholqr(p_y, p_gram + 32 * it, p_q16, V, R, False)\n"
               "        _cholqr(p_y, p_gram + 32 * it + 16, p_q16, V, R, True)"),
              ("        tl.store(p_q16 + o_v[:, None] * 4 + o_r[None, :], (b_y * 1e-3).to(tl.float16), mask=m_q)\n"
               "        tl.debug_barrier()"))]
NO_RING = [("    b_s = _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS)\n    for c in tl.static_range(1, BL // 16):",
            "    for c in tl.static_range(1, 1):")]
# the quantisation (steps 8-9) is cut out between these two texts
QUANT_FROM, QUANT_TO = "    o_16 = tl.arange(0, 16)\n    if BF16_DOTS:\n", "    # --- 10. store the checkpoint"
NO_QUANT = ["quant"]

VARIANTS = {
    "abl_no_subspace": NO_SUBSPACE,  # no Sn, P, Y, CholeskyQR2: q16 = fp16(Q0)
    "abl_no_cholqr": NO_CHOLQR,  # P and Y kept, q16 = fp16(1e-3 Y)
    "abl_no_ring": NO_RING,  # no ring products (so no ring loads either)
    "abl_no_quant": NO_QUANT,  # no column sums, scales or rounding: codes = int8(E), s_v = 1
    "abl_io_only": NO_SUBSPACE + NO_RING + NO_QUANT,
}


def edit(text, edits):
    for e in edits:
        if e == "quant":
            a, b = text.index(QUANT_FROM), text.index(QUANT_TO)
            text = text[:a] + "    b_sv = tl.full([V], 1.0, tl.float32)\n    b_c = b_s.to(tl.int8)\n\n" + text[b:]
        else:
            old, new = e
            assert text.count(old) == 1, f"not found once in kernel.py: {old[:60]!r}"
            text = text.replace(old, new)
    return text


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".device"
    os.makedirs(out, exist_ok=True)
    # loaded by the sweep as a file outside the package: the one relative import made absolute
    with open(SRC) as f:
        src = f.read().replace("from .backend import", "from leapquant_triton.backend import")
    for name, edits in VARIANTS.items():
        with open(os.path.join(out, name + ".py"), "w") as f:
            f.write(edit(src, edits))
    print("python bench/experiments/triton_sweep.py -:-:list " + " ".join(f"-:-:file:{out}/{n}.py" for n in VARIANTS))


if __name__ == "__main__":
    main()
