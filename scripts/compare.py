#!/usr/bin/env python3
"""Ratio table and busbw chart from a peer_bench results JSON.

usage: compare.py results.json out.md out.png [--title T] [--producer SCRIPT]
                  [--fresh results-fresh.json]

For every cell (op, world, size) it compares rdist's default transport
against the best peer of all, and rdist with TCP forced against the best
TCP peer. Ratios are speedups: peer time / rdist time (> 1 means rdist is
faster), all from the same run. With --fresh, a second table from a run
whose calls each write their input first (peer_bench.py --fresh).
"""
import json
import sys

TCP_PEERS = {"gloo-native", "openmpi-tcp-c", "mpich-tcp-c", "torch-gloo", "openmpi-tcp", "mpich-tcp"}


def human(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B" if n else "-"


KEEP_MARKER = "<!-- scripts/compare.py keeps everything from this line on. -->"


def cells_of(data):
    cells = {}
    for r in data["records"]:
        key = (r["op"], r["world"], r.get("bytes", 0))
        cells.setdefault(key, {})[r["peer"]] = r["t_med_s"]
        if r.get("far"):
            FAR.add((key, r["peer"]))
    return cells


# (cell, peer) whose figure comes only from launches made while the machine's
# cores were far apart (peer_bench.py's core_trip): marked in the tables.
FAR = set()


def table(cells):
    """The ratio table's rows, and the cells where rdist is behind."""
    lines = [
        "| op | ranks | size | rdist | best peer | speedup | rdist-tcp | best TCP peer | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    misses = []
    for (op, world, size) in sorted(cells, key=lambda k: (k[0], k[1], k[2])):
        c = cells[(op, world, size)]
        row = [op, str(world), human(size)]
        for mine, pool in (("rdist", lambda p: not p.startswith("rdist")),
                           ("rdist-tcp", lambda p: p in TCP_PEERS)):
            others = {p: t for p, t in c.items() if pool(p)}
            if mine not in c or not others:
                row += ["n/a", "n/a", "n/a"]
                continue
            best = min(others, key=others.get)
            ratio = others[best] / c[mine]
            far = lambda p: " (far)" if ((op, world, size), p) in FAR else ""
            row += [f"{c[mine] * 1e6:.1f} us{far(mine)}", f"{best} {others[best] * 1e6:.1f} us{far(best)}",
                    f"**{ratio:.2f}**" if ratio >= 1 else f"{ratio:.2f}"]
            if ratio < 1:
                misses.append(f"{mine} {op} {world} ranks {human(size)}: {ratio:.2f}x of {best}"
                              + (" (a figure from far-apart cores only)" if far(mine) or far(best) else ""))
        lines.append("| " + " | ".join(row) + " |")
    return lines, misses


def main():
    src, out_md, out_png = sys.argv[1:4]
    opts = dict(zip(sys.argv[4::2], sys.argv[5::2]))
    title = opts.get("--title", "rdist vs. peers on this machine")
    producer = opts.get("--producer", "scripts/compare.sh")
    data = json.load(open(src))
    cells = cells_of(data)
    lines = [
        f"# {title} ({data['meta'].get('date', '')}, {data['meta'].get('cpu') or 'CPU unknown'}, "
        f"{data['meta'].get('nproc', '?')} cores)",
        "",
        f"Produced by `{producer}` from one run of `bench/peers/peer_bench.py` (same timing",
        "method for every library: median of batches, slowest rank). Speedup = best peer's time / rdist's",
        "time: above 1.00 rdist is faster. `rdist` is the default transport (shared memory on one host),",
        "`rdist-tcp` forces TCP (the cross-host path) and is compared with the TCP peers only;",
        f"TCP congestion control: {data['meta'].get('tcp_congestion_control', 'not recorded')}.",
        "Every call sends the same buffers, written once before the first call and unchanged since:",
        "a library that copies straight out of the sender's memory then finds them in its own caches",
        "(see the second table).",
        "A figure marked (far) comes only from launches made while the machine's cores were far",
        "apart (a cache line's trip 2.5x the quietest, `bench/peers/core_trip.c`): no ratio to trust.",
        "",
    ]
    rows, misses = table(cells)
    lines += rows
    lines += ["", f"Cells where rdist is slower than the best peer: {len(misses)}", ""]
    lines += [f"- {m}" for m in misses]
    if "--fresh" in opts:
        fresh = json.load(open(opts["--fresh"]))
        rows, fmisses = table(cells_of(fresh))
        lines += [
            "",
            f"## Data just made ({fresh['meta'].get('date', '')}, `peer_bench.py --fresh`)",
            "",
            "The same comparison where every call's input is written first, as a program's data is",
            "just made before it goes out (the write is timed with the call, for every library alike;",
            "gloo-native does not write its input and sits this one out). Large messages here show what",
            "a training program sees; the table above rewards reading a buffer that did not change.",
            "",
        ]
        lines += rows
        lines += ["", f"Cells where rdist is slower than the best peer: {len(fmisses)}", ""]
        lines += [f"- {m}" for m in fmisses]
    lines += ["", "![allreduce busbw vs size](busbw.png)", ""]
    # The hand-written part of the page (how rdist gets there, dated
    # measurements) follows the marker and is kept from run to run.
    kept = ""
    try:
        old = open(out_md).read()
        if KEEP_MARKER in old:
            kept = old[old.index(KEEP_MARKER):]
    except FileNotFoundError:
        pass
    open(out_md, "w").write("\n".join(lines) + "\n" + (kept or KEEP_MARKER + "\n"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("compare.py: matplotlib missing, no chart", file=sys.stderr)
        return
    # A panel per world measured, up to four (the smallest and largest kept).
    worlds = sorted({w for (op, w, s) in cells if op == "allreduce"})
    if len(worlds) > 4:
        worlds = [worlds[0], worlds[len(worlds) // 3], worlds[2 * len(worlds) // 3], worlds[-1]]
    if not worlds:
        return
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    # One color per peer in both panels (a peer may be missing from one).
    everyone = sorted({p for c in cells.values() for p in c})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {p: palette[i % len(palette)] for i, p in enumerate(everyone)}
    for ax, world in zip(axes, worlds):
        peers = sorted({p for (op, w, s), c in cells.items() if op == "allreduce" and w == world for p in c})
        for p in peers:
            pts = sorted((s, s / t / 1e9 * (2 * (world - 1) / world)) for (op, w, s), c in cells.items()
                         if op == "allreduce" and w == world and p in c for t in [c[p]] if s > 0)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p, color=color[p],
                        linewidth=2.5 if p.startswith("rdist") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"allreduce float32 sum, {world} ranks")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("busbw (GB/s)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    main()
