"""End-to-end comparison of data-parallel exchanges on real (shaped) links: accuracy against wall time and bytes.

Runs every contender (bench/e2e_worker.py: DDP allreduce, DDP fp16, DDP PowerSGD, torch periodic model
averaging, gradshare hook / SharedOptimizer with and without momentum correction, gradshare parameter
averaging, DiLoCo-style and sparse local steps) on every workload (the MNIST CNN and a 3.7M-parameter MLP judged
by test accuracy, the AdamW transformer LM ``char_lm`` of bench/quality.py judged by validation loss) under every link (tc-shaped veth
between network namespaces, bench/netns.py), with the same seed, data order, batch size and epochs.
``--workers`` workers (2 by default), torch threads 1 each. ``--seeds 0,1,2`` repeats everything per seed
and summarises over them. A gradshare contender whose module is missing is skipped with a line saying so.

Reported per contender: time to the target (test accuracy to reach, or for char_lm a validation loss to get down to;
training time only), how much sooner than DDP allreduce, the final metric and its difference from DDP allreduce
with the same seed (points of accuracy, or % of loss), bytes per step and in
total (kernel tx counter of the worker's interface during training, the tc qdisc byte counter over the
whole launch, the contender's own accounting where it has one, and the cost model's prediction), step time
split into compute / encode / communicate. Outputs: results.json (per run and summary), results.md,
accuracy_vs_time.png, bytes_per_step.png in --out.

Needs root (namespaces). Examples (the README's figures come from commands like these):
    timeout 900 python bench/e2e.py --quick --out /tmp/e2e-quick
    timeout 3600 python bench/e2e.py --workloads mnist_cnn --links 100mbit --seeds 0,1,2 --eval-every 50 \\
        --target 0.95 --timeout 400 --out bench/results/mnist_cnn_100mbit
    python bench/e2e.py --workloads char_lm --target 2.25 --contenders ddp_allreduce,gradshare_auto,gradshare_diloco_h20
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(HERE)

import e2e_worker  # noqa: E402
import netns  # noqa: E402
from gradshare import costmodel as cm  # noqa: E402
from gradshare.workers import stop_process_group  # noqa: E402

QUICK = dict(workloads="mnist_cnn", links="100mbit,none", train_subset=2000, test_subset=1000, epochs=1,
             eval_every=10, target=0.85)


# ------------------------------------------------------------------------------------------------ model
def predicted_bytes_per_step(contender: str, r: dict) -> Optional[float]:
    """The cost model's bytes per step per worker for what the run did (steps, warm-up, period)."""
    n, p, steps = r["world_size"], r["params"], max(1, r["steps"])
    dense = cm.dense_allreduce_bytes(n, p)
    if contender == "ddp_allreduce":
        return dense
    if contender == "ddp_fp16":
        return cm.fp16_allreduce_bytes(n, p)
    if contender == "ddp_powersgd":
        start = min(steps, r["info"]["start_powerSGD_iter"])
        psgd = cm.powersgd_bytes(n, p, r["info"]["matrix_approximation_rank"], r["shapes"])
        return (start * dense + (steps - start) * psgd) / steps
    base = e2e_worker.split_period(contender)[0]
    if base == "torch_averaging":
        return math.ceil(steps / r["info"]["period"]) * dense / steps
    acct = r.get("library_accounting") or {}
    if "bytes_sent" in acct:          # gradshare contenders: their own per-exchange accounting
        return acct["bytes_sent"] / steps
    if base == "gradshare_averaging":
        return math.ceil(steps / r["info"]["period"]) * 2 * dense / steps   # params + momentum buffers
    return None


# A run's metric: results written before the LM workload name it "accuracy" (history) and "final_accuracy".
def metric_name(r: dict) -> str:
    """ "accuracy" (higher is better) or "loss" (lower is better)."""
    return r.get("metric", "accuracy")


def final_metric(r: dict) -> Optional[float]:
    return r["final_metric"] if "final_metric" in r else r.get("final_accuracy")


def value(h: dict) -> float:
    """One evaluation's metric (a history entry)."""
    return h["value"] if "value" in h else h["accuracy"]


def merge(contender: str, workload: str, link: str, ranks: List[dict], before, after) -> dict:
    r0 = ranks[0]
    row = {
        "contender": contender, "workload": workload, "link": link, "status": "ok", "metric": r0["metric"],
        "description": e2e_worker.describe(contender), "params": r0["params"], "workers": r0["world_size"],
        "steps": r0["steps"], "batch_size": r0["batch_size"], "stopped_by_time_budget": r0["stopped_by_time_budget"],
        "target": r0["target"], "time_to_target": r0["time_to_target"], "final_metric": r0["final_metric"],
        "train_time": max(r["train_time"] for r in ranks),
        "step_time": sum(r["step_time"] for r in ranks) / len(ranks),
        "compute": sum(r["compute"] for r in ranks) / len(ranks),
        "encode": sum(r["encode"] for r in ranks) / len(ranks),
        "communicate": sum(r["communicate"] for r in ranks) / len(ranks),
        "tx_bytes_per_step": sum(r["tx_bytes_per_step"] for r in ranks) / len(ranks),
        "tx_bytes_total": sum(r["tx_bytes_train"] for r in ranks) / len(ranks),
        "model_bytes_per_step": predicted_bytes_per_step(contender, r0),
        "library_accounting": r0.get("library_accounting"), "info": r0["info"], "history": r0["history"],
    }
    if before and after:
        tx = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]
        row["launch_tx_bytes"] = sum(tx) / len(tx)
        if "tc_bytes" in after[0]:
            tc = [a["tc_bytes"] - b["tc_bytes"] for a, b in zip(after, before)]
            row["tc_bytes_total"] = sum(tc) / len(tc)
            row["tc_bytes_per_step"] = row["tc_bytes_total"] / max(1, row["steps"])
    return row


# ------------------------------------------------------------------------------------------------ running
def worker_args(a, contender: str, workload: str, out: str, seed: int) -> List[str]:
    return ["--contender", contender, "--workload", workload, "--data-dir", a.data_dir,
            "--train-subset", str(a.train_subset), "--test-subset", str(a.test_subset), "--epochs", str(a.epochs),
            "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--momentum", str(a.momentum), "--seed", str(seed),
            "--eval-every", str(a.eval_every), "--target", str(target_for(a, workload)),
            "--max-train-seconds", str(a.max_train_seconds), "--period", str(a.period),
            "--powersgd-rank", str(a.powersgd_rank), "--initial-tau", str(a.initial_tau),
            "--dgc-initial-tau", str(a.dgc_initial_tau), "--dgc-decay", str(a.dgc_decay),
            "--dgc-warmup-steps", str(a.dgc_warmup_steps),
            "--dgc-clipping", str(a.dgc_clipping), "--out", out]


DEFAULT_TARGETS = {"accuracy": 0.95, "loss": 2.25}    # test accuracy to reach; validation loss to get down to


def target_for(a, workload: str) -> float:
    """--target, or the default for what the workload is judged by (DDP's char_lm ends near 2.20)."""
    return a.target if a.target is not None else DEFAULT_TARGETS[e2e_worker.metric_of(workload)]


def run_one(net, a, contender, workload, link, rundir, seed) -> dict:
    out = os.path.join(rundir, f"{workload}-{link}-{contender}-seed{seed}-rank{{rank}}.json")
    for r in range(a.workers):
        if os.path.exists(out.format(rank=r)):
            os.remove(out.format(rank=r))
    script = os.path.join(HERE, "e2e_worker.py")
    t0 = time.monotonic()
    if net is not None:
        before = net.counters()
        res = net.torchrun(script, worker_args(a, contender, workload, out, seed), timeout=a.timeout)
        after = net.counters()
    else:
        before = after = None
        res = run_loopback(a, script, worker_args(a, contender, workload, out, seed))
    wall = time.monotonic() - t0
    if not all(r.ok for r in res):
        tail = "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{r.stderr[-2500:]}" for r in res)
        print(f"  FAILED {workload}/{link}/{contender} after {wall:.0f} s\n{tail}", flush=True)
        return {"contender": contender, "workload": workload, "link": link, "seed": seed, "status": "failed",
                "reason": tail[-4000:]}
    ranks = [json.load(open(out.format(rank=r))) for r in range(a.workers)]
    row = merge(contender, workload, link, ranks, before, after)
    row["launch_wall"], row["seed"] = wall, seed
    print(f"  seed {seed} {contender:<24} {row['metric']} {row['final_metric']:.4f}  target@{_fmt(row['time_to_target'])} s  "
          f"step {row['step_time'] * 1e3:.1f} ms  tx/step {row['tx_bytes_per_step']:,.0f} B  "
          f"model {_fmt(row['model_bytes_per_step'], ',.0f')} B  tc/step {_fmt(row.get('tc_bytes_per_step'), ',.0f')} B"
          f"  ({wall:.0f} s)", flush=True)
    return row


def run_loopback(a, script, args) -> List[netns.RunResult]:
    """Without namespaces (no root): torchrun --standalone on loopback; bytes then are NOT comparable."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.workers}",
            script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", GRADSHARE_NETNS_IFNAME="lo")
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=a.timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        stop_process_group(p)
        out, err = p.communicate()
        rc = None
    return [netns.RunResult(0, rc, time.monotonic() - t0, out, err)]


def run_all(a) -> List[dict]:
    rows: List[dict] = []
    os.makedirs(a.out, exist_ok=True)
    rundir = os.path.join(a.out, "ranks")
    os.makedirs(rundir, exist_ok=True)
    contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    runnable = []
    for c in contenders:
        reason = e2e_worker.missing_reason(c)
        if reason:
            print(f"SKIP {c}: {reason}", flush=True)
            for w in a.workloads.split(","):
                for link in a.links.split(","):
                    rows.append({"contender": c, "workload": w, "link": link, "seed": None, "status": "skipped",
                                 "reason": reason})
        else:
            runnable.append(c)
    for link in [l.strip() for l in a.links.split(",") if l.strip()]:
        print(f"== link {link}", flush=True)
        # seeds outermost within a link: a slow spell of this shared machine hits every contender alike
        if a.no_netns:
            for w in a.workloads.split(","):
                for seed in a.seed_list:
                    for c in runnable:
                        rows.append(run_one(None, a, c, w, link, rundir, seed))
            continue
        with netns.NetnsCluster(a.workers, rate=link) as net:
            for w in a.workloads.split(","):
                print(f"-- workload {w}", flush=True)
                for seed in a.seed_list:
                    for c in runnable:
                        rows.append(run_one(net, a, c, w, link, rundir, seed))
    return rows


# ------------------------------------------------------------------------------------------------ report
def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _median(xs):
    xs = sorted(xs)
    k = len(xs)
    return None if k == 0 else (xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def rejudge(rows: List[dict], target: float) -> float:
    """Every run's target and time to target set again from its recorded evaluations (rank 0's history: the
    training time at the first evaluation that reached ``target``)."""
    for r in rows:
        r["target"] = target
        if r.get("status") == "ok":
            hit = next((h for h in r.get("history", []) if e2e_worker.reached(value(h), target, metric_name(r))), None)
            r["time_to_target"] = None if hit is None else hit["time"]
    return target


def steps_to_target(r: dict) -> Optional[int]:
    """The step of the first evaluation that reached the target (None if none did)."""
    return next((h["step"] for h in r.get("history", [])
                 if e2e_worker.reached(value(h), r["target"], metric_name(r))), None)


def summarize(rows: List[dict], baseline: str = "ddp_allreduce") -> List[dict]:
    """One row per (workload, link, contender) over its seeds, compared with ``baseline`` seed by seed.

    time_to_target (steps_to_target): median over the seeds, if all reached the target (``reached`` says
    how many did);
    speedup: baseline's median time to target / this one's; metric_delta: mean over seeds of (final
    metric - the baseline's with the same seed), for a loss relative to the baseline's (-0.01: 1% lower);
    bytes_ratio: baseline tx bytes per step / this one's.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for w, link, c in dict.fromkeys((r["workload"], r["link"], r["contender"]) for r in rows):
        sel = [r for r in ok if (r["workload"], r["link"], r["contender"]) == (w, link, c)]
        bad = [r for r in rows if (r["workload"], r["link"], r["contender"]) == (w, link, c) and r["status"] != "ok"]
        if not sel:
            out.append({"workload": w, "link": link, "contender": c, "status": bad[0]["status"],
                        "reason": bad[0].get("reason", "")})
            continue
        base = {r["seed"]: r for r in ok if (r["workload"], r["link"], r["contender"]) == (w, link, baseline)}
        ttt = [r["time_to_target"] for r in sel if r["time_to_target"] is not None]
        sst = [s for s in (steps_to_target(r) for r in sel) if s is not None]
        base_ttt = [r["time_to_target"] for r in base.values() if r["time_to_target"] is not None]
        metric = metric_name(sel[0])
        accs = [final_metric(r) for r in sel]
        deltas = [final_metric(r) - final_metric(base[r["seed"]]) for r in sel if r["seed"] in base]
        if metric == "loss":
            deltas = [d / final_metric(base[r["seed"]]) for d, r in zip(deltas, [r for r in sel if r["seed"] in base])]
        tx = _mean([r["tx_bytes_per_step"] for r in sel])
        base_tx = _mean([r["tx_bytes_per_step"] for r in base.values()])
        row = {"workload": w, "link": link, "contender": c, "status": "ok", "metric": metric, "params": sel[0]["params"],
               "seeds": [r["seed"] for r in sel], "failed_seeds": [r.get("seed") for r in bad],
               "reached": len(ttt), "time_to_target": _median(ttt) if len(ttt) == len(sel) else None,
               "steps_to_target": _median(sst) if len(sst) == len(sel) else None,
               "final_metric": _mean(accs), "final_metric_min": min(accs), "final_metric_max": max(accs),
               "metric_delta": _mean(deltas) if deltas else None,
               "steps": _mean([r["steps"] for r in sel]),
               **{k: _mean([r[k] for r in sel]) for k in ("step_time", "compute", "encode", "communicate")},
               "tx_bytes_per_step": tx, "tx_bytes_total": _mean([r["tx_bytes_total"] for r in sel]),
               "tc_bytes_per_step": _mean([r.get("tc_bytes_per_step") for r in sel]),
               "model_bytes_per_step": _mean([r["model_bytes_per_step"] for r in sel])}
        bt = _median(base_ttt) if base and len(base_ttt) == len(base) else None
        row["speedup"] = bt / row["time_to_target"] if bt and row["time_to_target"] else None
        row["bytes_ratio"] = base_tx / tx if base_tx and tx else None
        out.append(row)
    return out


def markdown(rows: List[dict], a) -> str:
    seeds = ", ".join(str(s) for s in a.seed_list)
    lines = [f"Command: `{a.command}`", "", f"{a.workers} workers on {os.cpu_count()} cores (torch threads 1 each), "
             f"seed(s) {seeds}."]
    workloads = set(r["workload"] for r in rows)
    if workloads - set(e2e_worker.LOSS_WORKLOADS):
        lines.append(f"MNIST workloads: batch {a.batch_size} per worker, SGD lr {a.lr} momentum {a.momentum}, "
                     f"{a.epochs} epoch(s), train subset {a.train_subset or 60000}, test subset {a.test_subset or 10000}, "
                     f"judged by test accuracy, target {a.target if a.target is not None else DEFAULT_TARGETS['accuracy']}.")
    for w in sorted(workloads & set(e2e_worker.LOSS_WORKLOADS)):
        lines.append(f"{w}: bench/workloads.py's recipe as bench/quality.py trains it, judged by validation loss, "
                     f"target {target_for(a, w)}.")
    lines.append("")
    many = len(a.seed_list) > 1
    summary = summarize(rows)
    for w in dict.fromkeys(r["workload"] for r in summary):
        for link in dict.fromkeys(r["link"] for r in summary if r["workload"] == w):
            sel = [r for r in summary if r["workload"] == w and r["link"] == link]
            params = next((r["params"] for r in sel if r.get("params")), None)
            loss = sel[0].get("metric") == "loss"
            name, gap = ("final loss", "Δ loss vs DDP") if loss else ("final acc", "Δ acc vs DDP (pt)")
            lines += [f"### {w} ({_fmt(params, ',')} parameters), link {link}", "",
                      f"| contender | time to target s | vs DDP | steps to target | {name} | {gap} | steps | step ms "
                      "| compute / encode / comm ms | tx B/step | bytes vs DDP | tc B/step | model B/step "
                      "| total MB/worker |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in sel:
                if r["status"] != "ok":
                    lines.append(f"| {r['contender']} | {r['status']}: {r.get('reason', '')[:80]} |||||||||||||")
                    continue
                n = len(r["seeds"])
                ttt = _fmt(r["time_to_target"]) + (f" ({r['reached']}/{n})" if many and r["reached"] < n else "")
                acc = f"{r['final_metric']:.4f}" + (
                    f" [{r['final_metric_min']:.4f}, {r['final_metric_max']:.4f}]" if many else "")
                delta = "-" if r["metric_delta"] is None else f"{100 * r['metric_delta']:+.2f}" + ("%" if loss else "")
                lines.append(
                    f"| {r['contender']} | {ttt} | {_fmt(r['speedup'], '.2f')}{'x' if r['speedup'] else ''} "
                    f"| {_fmt(r['steps_to_target'], '.0f')} | {acc} | {delta} | {r['steps']:.0f} "
                    f"| {r['step_time'] * 1e3:.1f} | {r['compute'] * 1e3:.1f} / {r['encode'] * 1e3:.1f} / "
                    f"{r['communicate'] * 1e3:.1f} | {r['tx_bytes_per_step']:,.0f} | {_fmt(r['bytes_ratio'], '.1f')}{'x' if r['bytes_ratio'] else ''} "
                    f"| {_fmt(r.get('tc_bytes_per_step'), ',.0f')} | {_fmt(r['model_bytes_per_step'], ',.0f')} "
                    f"| {r['tx_bytes_total'] / 1e6:.2f} |")
            lines.append("")
    lines += ["time to target: training wall time until the test accuracy first reached the target (a loss: "
              "first got down to it)"
              + (" (median over seeds; (k/n): only k of n seeds reached it)" if many else "")
              + ". vs DDP: ddp_allreduce's time to target / this one's. steps to target: the step of the first "
              "evaluation that reached the target. final acc / loss: "
              + ("mean [min, max] over seeds" if many else "after the last step")
              + ". Δ vs DDP: final accuracy minus ddp_allreduce's with the same seed (a loss: the difference in % "
              "of ddp_allreduce's)"
              + (", mean over seeds" if many else "") + ". Times and bytes per step: mean over seeds and ranks.",
              "tx B/step: kernel tx counter of the worker's interface during training steps only (TCP/IP headers "
              "included); bytes vs DDP: ddp_allreduce's tx B/step / this one's. tc B/step: the qdisc's byte counter "
              "over the whole launch (rendezvous, DDP's initial broadcast, evaluation barriers included) divided by "
              "the steps. model B/step: gradshare.costmodel payload bytes (gradshare contenders: their own "
              "accounting). encode: time inside the comm hook call; communicate: step - compute - encode.", ""]
    return "\n".join(lines)


# accuracy_vs_time.png draws, per panel, the contenders that matter (the rest are in results.md): the
# reference, the fastest of torch's own alternatives, the fastest gradshare contender at its defaults and the
# fastest other gradshare contender.
BASELINE = "ddp_allreduce"
DEFAULT_CONTENDERS = ("gradshare", "gradshare_auto", "gradshare_optimizer_auto", "gradshare_compressed")


def _sooner(r: dict) -> tuple:
    """Sort key: reached the target (all seeds) sooner, then the better final metric."""
    ttt = r.get("time_to_target")
    better = r.get("final_metric") or 0.0
    return (ttt is None, ttt if ttt is not None else 0.0, better if r.get("metric") == "loss" else -better)


def contenders_that_matter(summary: List[dict]) -> List[str]:
    """At most four contenders of one (workload, link) summary, in the table's order (see above)."""
    ok = [r for r in summary if r["status"] == "ok"]
    gradshare = [r for r in ok if r["contender"].startswith("gradshare")]
    groups = ([r for r in ok if r["contender"] == BASELINE],
              [r for r in ok if r["contender"] != BASELINE and r not in gradshare],
              [r for r in gradshare if r["contender"] in DEFAULT_CONTENDERS],
              [r for r in gradshare if r["contender"] not in DEFAULT_CONTENDERS])
    chosen = {min(g, key=_sooner)["contender"] for g in groups if g}
    return [r["contender"] for r in ok if r["contender"] in chosen]


def _seeds(seeds) -> str:
    seeds = sorted(set(seeds))
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(str(s) for s in seeds)}"


def _link(link: str) -> str:
    return "unshaped link" if link in ("none", "") else f"{link} link"


def _panels(rows: List[dict]):
    """(figure, {(workload, link): axes}, workloads, links): one row of panels per workload, one column per link."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(len(workloads), len(links), figsize=(5.6 * len(links), 4.4 * len(workloads)),
                             squeeze=False)
    return fig, {(w, link): axes[i][j] for i, w in enumerate(workloads) for j, link in enumerate(links)}


def accuracy_panels(rows: List[dict], target: Optional[float] = None) -> List[dict]:
    """What each panel of accuracy_vs_time.png shows, one per (workload, link) with a finished run: its title
    (naming exactly the seeds drawn), the target, and per contender drawn its label and runs; ``not_drawn``
    lists the other contenders that finished."""
    ok = [r for r in rows if r["status"] == "ok"]
    summary = summarize(rows)
    panels = []
    for w, link in dict.fromkeys((r["workload"], r["link"]) for r in ok):
        sel = [r for r in summary if (r["workload"], r["link"]) == (w, link)]
        drawn = contenders_that_matter(sel)
        runs = [r for r in ok if (r["workload"], r["link"]) == (w, link) and r["contender"] in drawn]
        seeds = {r["seed"] for r in runs}
        curves = []
        for c in drawn:
            mine = sorted((r for r in runs if r["contender"] == c), key=lambda r: r["seed"])
            label = c + ("" if {r["seed"] for r in mine} == seeds else f" ({_seeds(r['seed'] for r in mine)})")
            curves.append({"contender": c, "label": label, "runs": mine})
        rest = [r["contender"] for r in sel if r["status"] == "ok" and r["contender"] not in drawn]
        panels.append({"workload": w, "link": link, "title": f"{w}, {_link(link)}, {_seeds(seeds)}",
                       "metric": metric_name(runs[0]),
                       "target": runs[0].get("target", target), "curves": curves, "not_drawn": rest})
    return panels


def plots(rows: List[dict], outdir: str, target: Optional[float] = None) -> List[str]:
    """accuracy_vs_time.png (accuracy_panels: the contenders that matter, every seed, the target as a line) and
    bytes_per_step.png (every contender, mean over seeds), one panel per workload and link; each title names
    the seeds it shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", flush=True)
        return []
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    colors = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(r["contender"] for r in rows))}
    files = []

    fig, axes = _panels(ok)
    for ax in axes.values():
        ax.set_visible(False)             # a workload not run under a link leaves its panel empty
    for panel in accuracy_panels(rows, target):
        ax = axes[panel["workload"], panel["link"]]
        ax.set_visible(True)
        for curve in panel["curves"]:
            for k, r in enumerate(curve["runs"]):          # every seed, the first one labelled
                h = r["history"]
                ax.plot([x["time"] for x in h], [value(x) for x in h], marker=".", lw=1.2 if k == 0 else 0.8,
                        alpha=1.0 if k == 0 else 0.6, color=colors[curve["contender"]],
                        label=curve["label"] if k == 0 else None)
        goal, loss = panel["target"], panel["metric"] == "loss"
        if goal is not None:
            ax.axhline(goal, color="black", ls="--", lw=0.9, label=f"target {goal:g}")
            ax.set_ylim(*((goal - 0.15, goal + 0.6) if loss else (max(0.0, goal - 0.25), 1.0)))
        ax.set_title(panel["title"])
        rest = panel["not_drawn"]
        note = textwrap.fill(f"not drawn: {', '.join(rest)} (results.md)", 80) if rest else ""
        ax.set_xlabel("training wall time (s)" + (f"\n{note}" if note else ""), fontsize=8 if note else None)
        ax.set_ylabel("validation loss" if loss else "test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right" if loss else "lower right")
    fig.tight_layout()
    files.append(os.path.join(outdir, "accuracy_vs_time.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    summary = summarize(rows)
    fig, panels = _panels(ok)
    for (w, link), ax in panels.items():
        sel = [r for r in summary if (r["workload"], r["link"]) == (w, link) and r["status"] == "ok"]
        if not sel:
            ax.set_visible(False)
            continue
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [max(1, r["tx_bytes_per_step"]) for r in sel], 0.4, label="measured (tx)")
        ax.bar([x + 0.2 for x in xs], [max(1, r["model_bytes_per_step"] or 1) for r in sel], 0.4, label="cost model")
        seeds = {s for r in sel for s in r["seeds"]}
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["contender"] + ("" if set(r["seeds"]) == seeds else f" ({_seeds(r['seeds'])})")
                            for r in sel], rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("bytes per step per worker")
        ax.set_title(f"{w}, {_link(link)}, " + ("mean of " if len(seeds) > 1 else "") + _seeds(seeds))
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(os.path.join(outdir, "bytes_per_step.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--workloads", default="mnist_cnn,mlp")
    ap.add_argument("--links", default="100mbit,1gbit,none", help="tc rates per run: 100mbit, 1gbit, none")
    ap.add_argument("--contenders", default=",".join(e2e_worker.CONTENDERS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "mnist"))
    ap.add_argument("--train-subset", type=int, default=0)
    ap.add_argument("--test-subset", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default="", help="comma-separated seeds, each a full run of every contender "
                                                "(overrides --seed); the tables summarise over them")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target", type=float, default=None,
                    help="test accuracy to reach (default 0.95), or for char_lm the validation loss to get down to "
                         "(default 2.25); one number cannot serve both kinds: run them separately to give one")
    ap.add_argument("--max-train-seconds", type=float, default=0.0, help="per contender (0: none)")
    ap.add_argument("--period", type=int, default=5)
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--initial-tau", type=float, default=1e-3)
    ap.add_argument("--dgc-initial-tau", type=float, default=0.01, help="*_dgc contenders (momentum correction)")
    ap.add_argument("--dgc-decay", type=float, default=0.8, help="*_dgc contenders: Adaptive decay per step")
    ap.add_argument("--dgc-warmup-steps", type=int, default=0, help="*_dgc contenders: Adaptive warmup_steps")
    ap.add_argument("--dgc-clipping", type=int, default=0, help="*_dgc contenders: 1 = ResidualClipping()")
    ap.add_argument("--timeout", type=float, default=900.0, help="hard limit per contender run, seconds")
    ap.add_argument("--no-netns", action="store_true", help="loopback torchrun (no root); bytes not comparable")
    ap.add_argument("--out", default="bench/results/e2e")
    ap.add_argument("--report", default="", metavar="DIR",
                    help="run nothing: rewrite DIR's results.md and plots from its results.json (into --out "
                         "when given, else DIR; results.json itself is left as it is); with --target, every run "
                         "is judged again at that target from its recorded evaluations")
    raw = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(raw)
    if a.quick:
        given = {x.split("=")[0].lstrip("-").replace("-", "_") for x in raw if x.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(a, k, v)
    a.seed_list = [int(x) for x in a.seeds.split(",") if x.strip()] or [a.seed]
    unknown = [w for w in a.workloads.split(",") if w not in e2e_worker.WORKLOADS]
    if unknown and not a.report:
        ap.error(f"unknown workload(s) {unknown}: choose from {', '.join(e2e_worker.WORKLOADS)}")
    named = [c.strip() for c in a.contenders.split(",") if c.strip()]
    twice = sorted({c for c in named if named.count(c) > 1})
    if twice and not a.report:     # a second run would overwrite the first's rank files, its rows merged with them
        ap.error(f"--contenders: {', '.join(twice)} given twice; repeat a run with --seeds instead")
    for c in named if not a.report else []:
        try:
            e2e_worker.contender_name(c)
        except argparse.ArgumentTypeError as exc:
            ap.error(str(exc))
    if a.target is not None and len({e2e_worker.metric_of(w) for w in a.workloads.split(",")}) > 1 and not a.report:
        ap.error("--target: these workloads are judged by accuracy and by loss; run them separately to give a target")
    a.command = "python bench/e2e.py " + " ".join(raw)
    written = []
    if a.report:                     # re-render the tables and plots of an earlier run from its results.json
        with open(os.path.join(a.report, "results.json")) as f:
            saved = json.load(f)
        out = a.out if any(x == "--out" or x.startswith("--out=") for x in raw) else a.report
        a = argparse.Namespace(**{**saved["args"], "out": out})
        a.seed_list = a.__dict__.get("seed_list") or [a.seed]
        rows = saved["results"]
        for r in rows:
            r.setdefault("seed", a.seed)
        if any(x == "--target" or x.startswith("--target=") for x in raw):
            a.target = rejudge(rows, ap.parse_args(raw).target)
        os.makedirs(a.out, exist_ok=True)
    elif not os.path.isdir(a.data_dir):
        print(f"no MNIST at {a.data_dir} (--data-dir)", file=sys.stderr)
        return 2
    else:
        rows = run_all(a)
        written.append(os.path.join(a.out, "results.json"))
        with open(written[-1], "w") as f:
            json.dump({"command": a.command, "args": {k: v for k, v in vars(a).items()}, "summary": summarize(rows),
                       "results": rows}, f, indent=1)
    md = markdown(rows, a)
    written.append(os.path.join(a.out, "results.md"))
    with open(written[-1], "w") as f:
        f.write(md)
    written += plots(rows, a.out, a.target)
    print(md)
    print("wrote", ", ".join(written))
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
