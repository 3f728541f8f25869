import argparse
import json

import pytest
import torch

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
    out = run_plan(capsys, "--params", "25000000", "--workers", "2", "--bandwidth", "100mbit", "--step-time", "2000")
    assert out["recommendation"] == "sharing"
    assert out["dl4j_band"] == "scales-well"
    # 10% of a 2 s step carries ~2.2% dense messages at 100 Mbit/s: the defaults' top 5% as signs (~1.1%) fits
    assert out["compression"]["algorithm"] == "ThresholdState(optimizer=opt)"
    assert "for SGD and Adam alike" in out["compression"]["why"]
    assert 0.01 <= out["compression"]["fitting_density"] < 1 / 16


def test_small_model_fast_link_recommends_allreduce(capsys):
    out = run_plan(capsys, "--params", "100000", "--workers", "2", "--bandwidth", "10gbit", "--step-time", "200")
    assert out["recommendation"] == "allreduce"
    assert out["compression"]["algorithm"] == "ThresholdState(optimizer=opt)"


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


def test_sharing_is_modelled_at_what_the_defaults_send(capsys, monkeypatch):
    from gradshare.compression import TopK
    from gradshare.optim import SharedOptimizer

    params = 1_000_000
    out = run_plan(capsys, "--params", str(params), "--step-time", "100")
    w = torch.nn.Parameter(torch.zeros(3))
    for opt in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.AdamW([w])):
        sent = SharedOptimizer(opt).compression                # what the defaults send, whatever the optimizer
        assert repr(sent) == repr(plan.default_compression())
    words = sent.words(params, sent.warmup_steps)              # after the warm-up, at its own chunk and values
    assert out["density"] == pytest.approx((words - 5) / params)
    assert out["compression"]["default_density"] == sent.density == 0.05
    assert "TopK's warm-up" in out["compression"]["warmup"]

    denser = TopK(0.1)                                         # the defaults change: the advice follows
    monkeypatch.setattr(plan, "default_compression", lambda: denser)
    out = run_plan(capsys, "--params", str(params), "--step-time", "100")
    assert out["compression"]["default_density"] == 0.1
    assert out["density"] == pytest.approx((denser.words(params, denser.warmup_steps) - 5) / params)


def test_beyond_the_defaults_a_sparser_topk_then_local_steps(capsys):
    # 25M parameters at 100 Mbit/s, 200 ms steps: 10% of compute carries ~0.2% of a float32 buffer, less than
    # the defaults' ~1.1%: the densest TopK (as signs, as the defaults send) that fits, with its warm-up
    out = run_plan(capsys, "--params", "25000000", "--workers", "2", "--bandwidth", "100mbit", "--step-time", "200")
    assert out["compression"]["algorithm"] == ('ThresholdState(optimizer=opt, '
                                               'compression=gradshare.TopK(0.006, values="sign"))')
    assert "0.6%" in out["compression"]["warmup"]
    # so little fits that even TopK(0.001) is too much: average instead of sharing every step
    out = run_plan(capsys, "--params", "3716106", "--bandwidth", "10mbit", "--step-time", "15")
    assert out["compression"]["algorithm"].startswith("ParameterAveraging")
