"""bench/e2e.py's summary over seeds: the figures the README quotes come from here."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
e2e = pytest.importorskip("e2e")


def row(contender, seed, ttt, acc, tx, step=0.05):
    return {"contender": contender, "workload": "w", "link": "100mbit", "seed": seed, "status": "ok",
            "params": 10, "steps": 100, "time_to_target": ttt, "final_accuracy": acc, "step_time": step,
            "compute": 0.01, "encode": 0.0, "communicate": step - 0.01, "tx_bytes_per_step": tx,
            "tx_bytes_total": 100 * tx, "model_bytes_per_step": tx, "tc_bytes_per_step": tx}


def by_contender(summary):
    return {r["contender"]: r for r in summary}


def test_speedup_accuracy_delta_and_bytes_ratio_against_ddp_seed_by_seed():
    rows = [row("ddp_allreduce", 0, 6.0, 0.970, 400_000), row("ddp_allreduce", 1, 9.0, 0.968, 400_000),
            row("ddp_allreduce", 2, 7.0, 0.972, 400_000),
            row("gs", 0, 2.0, 0.968, 4_000), row("gs", 1, 3.0, 0.969, 4_000), row("gs", 2, 1.0, 0.966, 4_000)]
    s = by_contender(e2e.summarize(rows))
    assert s["ddp_allreduce"]["speedup"] == pytest.approx(1.0)
    assert s["gs"]["time_to_target"] == 2.0                          # median of 2, 3, 1
    assert s["gs"]["speedup"] == pytest.approx(7.0 / 2.0)           # DDP's median 7 / 2
    # paired by seed: (-0.002 + 0.001 - 0.006) / 3
    assert s["gs"]["acc_delta"] == pytest.approx(-0.007 / 3)
    assert (s["gs"]["final_accuracy_min"], s["gs"]["final_accuracy_max"]) == (0.966, 0.969)
    assert s["gs"]["bytes_ratio"] == pytest.approx(100.0)


def test_a_seed_that_misses_the_target_leaves_no_time_to_target():
    rows = [row("ddp_allreduce", 0, 6.0, 0.97, 1), row("ddp_allreduce", 1, 6.0, 0.97, 1),
            row("gs", 0, 2.0, 0.96, 1), row("gs", 1, None, 0.94, 1)]
    s = by_contender(e2e.summarize(rows))
    assert s["gs"]["reached"] == 1
    assert s["gs"]["time_to_target"] is None and s["gs"]["speedup"] is None


def test_failed_runs_are_reported_not_averaged_in():
    rows = [row("ddp_allreduce", 0, 6.0, 0.97, 1),
            {"contender": "gs", "workload": "w", "link": "100mbit", "seed": 0, "status": "failed", "reason": "boom"}]
    s = by_contender(e2e.summarize(rows))
    assert s["gs"]["status"] == "failed" and s["gs"]["reason"] == "boom"


def _curve(row_, times):
    return dict(row_, history=[{"time": t, "step": 50 * i, "accuracy": 0.5 + 0.1 * i} for i, t in enumerate(times)],
                target=0.95)


def test_accuracy_plot_draws_the_contenders_that_matter_and_names_their_seeds():
    rows = [_curve(row(c, seed, ttt, 0.97, 1000), [0, ttt])
            for c, ttt in (("ddp_allreduce", 9.0), ("ddp_fp16", 4.0), ("ddp_powersgd", 6.0), ("gradshare_auto", 3.0),
                           ("gradshare_optimizer_auto", 2.0), ("gradshare_hook_dgc", 1.0), ("gradshare_hook", 5.0))
            for seed in (1, 2)]
    rows.append(dict(row("ddp_fp16", 0, None, 0.0, 0), status="failed", reason="boom"))      # seed 0 failed
    rows += [_curve(row("gradshare_hook_dgc", 0, 1.0, 0.97, 1000), [0, 1.0])]               # the only seed 0
    (panel,) = e2e.accuracy_panels(rows)
    drawn = [c["contender"] for c in panel["curves"]]
    # the reference, torch's fastest alternative, the fastest gradshare default, the fastest other gradshare run
    assert drawn == ["ddp_allreduce", "ddp_fp16", "gradshare_optimizer_auto", "gradshare_hook_dgc"]
    assert panel["title"] == "w, 100mbit link, seeds 0, 1, 2" and panel["target"] == 0.95
    labels = {c["contender"]: c["label"] for c in panel["curves"]}
    assert labels["gradshare_hook_dgc"] == "gradshare_hook_dgc"                 # all three seeds
    assert labels["ddp_allreduce"] == "ddp_allreduce (seeds 1, 2)"
    assert sorted(panel["not_drawn"]) == ["ddp_powersgd", "gradshare_auto", "gradshare_hook"]
    only_seed_1 = [r for r in rows if r.get("seed") == 1]
    assert e2e.accuracy_panels(only_seed_1)[0]["title"] == "w, 100mbit link, seed 1"


def test_report_renders_plots_without_rerunning(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    rows = [_curve(row(c, s, 2.0, 0.97, 1000), [0, 1.0, 2.0]) for c in ("ddp_allreduce", "gradshare_auto")
            for s in (0, 1)]
    for r in rows:
        r["link"] = "none" if r["seed"] else "1gbit"
    src = tmp_path / "run"
    src.mkdir()
    args = {"seed": 0, "seed_list": [0, 1], "command": "python bench/e2e.py", "workers": 2, "batch_size": 32,
            "lr": 0.05, "momentum": 0.9, "epochs": 1, "train_subset": 0, "test_subset": 0, "target": 0.95}
    (src / "results.json").write_text(json.dumps({"command": "python bench/e2e.py", "args": args, "results": rows}))
    before = (src / "results.json").read_text()
    assert e2e.main(["--report", str(src), "--out", str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["accuracy_vs_time.png", "bytes_per_step.png", "results.md"]
    assert (src / "results.json").read_text() == before and sorted(os.listdir(src)) == ["results.json"]
