"""gradshare.spark on Spark's local mode and a local-cluster master, bound to loopback.

Each test starts and stops its own SparkSession (13-40 s each here). Skipped without pyspark/pandas/pyarrow
(`pip install gradshare[spark]`).
"""
import functools
import logging
import os

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

from pyspark import cloudpickle  # noqa: E402  (the copy TorchDistributor pickles with)

import cluster_job  # noqa: E402
from gradshare import checkpoint, cluster, spark  # noqa: E402

# Spark workers cannot import the tests folder: ship the job module by value.
cloudpickle.register_pickle_by_value(cluster_job)

CONFIG = {"data": "synthetic", "steps": 40, "batch": 16, "lr": 0.05, "seed": 3}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    return cluster_job.reference(CONFIG)


def test_local_mode_matches_run_local(reference):
    out = spark.run(cluster.run, cluster_job.train, CONFIG, master="local[2]", num_processes=2)
    assert out["world_size"] == 2 and out["stats"]["steps"] == 40
    assert out["params"] == reference["params"]


def test_local_mode_failure_is_raised_and_not_retried(tmp_path):
    # torchrun's failure reaches TorchDistributor only as a missing result ("failed during training").
    with pytest.raises(RuntimeError, match="failed during training|failed with return code"):
        spark.run(cluster_job.fail_on_rank_1, str(tmp_path), master="local[2]", num_processes=2)
    attempts = [n for n in os.listdir(tmp_path) if n.startswith("attempt-1-")]
    assert len(attempts) == 1


def test_local_cluster_matches_run_local_and_recovers_through_run_retries(tmp_path, reference, caplog):
    """One local-cluster session, two jobs. First a plain run. Then rank 1 is SIGKILLed at step 25: Spark aborts
    the job (a failed barrier ResultStage is never resubmitted) and run(max_retries=1) starts a second job,
    which resumes from the step-20 checkpoint and ends with the uninterrupted run's parameters."""
    session = spark.session("local-cluster[2,1,1024]")
    try:
        with pytest.raises(RuntimeError, match="is running"):
            spark.session("local[2]")
        plain = spark.run(cluster.run, cluster_job.train, CONFIG, spark=session, num_processes=2)
        assert plain["world_size"] == 2 and plain["stats"]["steps"] == 40
        assert plain["params"] == reference["params"]

        ckpt_dir = tmp_path / "ckpt"
        config = dict(CONFIG, kill_at_step=25, kill_rank=1, kill_once_file=str(tmp_path / "killed"),
                      attempt_log=str(tmp_path / "attempts.log"))
        run = functools.partial(cluster.run, checkpoint_dir=str(ckpt_dir), checkpoint_every=10)
        with caplog.at_level(logging.WARNING, logger="gradshare.spark"):
            out = spark.run(run, cluster_job.train, config, spark=session, num_processes=2, max_retries=1)
        assert session.sparkContext._jsc is not None  # a session passed in is left running
    finally:
        session.stop()
    assert (tmp_path / "killed").exists()
    assert "Could not recover from a failed barrier ResultStage" in caplog.text
    assert out["resumed_from"] == 20
    assert out["stats"]["steps_seen"] == list(range(40))
    assert out["params"] == reference["params"]
    lines = (tmp_path / "attempts.log").read_text().split("\n")
    assert sum("rank=0 step=0" in ln for ln in lines) == 1  # Spark did not rerun the first job's stage
    assert sum("rank=0 step=24" in ln for ln in lines) == 2  # ran before the kill and again after the retry
    assert checkpoint.load_latest(str(ckpt_dir)).step == 40
