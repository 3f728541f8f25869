"""How `gradshare train` starts its workers: each launcher runs the same per-rank
:func:`gradshare.train.train_job` on ``opts["workers"]`` processes and returns rank 0's summary.

- ``local``: processes on this machine (gradshare.parallel.launch_local), with checkpoints through
  gradshare.cluster.run when asked.
- ``torchrun``: ``python -m torch.distributed.run ... -m gradshare.cluster gradshare.train:train_job``
  (:func:`torchrun_command`), one node of a multi-host job or ``--standalone``.
- ``spark``: gradshare.spark.run through TorchDistributor.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional

from gradshare.workers import stop_process_group


class LaunchError(RuntimeError):
    """A launcher could not start the run or the run failed; the message says why and what to do."""


def _launch_local(opts: Dict[str, Any], launch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    from gradshare.parallel import launch_local
    from gradshare.train import train_job

    launch = launch or {}
    timeout = launch.get("timeout") or 86400.0
    if not launch.get("checkpoint_every"):
        return launch_local(train_job, opts, int(opts["workers"]), timeout=timeout)[0]
    job = {"opts": opts, "checkpoint_dir": launch["checkpoint_dir"], "checkpoint_every": launch["checkpoint_every"]}
    return launch_local(_checkpointed_job, job, int(opts["workers"]), timeout=timeout)[0]


def _checkpointed_job(job: Dict[str, Any]) -> Dict[str, Any]:
    # Local workers with checkpoints: cluster.run uses the process group launch_local initialised.
    from gradshare import cluster
    from gradshare.train import train_job

    return cluster.run(train_job, job["opts"], checkpoint_dir=job["checkpoint_dir"],
                       checkpoint_every=job["checkpoint_every"])


def torchrun_command(opts: Dict[str, Any], launch: Dict[str, Any], config: str, result: Optional[str] = None,
                     python: str = sys.executable) -> List[str]:
    """The torchrun command (argv) that runs gradshare.train.train_job on this host's ``opts["workers"]`` processes.

    ``config``: a JSON file or JSON text holding ``opts``. ``launch`` keys: nnodes, node_rank, rdzv_endpoint,
    rdzv_backend, rdzv_id, max_restarts, torchrun_args, checkpoint_dir, checkpoint_every (all optional).
    Without ``rdzv_endpoint`` the node is ``--standalone``.
    """
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={int(opts['workers'])}"]
    if launch.get("rdzv_endpoint"):
        cmd += [f"--nnodes={launch.get('nnodes', '1')}", f"--node_rank={int(launch.get('node_rank', 0))}",
                f"--rdzv_backend={launch.get('rdzv_backend', 'c10d')}",
                f"--rdzv_endpoint={launch['rdzv_endpoint']}", f"--rdzv_id={launch.get('rdzv_id', 'gradshare-train')}"]
    else:
        cmd += ["--standalone"]
    cmd += [f"--max_restarts={int(launch.get('max_restarts', 0))}", *launch.get("torchrun_args", []),
            "-m", "gradshare.cluster", "gradshare.train:train_job", "--config", config]
    if launch.get("checkpoint_dir"):
        cmd += ["--checkpoint-dir", str(launch["checkpoint_dir"]),
                "--checkpoint-every", str(int(launch.get("checkpoint_every") or 0))]
    if launch.get("collective_timeout") not in (None, 300.0):
        cmd += ["--collective-timeout", f"{float(launch['collective_timeout']):g}"]
    if result:
        cmd += ["--result", result]
    return cmd


def _launch_torchrun(opts: Dict[str, Any], launch: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Runs torchrun as a subprocess (its output goes to ours); rank 0's summary, or None when rank 0 ran on
    another host of a multi-host job."""
    work = launch["work_dir"]
    config, result = os.path.join(work, "config.json"), os.path.join(work, "result.json")
    with open(config, "w") as f:
        json.dump(opts, f)
    if os.path.exists(result):
        os.remove(result)
    cmd = torchrun_command(opts, launch, config, result)
    timeout = launch.get("timeout") or 86400.0
    # A session of its own: on a timeout or Ctrl-C the whole torchrun tree is stopped, no orphaned workers.
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except BaseException as exc:
        stop_process_group(proc, grace=10.0)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise LaunchError(f"torchrun did not finish within --timeout {timeout:g} s; it was stopped") from None
        raise
    if code != 0:
        raise LaunchError(f"torchrun failed with exit code {code} (the failing worker's traceback is in the "
                          f"output above); command: {shlex.join(cmd)}")
    if not os.path.exists(result):
        return None
    with open(result) as f:
        return json.load(f)


def _launch_spark(opts: Dict[str, Any], launch: Dict[str, Any]) -> Dict[str, Any]:
    try:
        import pyspark  # noqa: F401
        import pyspark.ml.torch.distributor  # noqa: F401
    except ImportError as exc:
        raise LaunchError(f"--launcher spark needs pyspark (and pandas, pyarrow): pip install gradshare[spark] "
                          f"({exc})") from None
    from gradshare import cluster, spark
    from gradshare.train import train_job

    workers = int(opts["workers"])
    kwargs: Dict[str, Any] = {"collective_timeout": float(launch.get("collective_timeout") or 300.0)}
    if launch.get("checkpoint_dir"):
        kwargs.update(checkpoint_dir=launch["checkpoint_dir"], checkpoint_every=int(launch.get("checkpoint_every") or 0))
    return spark.run(cluster.run, train_job, opts, master=launch.get("spark_master") or f"local[{workers}]",
                     num_processes=workers, max_retries=int(launch.get("max_restarts", 0)), **kwargs)


# launcher name -> function(options, launch options) -> rank 0's train_job summary (None: rank 0 is elsewhere)
LAUNCHERS: Dict[str, Callable[[Dict[str, Any], Dict[str, Any]], Optional[Dict[str, Any]]]] = {
    "local": _launch_local, "torchrun": _launch_torchrun, "spark": _launch_spark}
