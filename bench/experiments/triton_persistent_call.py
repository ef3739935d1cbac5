# experiment (session 12): the list schedule with a fixed grid of PER_SM programs per SM, each looping over the due
# list (p = pid, pid + grid, ...), so that a sparse flush launches no programs that only find nothing to do. At 1/16 of
# 256 x 32 due those 7,680 programs were still starting 5.3 us after the last due one had ended, and with nothing due
# they take 8.5 us (parity_tests/gpu_runs/2026-11-30_s12_call2_fixed_time.log). Session 7 looped the same way with the
# flush inlined into the loop, and LLVM hoisted the program's index arithmetic out of it (spills 244 -> 500-800 B, +14 %
# all due); here the flush of one pair is a call (`@triton.jit(noinline=True)`), which nothing is hoisted across.
# Writes copies of leapquant_triton/kernel.py, for the sweep (bench/experiments/triton_sweep.py), whose
# flush_pool takes the list schedule at every size: kp_call.py (the flush of one pair a call) and kp_inline.py (the
# same loop, inlined, as session 7's), kp_steal.py (the call, pairs after the first taken from a counter), and prints
# the sweep command.
# Usage: PYTHONPATH=$PWD python bench/experiments/triton_persistent_call.py [OUT_DIR]   (default .device)
import os
import sys

from bench.experiments.triton_ablations import edit

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "leapquant_triton", "kernel.py")
PER_SM = 2  # programs at once per SM at 128 registers x 256 threads

LIST_FROM = "    if LIST:\n        pid = tl.program_id(0)\n"
LIST_TO = "        o_scr = pid.to(tl.int64) * SCR\n"
LOOP = '''    if LIST:
        # a fixed grid (flush_pool: at most PER_SM programs per SM); program pid flushes due pairs pid, pid + grid, ...
        pid = tl.program_id(0)
        if PDL:
            gdc_wait()  # the due list is complete and visible
        n_due = tl.load(work)
        p = pid
        while p < n_due:  # (a while loop: Triton 3.6's interpreter takes no tensor bounds in range)
            i_sh = tl.load(work + 1 + p)  # int32 (slot HV + head < N HV): a 32-bit division, not a 64-bit one
            i_s = i_sh // HV
            i_h = i_sh - i_s * HV
            _flush_one(p.to(tl.int64) * SCR, i_h, i_s.to(tl.int64), i_sh.to(tl.int64), codes, skv, uq, kbuf, ubuf,
                       w, pcum, gbuf, q0, scratch, scratch16, SS, K, V, L, R, BL, BR, ITERS, IS_KDA, BF16_DOTS)
            p += tl.num_programs(0)
'''
# the grid schedule's branch after it stays as it is; its call of _flush_one, after the two branches, moves into it
CALL, CALL_END = "\n    _flush_one(o_scr, i_h, i_s, i_sh,", "               L, R, BL, BR, ITERS, IS_KDA, BF16_DOTS)\n"
INDENT = [(CALL, CALL.replace("\n", "\n    ")), (CALL_END, "    " + CALL_END)]
GRID = "        self.grid = (N * g.heads,) if schedule == \"list\" else (N, g.heads)\n"
GRID_NEW = ("        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == \"cuda\" "
            f"else 2\n        self.grid = (min(N * g.heads, {PER_SM} * sms),) if schedule == \"list\" "
            "else (N, g.heads)\n")
SCHEDULE = "    schedule = schedule or schedule_for(N, g.heads)\n"
IMPORTS = [("from .backend import", "from leapquant_triton.backend import"),
           ("from .launcher import", "from leapquant_triton.launcher import")]


# kp_steal: after its first pair, a program takes the next one from a counter (an atomic add), so that programs
# that finish early take more pairs (round robin gives every program 31 or 32 pairs all due, whatever they cost); the
# due list moves to work[2:] and the zeroing covers work[1], the counter
STEAL = [("    tl.store(work + 1 + base + tl.cumsum", "    tl.store(work + 2 + base + tl.cumsum"),
         ("            i_sh = tl.load(work + 1 + p)", "            i_sh = tl.load(work + 2 + p)"),
         ("            p += tl.num_programs(0)\n",
          "            p = tl.num_programs(0) + tl.atomic_add(work + 1, 1, sem=\"relaxed\")\n"),
         ("        self.work_words = 1 + N * g.heads", "        self.work_words = 2 + N * g.heads"),
         ("        work[:1].zero_()", "        work[:2].zero_()")]


def variant(text: str, call: bool, steal: bool = False) -> str:
    text = edit(text, IMPORTS + INDENT + [(GRID, GRID_NEW), (SCHEDULE, "    schedule = schedule or \"list\"\n")]
                + ([("@triton.jit\ndef _flush_one(", "@triton.jit(noinline=True)\ndef _flush_one(")] if call else []))
    a, b = text.index(LIST_FROM), text.index(LIST_TO) + len(LIST_TO)
    return edit(text[:a] + LOOP + text[b:], STEAL if steal else [])


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".device"
    os.makedirs(out, exist_ok=True)
    with open(SRC) as f:
        src = f.read()
    for name, call, steal in (("kp_call", True, False), ("kp_inline", False, False), ("kp_steal", True, True)):
        with open(os.path.join(out, name + ".py"), "w") as f:
            f.write(variant(src, call, steal))
    print(f"SWEEP_PARITY_ROWS=24 python bench/experiments/triton_sweep.py -:-:list -:-:file:{out}/kp_call.py "
          f"-:-:file:{out}/kp_inline.py -:-:file:{out}/kp_steal.py")


if __name__ == "__main__":
    main()
