"""bench/second_moment_window.py on bench/quality.py's workloads: the simulated ranks, with nothing compressed, are
DDP where there is one rank, and the script refuses a workload the rescaling does not serve."""
import math
import os
import sys

import pytest

# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "bench"))
window = pytest.importorskip("second_moment_window")


def test_one_simulated_rank_is_ddp_and_two_are_not():
    ddp = window.run_workload("regression_adamw", "ddp", seed=0, world=1, steps=40)
    one = window.run_workload("regression_adamw", "gradshare", seed=0, world=1, steps=40)
    assert math.isfinite(ddp) and one == pytest.approx(ddp, rel=1e-4)
    two = window.run_workload("regression_adamw", "gradshare", seed=0, world=2, steps=40)
    ddp_two = window.run_workload("regression_adamw", "ddp", seed=0, world=2, steps=40)
    assert math.isfinite(two) and two != ddp_two


def test_the_workloads_are_the_adam_family_ones(capsys):
    names = window.adam_workloads()
    assert "copy_lstm" in names and "char_lm" in names
    assert "mnist_cnn" not in names and "char_lm_muon" not in names      # SGD; two optimizers
    with pytest.raises(SystemExit):
        window.main(["--workloads", "mnist_cnn"])
    assert "--workloads: ['mnist_cnn']" in capsys.readouterr().err
