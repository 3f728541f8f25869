import argparse
import json

import pytest

from gradshare import costmodel as cm
from gradshare import plan


def run_plan(capsys, *argv):
    p = argparse.ArgumentParser()
    plan.add_arguments(p)
    assert plan.run(p.parse_args(list(argv) + ["--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_exact_cost_numbers(capsys):
    out = run_plan(capsys, "--params", "1000000", "--workers", "2", "--bandwidth", "100mbit", "--step-time", "100",
                   "--latency-ms", "0", "--efficiency", "1", "--encode-ns", "0", "--density", "0.01")
    s = {x["name"]: x for x in out["schemes"]}
    assert out["params"] == 1_000_000 and out["bandwidth_bps"] == 1e8 and out["compute_s"] == pytest.approx(0.1)
    assert s["allreduce"]["bytes_per_step"] == 4_000_000
    assert s["allreduce"]["communicate"] == pytest.approx(0.32)
    assert s["allreduce"]["step_time"] == pytest.approx(0.42)
    assert s["allreduce"]["speedup"] == pytest.approx(2 * 0.1 / 0.42)
    assert s["fp16"]["bytes_per_step"] == 2_000_000
    assert s["sharing"]["bytes_per_step"] == 4 * 10005 + 32      # messages of 1e-2 of the buffer: 10,000 words
    assert s["bitmap"]["bytes_per_step"] == 4 * 62505 + 32
    # averaging: 320 ms per full allreduce, <= 10 ms per step needs k = 32 > 20: no frequency suggested
    assert out["averaging"]["frequency"] is None
    assert s["averaging"]["bytes_per_step"] == 4_000_000 / 20


def test_plan_suggests_averaging_frequency(capsys):
    # 1M params at 1 Gbit/s: 32 ms per averaging; 10% of 100 ms compute -> every 4 steps
    out = run_plan(capsys, "--params", "1000000", "--bandwidth", "1gbit", "--step-time", "100",
                   "--latency-ms", "0", "--efficiency", "1")
    assert out["averaging"]["frequency"] == 4
    s = {x["name"]: x for x in out["schemes"]}
    assert s["averaging"]["bytes_per_step"] == 1_000_000.0


def test_large_model_slow_link_recommends_sharing(capsys):
    out = run_plan(capsys, "--params", "25000000", "--workers", "2", "--bandwidth", "100mbit", "--step-time", "1000")
    assert out["recommendation"] == "sharing"
    assert out["dl4j_band"] == "scales-well"
    # 10% of a 1 s step carries ~1.1% dense messages at 100 Mbit/s: TopK(0.01) fits, a ternary message does not
    assert out["compression"]["algorithm"] == "ThresholdState(optimizer=opt, compression=gradshare.TopK(0.01))"
    assert 0.01 <= out["compression"]["fitting_density"] < 1 / 16


def test_small_model_fast_link_recommends_allreduce(capsys):
    out = run_plan(capsys, "--params", "100000", "--workers", "2", "--bandwidth", "10gbit", "--step-time", "200")
    assert out["recommendation"] == "allreduce"
    assert out["compression"]["algorithm"].startswith("ThresholdState(optimizer=opt) (TopK() for SGD, Ternary()")


def test_tiny_step_is_not_worth_distributing(capsys):
    out = run_plan(capsys, "--params", "100000", "--workers", "4", "--bandwidth", "10gbit", "--step-time", "0.5")
    assert out["dl4j_band"] == "not-worth-distributing"
    assert out["recommendation"] == "single"


def test_ten_ms_step_is_sublinear_band(capsys):
    out = run_plan(capsys, "--params", "100000", "--bandwidth", "10gbit", "--step-time", "10")
    assert out["dl4j_band"] == "sub-linear"


def test_one_worker_is_single(capsys):
    out = run_plan(capsys, "--params", "1000", "--workers", "1", "--step-time", "500")
    assert out["recommendation"] == "single"
    assert all(x["bytes_per_step"] == 0 for x in out["schemes"])


def test_many_workers_past_crossover_say_dense_fallback(capsys):
    out = run_plan(capsys, "--params", "1000000", "--workers", "400", "--density", "0.01", "--step-time", "100")
    s = {x["name"]: x for x in out["schemes"]}
    assert out["sparse_allgather_crossover_workers"] == 200
    assert s["sharing"]["detail"]["dense_fallback"] == 1.0
    assert s["sharing"]["bytes_per_step"] == pytest.approx(cm.dense_allreduce_bytes(400, 1_000_000) + 399 * 32)
    assert "falls back" in out["compression"]["why"]


def test_model_is_loaded_and_counted(capsys):
    out = run_plan(capsys, "--model", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
                   "--step-time", "100")
    assert out["params"] == 8 * 4 + 4
    assert out["measured"] is False


def test_measure_times_real_steps(capsys):
    out = run_plan(capsys, "--model", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
                   "--measure", "--input-shape", "8", "--batch-size", "4", "--measure-steps", "2")
    assert out["measured"] is True
    assert out["compute_s"] > 0


def test_text_output_names_the_choice(capsys):
    p = argparse.ArgumentParser()
    plan.add_arguments(p)
    plan.run(p.parse_args(["--params", "25000000", "--bandwidth", "100mbit", "--step-time", "1000"]))
    text = capsys.readouterr().out
    assert "use: sharing" in text and "allreduce" in text and "DL4J rule: scales-well" in text


def test_measure_needs_model(capsys):
    p = argparse.ArgumentParser()
    plan.add_arguments(p)
    assert plan.run(p.parse_args(["--params", "10", "--measure"])) == 2
    assert "--measure needs --model" in capsys.readouterr().err


def test_sharing_is_modelled_at_what_the_default_topk_sends(capsys, monkeypatch):
    from gradshare.compression import TopK

    params = 1_000_000
    out = run_plan(capsys, "--params", str(params), "--step-time", "100")
    topk = TopK()
    words = topk.words(params, topk.warmup_steps)              # after the warm-up, at TopK()'s own chunk and values
    assert out["density"] == pytest.approx((words - 5) / params)
    assert out["compression"]["topk_default_density"] == topk.density
    assert "TopK's warm-up" in out["compression"]["warmup"]

    class Denser(TopK):                                        # the defaults change: the advice follows
        def __init__(self, density=0.05, **kw):
            super().__init__(density, **kw)

    monkeypatch.setattr(plan, "TopK", Denser)
    out = run_plan(capsys, "--params", str(params), "--step-time", "100")
    assert out["compression"]["topk_default_density"] == 0.05
    assert out["density"] == pytest.approx((Denser().words(params, Denser().warmup_steps) - 5) / params)


def test_adam_beyond_ternary_is_pointed_to_local_steps(capsys):
    # 25M parameters at 100 Mbit/s, 1 s steps: TopK(0.01) fits in 10% of compute, Adam's Ternary() does not
    out = run_plan(capsys, "--params", "25000000", "--workers", "2", "--bandwidth", "100mbit", "--step-time", "1000")
    assert "local steps" in out["compression"]["why"] and "--mode diloco" in out["compression"]["why"]
    # so little fits that even TopK(0.001) is too much: average instead of sharing every step
    out = run_plan(capsys, "--params", "3716106", "--bandwidth", "10mbit", "--step-time", "15")
    assert out["compression"]["algorithm"].startswith("ParameterAveraging")
