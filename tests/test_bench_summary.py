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
