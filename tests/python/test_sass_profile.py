"""bench/gpu/sass_profile.py on a hand-made source page: opcode sums, the grouping by execution
count (the loop body is the group with the most stall samples, not the most instructions) and
the folding of opcode runs. No GPU or Nsight Compute needed.

Runs under pytest (tests/python/run.sh) or alone: python3 tests/python/test_sass_profile.py
"""
import csv
import io
import os
import sys
import tempfile
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import sass_profile  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed"]
# (address, source, samples, executed): a prologue run once per warp (8 warps), a 5-instruction
# loop run 1000 times per warp, and a predicated-off branch never run.
ROWS = [
    ("0x100", "S2R R0, SR_TID.X", 30, 8),
    ("0x110", "MOV R1, 0x1", 2, 8),
    ("0x120", "@!P0 BRA 0x400", 0, 0),
    ("0x130", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 40, 8000),
    ("0x140", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR6], R24, gsb0", 10, 8000),
    ("0x150", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 90, 8000),
    ("0x160", "@P1 FMNMX R2, R24, R25, !PT", 5, 8000),
    ("0x170", "FMNMX R2, R2, R26, !PT", 5, 8000),
]


def page(rows, preamble=True):
    """The CSV text ncu writes: a kernel-name line before the header when preamble."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    if preamble:
        w.writerow(["Kernel Name", "some_kernel"])
    w.writerow(HEADER)
    for addr, src, samples, executed in rows:
        w.writerow([addr, src, str(samples), "0", str(samples), f"{executed:,}"])
    return out.getvalue()


def write(text):
    f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    f.write(text)
    f.close()
    return f.name


def test_opcode_sums_strip_predicates_and_modifiers():
    ops = sass_profile.by_opcode(sass_profile.read(write(page(ROWS))))
    assert ops["HGMMA"] == [16000.0, 50.0]
    assert ops["FMNMX"] == [16000.0, 10.0]  # "@P1 FMNMX" counts as FMNMX
    assert ops["WARPGROUP"] == [8000.0, 90.0]
    assert ops["BRA"] == [0.0, 0.0]
    assert sum(v[0] for v in ops.values()) == 8 + 8 + 5 * 8000


def test_loop_body_is_the_group_with_most_samples():
    gs = sass_profile.groups(sass_profile.read(write(page(ROWS))))
    count, rows = gs[0]
    assert count == 8000
    assert [r[0] for r in rows] == ["0x130", "0x140", "0x150", "0x160", "0x170"]
    assert gs[1][0] == 8 and len(gs[1][1]) == 2  # the never-run branch is in no group
    assert len(gs) == 2


def test_fold_keeps_gemm_and_wait_variants_apart_and_merges_runs():
    loop = sass_profile.groups(sass_profile.read(write(page(ROWS))))[0][1]
    folded = sass_profile.fold(list(reversed(loop)))  # address order is restored
    assert [(f[1], f[2], f[3]) for f in folded] == [
        ("HGMMA.64x128x16.F32.BF16", 2, 50.0), ("WARPGROUP.DEPBAR.LE", 1, 90.0), ("FMNMX", 2, 10.0)]


def test_main_prints_both_files():
    a, b = write(page(ROWS)), write(page(ROWS[:2], preamble=False))
    out = io.StringIO()
    with redirect_stdout(out):
        assert sass_profile.main([a, b, "--per", "8000", "--loop"]) == 0
    text = out.getvalue()
    assert f"{a}: 0.0 M warp instructions, 182 stall samples" in text
    assert f"{b}: 0.0 M warp instructions, 32 stall samples" in text
    assert "ran    0.008 M times:     5 instructions" in text
    assert "2 x HGMMA.64x128x16.F32.BF16" in text


def test_shared_wavefronts_by_instruction():
    """The "L1 Wavefronts Shared" column summed by opcode with its modifiers, predicates stripped;
    a page without the column gives nothing."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(HEADER + ["L1 Wavefronts Shared"])
    for addr, src, executed, waves in (("0x100", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 8000, 64000),
                                       ("0x110", "@P0 LDS R3, [R2]", 8000, 8000),
                                       ("0x120", "LDS R4, [R2+0x4]", 8000, 8000),
                                       ("0x130", "STS.128 [R5], R8", 2000, 8000),
                                       ("0x140", "FFMA R1, R2, R3, R4", 8000, 0)):
        w.writerow([addr, src, "0", "0", "0", f"{executed:,}", f"{waves:,}"])
    waves = sass_profile.shared_wavefronts(write(out.getvalue()))
    assert waves == {"HGMMA.64x64x16.F32.BF16": [64000.0, 8000.0], "LDS": [16000.0, 16000.0],
                     "STS.128": [8000.0, 2000.0]}
    assert sass_profile.shared_wavefronts(write(page(ROWS))) == {}
    text = io.StringIO()
    with redirect_stdout(text):
        assert sass_profile.main([write(out.getvalue()), "--per", "1000", "--wavefronts"]) == 0
    assert "shared-memory wavefronts, 88.0 per unit" in text.getvalue()


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    print("ok")
