"""Summarise Nsight Compute's SASS source page of one kernel launch, to compare two kernels
instruction by instruction (how bsattn's forward was set against FlashAttention-4's on
2026-12-03: bench/RESULTS.md, 06:45 UTC).

On the GPU machine, per kernel (one launch, the same row for both):

    ncu --clock-control none --set full -k regex:NAME --launch-skip N -c 1 -o REP python3 ...
    ncu -i REP.ncu-rep --page source --csv --print-source sass > NAME.sass.csv

then anywhere:

    python3 bench/gpu/sass_profile.py A.sass.csv [B.sass.csv] [--per N] [--loop] [--wavefronts]

For each file: warp instructions executed by opcode (absolute, and per N units of work with
--per, e.g. N = consumer-warp routes), stall samples by opcode, and the instructions grouped by
how often they ran (a loop body runs once per iteration, so its instructions share one count:
the steady-state loop is the largest group by samples). --loop prints that group in address order
with runs of one opcode folded, to see where the waits sit among the GEMMs and the softmax.
With two files the opcode table has both columns. --wavefronts: shared-memory wavefronts by
instruction (the page's "L1 Wavefronts Shared" column; wgmma operand reads included, TMA traffic
not), per --per units: the shared-memory port moves one 128-byte wavefront per cycle, so their sum
per unit of work is a floor on its cycles (how the backward's step was priced on 2026-12-03,
bench/RESULTS.md 16:02).
"""
import argparse
import collections
import csv
import re
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(src):
    """The opcode with its modifiers, a predicate stripped: "@!P0 LDS.64 ..." -> "LDS.64"."""
    return re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split(" ")[0]


def page_rows(path):
    """({column name: index}, the instruction rows) of a source page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return {h: i for i, h in enumerate(rows[head])}, [r for r in rows[head + 1:] if len(r) == len(rows[head])]


def read(path):
    """Rows of the source page: (address, opcode, source text, executed, samples)."""
    col, rows = page_rows(path)
    return [(r[0], opcode(r[col["Source"]]), r[col["Source"]].strip(), num(r[col["Instructions Executed"]]),
             num(r[col["Warp Stall Sampling (All Samples)"]])) for r in rows]


def shared_wavefronts(path):
    """{opcode with modifiers: (wavefronts, executed)} from the "L1 Wavefronts Shared" column ({}
    when the page has none)."""
    col, rows = page_rows(path)
    if "L1 Wavefronts Shared" not in col:
        return {}
    acc = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        w = num(r[col["L1 Wavefronts Shared"]])
        if w > 0:
            acc[opcode(r[col["Source"]])][0] += w
            acc[opcode(r[col["Source"]])][1] += num(r[col["Instructions Executed"]])
    return dict(acc)


def by_opcode(rows):
    """{base opcode: (executed, samples)}: HGMMA.64x128x16.F32.BF16 counts as HGMMA."""
    acc = collections.defaultdict(lambda: [0.0, 0.0])
    for _, op, _, n, s in rows:
        acc[op.split(".")[0]][0] += n
        acc[op.split(".")[0]][1] += s
    return acc


def groups(rows):
    """Instructions grouped by execution count (to 2 significant digits): [(count, rows)]."""
    acc = collections.defaultdict(list)
    for r in rows:
        if r[3] > 0:
            acc[float(f"{r[3]:.2g}")].append(r)
    return sorted(acc.items(), key=lambda kv: -sum(x[4] for x in kv[1]))


def fold(rows):
    """Runs of one opcode folded: [(address, opcode, run length, samples)]."""
    out = []
    for addr, op, _, _, s in sorted(rows, key=lambda r: int(r[0], 16)):
        key = op if op.split(".")[0] in ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "MEMBAR", "FENCE") else op.split(".")[0]
        if out and out[-1][1] == key:
            out[-1][2] += 1
            out[-1][3] += s
        else:
            out.append([addr, key, 1, s])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--per", type=float, default=0.0, help="also print instructions per this many units of work")
    p.add_argument("--top", type=int, default=30, help="opcodes listed")
    p.add_argument("--loop", action="store_true", help="print the largest group (the steady loop) in order")
    p.add_argument("--wavefronts", action="store_true", help="shared-memory wavefronts by instruction")
    args = p.parse_args(argv)
    data = [read(f) for f in args.files]
    ops = [by_opcode(d) for d in data]
    totals = [sum(v[0] for v in o.values()) for o in ops]
    for f, d, t in zip(args.files, data, totals):
        samples = sum(r[4] for r in d)
        print(f"{f}: {t / 1e6:.1f} M warp instructions, {samples:.0f} stall samples")
    names = sorted(set().union(*ops), key=lambda k: -max(o[k][0] if k in o else 0 for o in ops))[:args.top]
    print("opcode        " + "".join(f"{'M executed':>12}{'per unit':>10}{'samples':>9}" for _ in ops))
    for k in names:
        cells = ""
        for o in ops:
            n, s = o[k] if k in o else (0.0, 0.0)
            cells += f"{n / 1e6:12.2f}{(n / args.per if args.per else 0):10.1f}{s:9.0f}"
        print(f"{k:14s}{cells}")
    if args.wavefronts:
        for f in args.files:
            waves = shared_wavefronts(f)
            total = sum(w for w, _ in waves.values())
            unit = args.per or 1.0
            print(f"\n{f}: shared-memory wavefronts, {total / unit:.1f} per unit")
            for op, (w, n) in sorted(waves.items(), key=lambda kv: -kv[1][0]):
                print(f"  {op:36s}{w / unit:10.1f} per unit{w / n if n else 0:8.1f} per instruction")
    for f, d in zip(args.files, data):
        print(f"\n{f}: instructions by execution count (largest sample share first)")
        total = sum(r[4] for r in d) or 1.0
        gs = groups(d)
        for count, rs in gs[:8]:
            s = sum(r[4] for r in rs)
            print(f"  ran {count / 1e6:8.3f} M times: {len(rs):5d} instructions, {100 * s / total:5.1f} % of samples")
        if args.loop and gs:
            print(f"\n{f}: the largest group in address order")
            for addr, key, n, s in fold(gs[0][1]):
                print(f"  {addr:>16s} {n:4d} x {key:24s} samples {s:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
