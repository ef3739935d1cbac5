"""Bytes per sequence (``leapquant.memory``, ``python -m leapquant info``) counted by hand from the format, and
README's "Memory per sequence" table against them."""

import re
from pathlib import Path

from leapquant.__main__ import main
from leapquant.memory import checkpoint_bytes, compact_checkpoint_bytes, formats, ring_bytes

README = Path(__file__).resolve().parents[1] / "README.md"


def test_counts_by_hand():
    # KDA 128 x 128, ring 16, rank 4: codes 16,384 + s_k 512 + s_v 512 + factors 2,048; ring kbuf 4,096 + ubuf 4,096
    # + w 64 + pcum 512 + gbuf 4,096 + hcnt 4
    assert checkpoint_bytes(128, 128, 4) == 19456 == compact_checkpoint_bytes(128, 128, 4)
    assert ring_bytes(128, 128, 16, "kda") == 12868 and ring_bytes(128, 128, 16, "gdn") == 8264
    # rounded up to 128 B: K = 128, V = 64, rank 1 needs 8,192 + 512 + 256 + 384 = 9,344 = 73 x 128
    assert checkpoint_bytes(128, 64, 1) == 9344 == compact_checkpoint_bytes(128, 64, 1)
    assert compact_checkpoint_bytes(128, 128, 4) % 128 == 0
    f = {x.name: x for x in formats()}
    assert f["fp32 state"].per_sequence == 32 * 65536
    assert f["LeapQuant, engine layout"].per_sequence == 33 * 65536 + 32 * 12868  # a spare head per slot
    assert f["LeapQuant, compact layout"].per_sequence == 32 * (19456 + 12868)
    assert f["fp32 state"].sequences_in(80) == 40960


def test_readme_table_matches():
    text = README.read_text()
    for fmt in formats():
        row = next((line for line in text.splitlines() if line.startswith(f"| {fmt.name}")), None)
        assert row is not None, f"README has no row for {fmt.name!r}"
        nums = [int(x.replace(",", "")) for x in re.findall(r"\|\s*([\d,]+)\s*(?=\|)", row)]
        assert nums[-3:] == [round(fmt.per_head(32)), fmt.per_sequence, fmt.sequences_in(80)], row


def test_info_prints_the_table(capsys):
    assert main(["info", "--gib", "40", "--gate", "gdn", "--heads", "16"]) == 0
    out = capsys.readouterr().out
    assert "sequences in 40 GiB" in out
    row = next(line for line in out.splitlines() if line.startswith("LeapQuant, compact layout"))
    per_seq = 16 * (19456 + 8264)
    assert row.split()[-2:] == [f"{per_seq:,}", f"{40 * 2**30 // per_seq:,}"]
