"""bench/e2e.py's summary over seeds: the figures the README quotes come from here."""
import argparse
import os
import sys

import pytest

# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "bench"))
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
    assert s["gs"]["metric_delta"] == pytest.approx(-0.007 / 3)
    assert (s["gs"]["final_metric_min"], s["gs"]["final_metric_max"]) == (0.966, 0.969)
    assert s["gs"]["bytes_ratio"] == pytest.approx(100.0)


def loss_row(contender, seed, ttt, loss, history):
    return dict(row(contender, seed, ttt, None, 1000), metric="loss", final_metric=loss, target=2.25,
                history=[{"time": t, "step": 20 * i, "value": v} for i, (t, v) in enumerate(history)])


def test_a_loss_is_reached_going_down_and_compared_in_percent():
    rows = [loss_row("ddp_allreduce", 0, 9.0, 2.2, [(0, 5.5), (4.5, 2.4), (9.0, 2.2)]),
            loss_row("gs", 0, 3.0, 2.31, [(0, 5.5), (1.5, 2.6), (3.0, 2.25), (4.5, 2.31)])]
    s = by_contender(e2e.summarize(rows))
    assert s["gs"]["metric"] == "loss" and s["gs"]["metric_delta"] == pytest.approx(0.05)   # 5% above DDP's
    assert s["gs"]["steps_to_target"] == 40 and s["ddp_allreduce"]["steps_to_target"] == 40
    assert s["gs"]["speedup"] == pytest.approx(3.0)
    # an accuracy target is reached going up: the same history read as accuracy reaches 2.25 at once
    acc = [dict(r, metric="accuracy") for r in rows]
    assert by_contender(e2e.summarize(acc))["gs"]["steps_to_target"] == 0
    md = e2e.markdown(rows, argparse.Namespace(command="c", workers=2, seed_list=[0], target=None, batch_size=32,
                                               lr=0.05, momentum=0.9, epochs=1, train_subset=0, test_subset=0))
    assert "| final loss | Δ loss vs DDP |" in md and "| gs | 3.0 | 3.00x | 40 | 2.3100 | +5.00% |" in md


def test_periodic_contenders_take_their_period_from_a_suffix():
    w = e2e.e2e_worker
    assert w.split_period("gradshare_diloco_h50") == ("gradshare_diloco", 50)
    assert w.split_period("torch_averaging") == ("torch_averaging", None)
    assert w.split_period("gradshare_auto_h5") == ("gradshare_auto_h5", None)      # not a periodic contender
    assert w.contender_name("gradshare_sparse_local_h20") == "gradshare_sparse_local_h20"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown contender 'gradshare_auto_h5'"):
        w.contender_name("gradshare_auto_h5")


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


def test_a_report_judges_recorded_runs_again_at_another_target():
    rows = [loss_row("ddp_allreduce", 0, 9.0, 2.2, [(0, 5.5), (4.5, 2.4), (9.0, 2.2)]),
            loss_row("gs", 0, 3.0, 2.31, [(0, 5.5), (1.5, 2.6), (3.0, 2.25), (4.5, 2.31)])]
    assert e2e.rejudge(rows, 2.5) == 2.5
    s = by_contender(e2e.summarize(rows))
    assert s["ddp_allreduce"]["time_to_target"] == 4.5 and s["gs"]["time_to_target"] == 3.0
    assert s["gs"]["steps_to_target"] == 40 and s["gs"]["speedup"] == pytest.approx(1.5)
    e2e.rejudge(rows, 2.0)                                        # reached by nobody
    assert all(r["time_to_target"] is None for r in e2e.summarize(rows))


def test_a_contender_named_twice_is_refused_before_anything_runs(tmp_path, capsys):
    # its second run would overwrite the first's rank files and merge their rows into one
    with pytest.raises(SystemExit):
        e2e.main(["--workloads", "mnist_cnn", "--contenders", "ddp_allreduce,gradshare_auto,ddp_allreduce",
                  "--out", str(tmp_path / "out")])
    assert "ddp_allreduce given twice" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_bench_scripts_hide_no_installed_package():
    # The tests import bench's scripts by name; one named as an installed package (bench/kernels.py and Hugging
    # Face's `kernels`, which transformers imports) must not be found in its place.
    import importlib.machinery
    import importlib.util

    bench = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "bench"))
    elsewhere = [p for p in sys.path if os.path.realpath(p or ".") != bench]
    for f in sorted(os.listdir(bench)):
        name = f[:-3]
        if not f.endswith(".py") or importlib.machinery.PathFinder.find_spec(name, elsewhere) is None:
            continue
        origin = importlib.util.find_spec(name).origin
        assert os.path.dirname(os.path.realpath(origin)) != bench, f"bench/{f} hides the installed {name}"
