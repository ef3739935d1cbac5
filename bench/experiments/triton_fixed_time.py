"""Where the time of a sparse flush goes outside its due programs, in a CUDA-graph replay (session 12).

The list schedule's flush is three launches (the zeroing of the due count, the due list, the flush kernel); at 1/16
due the bench's graph replay took 42.4 us (session 10) while the due programs ran from the first one's entry to the
last one's end in 32.4 us (triton_phase_clock.py). This captures, in one graph, a one-program marker kernel that
records ``%globaltimer``, the clock-stamped copy of the flush (triton_phase_clock.variant_module, whose every program,
due or not, records its entry) and a second marker, and replays it after an L2 eviction, KDA 257 x 32 ("realistic"),
with none, 1/16 (512) and all of 256 x 32 programs due. Per case, medians over the replays of:

    marker 1 -> first entry     the zeroing, the due list and the flush's launch, up to its first program
    first entry -> last due end the due programs (their s7: the last stores issued)
    last due end -> last entry  how long programs that are not due still start after the last due one ends
    last entry -> marker 2      the drain: the last stores, the programs' exit, the kernel's end, the marker's launch
    marker 1 -> marker 2        all of it; and the replay's time by events (markers included)

    PYTHONPATH=$PWD python bench/experiments/triton_fixed_time.py
"""

import statistics
import sys

import torch
import triton
import triton.language as tl

import leapquant
from bench.experiments.triton_phase_clock import EXTRA, variant_module
from bench.timing import Evictor, capture
from leapquant.workloads import fill


@triton.jit
def marker_kernel(p, i):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(p + i, t)


def main():
    dev = torch.device("cuda")
    mod = variant_module()
    evict = Evictor(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "the list schedule (forced); medians of 15 graph replays after 3 warm-ups")
    pool = leapquant.Pool(257, 32, gate="kda", device=dev)
    gen = torch.Generator().manual_seed(12)
    fill(pool, torch.arange(1, 257), "realistic", gen)
    saved = {n: getattr(pool, n).clone() for n in ("raw", "w", "pcum", "gbuf")}
    idx = torch.arange(1, 257, dtype=torch.int32, device=dev)
    words = mod.scratch_words(128, 128, 1)
    marks = torch.zeros(2, dtype=torch.int64, device=dev)
    for due in (0, 512, 8192):
        flat = torch.zeros(256 * 32, dtype=torch.bool)
        flat[torch.randperm(256 * 32, generator=gen)[:due]] = True
        pool.hcnt[1:257] = torch.where(flat.reshape(256, 32), 16, 3).to(torch.int32).to(dev)

        def run():
            marker_kernel[(1,)](marks, 0)
            mod.flush_pool(pool, idx, schedule="list")
            marker_kernel[(1,)](marks, 1)

        run()  # compile outside the capture
        replay = capture(run, dev)
        scratch = mod.LAST_SCRATCH  # the captured flush's scratch, which every replay writes
        rows = {k: [] for k in ("head", "due", "tail", "drain", "all", "events")}
        for rep in range(18):  # (stamps read after each replay: bench.timing.time_replays queues them unsynchronised)
            for n, t in saved.items():
                getattr(pool, n).copy_(t)
            evict()
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            replay()
            b.record()
            b.synchronize()
            if rep < 3:
                continue
            tr = scratch.view(-1, words)[:, words - EXTRA:].contiguous().view(torch.int64)[:, :24].cpu()
            m0, m1 = marks.tolist()
            entry = tr[:, 20]  # every program's entry (globaltimer)
            first, last_entry = entry.min().item(), entry.max().item()
            last_due = tr[:due, 19].max().item() if due else first
            rows["head"].append(first - m0)
            rows["due"].append(last_due - first)
            rows["tail"].append(last_entry - last_due)
            rows["drain"].append(m1 - max(last_entry, last_due))
            rows["all"].append(m1 - m0)
            rows["events"].append(a.elapsed_time(b) * 1e6)
        med = {k: statistics.median(v) / 1e3 for k, v in rows.items()}
        print(f"\nKDA 256 x 32, {due} due: marker 1 -> first entry {med['head']:.1f} us | first entry -> last due end "
              f"{med['due']:.1f} us | last due end -> last entry {med['tail']:.1f} us | last entry -> marker 2 "
              f"{med['drain']:.1f} us | marker 1 -> marker 2 {med['all']:.1f} us | replay by events "
              f"{med['events']:.1f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
