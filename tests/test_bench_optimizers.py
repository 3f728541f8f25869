"""bench/optimizers.py, the drop-in with torch's optimizers: a run of it keeps replicas identical, picks the
compression for the optimizer, and RAdam (rescaled to the global batch's second moment from its step's
change) stays close to DDP. The README's tables come from this script."""
import os
import sys

import pytest

# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "bench"))
optimizers = pytest.importorskip("optimizers")


@pytest.mark.slow
def test_radam_and_rprop_rows():
    rows = {r["optimizer"]: r for r in optimizers.run(["radam", "rprop"], error_feedback="buffer")}
    for r in rows.values():
        assert r["gradshare"]["replicas_identical"] and r["ddp"]["replicas_identical"]
    assert rows["radam"]["gradshare"]["compression"] == "Ternary"
    assert rows["rprop"]["gradshare"]["compression"] == "TopK"      # its steps span decades
    # 3.4 points below DDP when RAdam's steps were shared as they are; 1.4 with the rescaling
    assert rows["radam"]["accuracy_gap_points"] > -2.5
    assert "| radam | Ternary |" in optimizers.markdown(list(rows.values()))


@pytest.mark.slow
def test_the_defaults_with_adamw():
    """The defaults: what waits kept in each rank's model, the top 5% as signs; after the last step every rank's
    parameters show the same mean result; AdamW ends near DDP at over 50x fewer bytes."""
    (row,) = optimizers.run(["adamw"])
    gs = row["gradshare"]
    assert row["error_feedback"] == "model"
    assert gs["replicas_identical"] and row["ddp"]["replicas_identical"]
    assert gs["compression"] == "TopK" and 1 / gs["bytes_ratio"] > 50
    assert abs(row["accuracy_gap_points"]) < 1.0 and row["loss_gap"] < 0.02
