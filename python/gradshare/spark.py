"""Run a per-rank training function on Spark through TorchDistributor (``pip install gradshare[spark]``).

Use :func:`run` when the data and the cluster are Spark's: it starts ``num_processes`` torch workers with
``pyspark.ml.torch.distributor.TorchDistributor`` and returns rank 0's result. Inside the function torch's
environment is set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) but no process group exists yet: pass
``gradshare.cluster.run`` as the function to get the process group, timeouts and checkpoint resume::

    from gradshare import cluster, spark
    result = spark.run(cluster.run, train_fn, config, master="local-cluster[2,1,1024]",
                       checkpoint_dir="/shared/ckpt", checkpoint_every=100)

Modes. With a ``local``/``local[N]`` master (``local_mode`` default True) TorchDistributor runs torchrun on the
driver (``--standalone``): no Spark task is involved. With any other master (``local-cluster[...]``,
``spark://``, YARN, Kubernetes) it runs one barrier task per process, each running a one-process torchrun
node. The function and its arguments are cloudpickled: a function defined in ``__main__`` or in a module the
workers cannot import is shipped by value only if registered with
``pyspark.cloudpickle.register_pickle_by_value(module)`` (pyspark's own copy of cloudpickle).

Results. Rank 0's return value is returned. In local mode every rank writes the result file and the last rank
to finish wins: the function must return the same value on every rank, which ``gradshare.cluster.run``
ensures (it hands every rank rank 0's result).

Failures (measured with pyspark 4.3.0 here, see tests/test_spark.py). Spark does not restart a failed torch
worker, and TorchDistributor runs torchrun without ``--max-restarts``:

- Local mode: a worker that raises or dies makes torchrun stop the other workers; TorchDistributor's process
  wrapper exits 0 regardless, so the failure surfaces as RuntimeError("TorchDistributor failed during
  training. View stdout logs ...") with the traceback only in the job's output. Nothing is retried.
- Barrier mode (``local-cluster``, real clusters): the failed task fails the barrier stage, Spark kills the
  other tasks and aborts the job: "Job aborted due to stage failure: Could not recover from a failed barrier
  ResultStage". TorchDistributor's job is a single barrier ResultStage, and Spark's DAGScheduler aborts a
  failed barrier ResultStage outright (only barrier ShuffleMapStages are resubmitted), so no retry setting
  brings it back. Each worker ran exactly once.

So recovery is this module's: ``run(..., max_retries=N)`` reruns the whole distributed job after a failure,
up to N times. Every rerun starts all workers afresh; with ``gradshare.cluster.run`` and a ``checkpoint_dir``
they resume from the newest complete checkpoint, so the run continues where it was and counts no step twice
(the test kills a worker mid-run under ``local-cluster[2,1,1024]`` and gets the uninterrupted run's
parameters).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Dict, Optional

LOOPBACK = "127.0.0.1"
log = logging.getLogger(__name__)


def _is_local_master(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def _is_loopback_master(master: str) -> bool:
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster[")


def session(master: str = "local[2]", app_name: str = "gradshare", conf: Optional[Dict[str, str]] = None,
            bind_loopback: Optional[bool] = None):
    """Creates (or gets) a SparkSession for ``master``; local masters are bound to 127.0.0.1.

    ``conf``: extra Spark settings. ``bind_loopback``: default True for ``local*`` masters, which keeps the
    driver, executors and their block managers off the machine's external addresses.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and active.sparkContext.master != master:
        # getOrCreate would silently hand back the running session, on the wrong master.
        raise RuntimeError(f"a SparkSession on {active.sparkContext.master!r} is running; stop it or pass it as "
                           f"spark= instead of asking for {master!r}")
    if bind_loopback is None:
        bind_loopback = _is_loopback_master(master)
    builder = SparkSession.builder.master(master).appName(app_name)
    settings: Dict[str, str] = {"spark.ui.enabled": "false",
                                "spark.executorEnv.PYSPARK_PYTHON": sys.executable}
    if bind_loopback:
        # Read when the JVM starts (the driver and, in local-cluster, the workers it forks).
        os.environ["SPARK_LOCAL_IP"] = LOOPBACK
        settings.update({"spark.driver.host": LOOPBACK, "spark.driver.bindAddress": LOOPBACK,
                         "spark.executorEnv.SPARK_LOCAL_IP": LOOPBACK})
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def run(fn: Callable, *args: Any, spark=None, master: Optional[str] = None, num_processes: int = 2,
        use_gpu: bool = False, local_mode: Optional[bool] = None, conf: Optional[Dict[str, str]] = None,
        max_retries: int = 0, **kwargs: Any) -> Any:
    """Runs ``fn(*args, **kwargs)`` on ``num_processes`` torch workers through Spark; returns rank 0's result.

    ``spark``: an existing (active) SparkSession to use; left running. ``master``: create a session for this
    master (loopback-bound when local) and stop it afterwards. With neither, the active session is used, or
    a ``local[num_processes]`` one is created and stopped. ``local_mode``: TorchDistributor's; default True
    for ``local``/``local[N]`` masters (torchrun on the driver) and False otherwise (barrier tasks).
    ``max_retries``: rerun the whole job this many times after a failure (Spark itself never does; see the
    module docstring); useful with ``gradshare.cluster.run`` and checkpoints. The last failure is raised.
    """
    from pyspark.sql import SparkSession
    from pyspark.ml.torch.distributor import TorchDistributor

    if spark is not None and master is not None:
        raise ValueError("pass either spark or master, not both")
    own = False
    if spark is None:
        active = SparkSession.getActiveSession() if master is None else None
        if active is not None:
            spark = active
        else:
            spark = session(master or f"local[{num_processes}]", conf=conf)
            own = True
    try:
        if local_mode is None:
            local_mode = _is_local_master(spark.sparkContext.master)
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        for attempt in range(max_retries + 1):
            distributor = TorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=use_gpu)
            try:
                return distributor.run(fn, *args, **kwargs)
            except Exception as exc:
                if attempt == max_retries:
                    raise
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
                reason = next((ln for ln in lines if "aborted" in ln or "failed" in ln), lines[0])
                log.warning("distributed job failed (attempt %d of %d), running it again: %s",
                            attempt + 1, max_retries + 1, reason[:500])
    finally:
        if own:
            spark.stop()
