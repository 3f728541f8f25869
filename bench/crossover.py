"""Where gradshare's sparse all-gather stops paying as workers grow: bytes per worker per step, from the cost model.

The padded all-gather moves (N-1) * (5 + d P) words per worker, the dense ring allreduce 2 (N-1)/N * P: the
all-gather wins below N ~ 2/d and loses above it (N > 32 for bitmap messages). gradshare's exchange then
takes the dense allreduce for that step (the "sharing" curve is the minimum of the two, plus the lengths
exchange). Writes crossover.png and crossover.json to --out and prints the crossover points.

    timeout 60 python bench/crossover.py --params 3716106 --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from gradshare import costmodel as cm


def curves(params: int, densities, workers):
    out = {"params": params, "workers": list(workers), "dense": [cm.dense_allreduce_bytes(n, params) for n in workers],
           "allgather": {}, "sharing": {}, "crossover": {}}
    for d in densities:
        key = "bitmap" if d >= 1 / 16 else f"{d:g}"
        out["allgather"][key] = [cm.sparse_allgather_bytes(n, params, d) for n in workers]
        out["sharing"][key] = [cm.sharing_bytes(n, params, d) for n in workers]
        out["crossover"][key] = next((n for n in range(2, 10 ** 6) if cm.sharing_uses_dense(n, params, d)), None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=3_716_106, help="parameters (default: bench/e2e_worker MLP)")
    ap.add_argument("--densities", default="1e-4,1e-3,1e-2,1", help="message densities; >= 1/16 means bitmap")
    ap.add_argument("--max-workers", type=int, default=8192)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    workers = sorted({2 ** k for k in range(1, 40) if 2 ** k <= a.max_workers} | {3, 6, 12, 24, 48, 96, 192, 384,
                                                                                      768, 1536, 3072, 6144})
    workers = [n for n in workers if n <= a.max_workers]
    data = curves(a.params, [float(x) for x in a.densities.split(",")], workers)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "crossover.json"), "w") as f:
        json.dump(data, f, indent=1)
    for key, n in data["crossover"].items():
        print(f"density {key:>7}: sparse all-gather moves more than the dense allreduce from N = {n} "
              f"(2/d = {cm.sharing_crossover_workers(1.0 if key == 'bitmap' else float(key)):g})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(workers, data["dense"], "k-", lw=2, label="dense ring allreduce (4P * 2(N-1)/N)")
    for key, ys in data["allgather"].items():
        line, = ax.plot(workers, ys, "--", label=f"all-gather, density {key}")
        ax.plot(workers, data["sharing"][key], "-", color=line.get_color(), alpha=0.5, lw=3)
        n = data["crossover"][key]
        if n:
            ax.axvline(n, color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("bytes sent per worker per step")
    ax.set_title(f"P = {a.params:,}: thick = gradshare (all-gather, dense fallback past the crossover)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(a.out, "crossover.png")
    fig.savefig(path, dpi=110)
    print("wrote", path, os.path.join(a.out, "crossover.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
