"""Run one per-rank training function under torchrun (one or many hosts), Spark or locally, resuming from checkpoints.

Use :func:`run` as the body of every worker process of a cluster job. It joins the process group that the
launcher describes (torchrun and Spark's TorchDistributor set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), loads the newest checkpoint when one exists, and calls
``train_fn(config, ctx)``; the :class:`Context` ``ctx`` says who this rank is, what to resume from and
saves checkpoints. The same ``train_fn`` runs unchanged:

- on torchrun, one host or many (``torchrun ... -m gradshare.cluster pkg.module:train_fn --config cfg.json``,
  or a script calling :func:`run`); with ``--max-restarts K`` torchrun restarts every worker when one dies and
  each new worker resumes from the newest complete checkpoint;
- on Spark: ``gradshare.spark.run(gradshare.cluster.run, train_fn, config, checkpoint_dir=...)``;
- locally: ``gradshare.workers.run_local(gradshare.cluster.run, n, (train_fn, config))`` (an already
  initialised process group is used as is).

Fault tolerance. Collectives time out after ``collective_timeout`` seconds, so a peer that dies or hangs ends
the survivors with an error instead of a hang (gloo usually reports a dead peer at once as a closed
connection). What survives a death is what the last checkpoint holds: ``train_fn`` saves with
:meth:`Context.save` every ``checkpoint_every`` steps and restores with :meth:`Context.restore`; steps done after
that checkpoint are redone, and statistics totals kept in the checkpoint count each step once.

Checkpoint storage. Only rank 0 writes and only rank 0 reads: at start it loads the newest checkpoint and sends
every rank the shared state and its own per-rank state, so ``checkpoint_dir`` has to exist only where rank 0
runs (it must survive restarts there; with torchrun on several hosts rank 0 is on ``--node_rank=0``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from gradshare import checkpoint as ckpt
from gradshare import process_group

log = logging.getLogger(__name__)


@dataclass
class Context:
    """What a rank's training function needs from its launcher: identity, the resume point, checkpoint saving.

    ``resumed`` is the checkpoint this run starts from (None on a fresh start): its ``step`` and shared
    ``state``; its ``ranks`` list is left empty, this rank's own entry is :meth:`rank_state`.
    """

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    checkpoint_dir: Optional[str]
    checkpoint_every: int
    keep_last: int
    resumed: Optional[ckpt.Checkpoint]
    _own_rank_state: Optional[Dict[str, Any]] = None

    @property
    def start_step(self) -> int:
        """The step to continue from: the resumed checkpoint's step, 0 on a fresh start."""
        return self.resumed.step if self.resumed is not None else 0

    def rank_state(self) -> Optional[Dict[str, Any]]:
        """This rank's saved per-rank state, or None (fresh start, or the world size changed since the save)."""
        return self._own_rank_state

    def should_save(self, step: int) -> bool:
        """True when a checkpoint is due after ``step`` completed steps."""
        return bool(self.checkpoint_dir) and self.checkpoint_every > 0 and step > 0 \
            and step % self.checkpoint_every == 0 and step != self.start_step

    def save(self, step: int, state: Mapping[str, Any], rank_state: Optional[Mapping[str, Any]] = None) -> str:
        """Writes the checkpoint for ``step`` (collective: every rank calls it). See :func:`checkpoint.save`."""
        if not self.checkpoint_dir:
            raise RuntimeError("no checkpoint_dir was given to cluster.run")
        return ckpt.save(self.checkpoint_dir, step, state, rank_state, keep_last=self.keep_last)

    def restore(self, objects: Optional[Mapping[str, Any]] = None,
                rank_objects: Optional[Mapping[str, Any]] = None, rng: bool = True) -> bool:
        """Loads the resumed checkpoint into live objects (see :meth:`Checkpoint.restore`); False on a fresh start.

        When the world size changed since the save, per-rank objects keep their fresh state and RNG states
        are not restored (a warning says so); shared objects are restored either way.
        """
        if self.resumed is None:
            return False
        for name, obj in (objects or {}).items():
            obj.load_state_dict(self.resumed.state[name])
        mine = self._own_rank_state
        if mine is None:
            if rank_objects or rng:
                warnings.warn(f"checkpoint {self.resumed.path} was written by {self.resumed.world_size} ranks, "
                              f"this run has {self.world_size}: per-rank state and RNG states start afresh")
            return True
        for name, obj in (rank_objects or {}).items():
            obj.load_state_dict(mine[name])
        if rng and "rng" in mine:
            ckpt.set_rng_state(mine["rng"])
        return True


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _init_process_group(backend: Optional[str], collective_timeout: float) -> bool:
    """Joins the group described by the environment; returns True when this call created it."""
    if dist.is_initialized():
        return False
    alone = "RANK" not in os.environ or "WORLD_SIZE" not in os.environ
    if alone:
        # Plain `python script.py`: a world of one, so the same function runs without a launcher.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    timeout = timedelta(seconds=collective_timeout)
    if alone:    # its store on a port the system picks as it binds (a port chosen first could be taken meanwhile)
        store = process_group.serving_store("127.0.0.1", 0, 1, timeout)
        os.environ["MASTER_PORT"] = str(store.port)
    else:
        store = _restart_safe_store(timeout)
    process_group.init_process_group(backend, store=store, rank=_env_int("RANK", 0),
                                     world_size=_env_int("WORLD_SIZE", 1), timeout=timeout)
    return True


def _restart_safe_store(timeout: timedelta):
    """Under torchrun's shared agent store: a fresh store for this round's process group, else None (env://).

    torchrun (torch 2.13, c10d rendezvous) keeps one TCPStore for the whole job and hands it to the workers
    of every round. The process group's keys written by the workers of a failed round are still there when
    the next round's workers join, and gloo then connects to dead workers' addresses ("connectFullMesh failed
    ... Connection refused", or a wait until the timeout). No name for the round is shared by every worker
    (TORCHELASTIC_RESTART_COUNT is per agent: a node restarted for a membership change keeps its count), so
    rank 0 starts a store of its own and announces its port through the agent store. An announcement left
    by an earlier round names a store whose owner is dead: the connection fails and the worker reads the
    announcement again until the current one appears. Same effect as launching torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    key = "gradshare/process_group_store"
    if rank == 0:
        own = process_group.serving_store(addr, 0, world, timeout)
        agent.set(key, json.dumps([addr, own.port]))
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, own_port = json.loads(agent.get(key))
        try:
            own = dist.TCPStore(host, own_port, world, is_master=False,
                                timeout=min(timeout, timedelta(seconds=5)))
            own.set_timeout(timeout)
            return own
        except Exception as exc:  # a previous round's store: its owner is gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0's process group store ({host}:{own_port}) did not answer within "
                                   f"{timeout.total_seconds():.0f} s: {exc}") from exc
            time.sleep(0.5)


def _resume(checkpoint_dir: Optional[str], rank: int, world: int):
    """Rank 0 loads the newest checkpoint; every rank gets the shared state and its own per-rank state."""
    loaded = ckpt.load_latest(checkpoint_dir) if (checkpoint_dir and rank == 0) else None
    if world == 1:
        if loaded is None:
            return None, None
        mine = loaded.ranks[0] if loaded.world_size == 1 else None
        return loaded, mine
    header = [None]
    if rank == 0 and loaded is not None:
        header = [ckpt.Checkpoint(path=loaded.path, step=loaded.step, world_size=loaded.world_size,
                                  state=loaded.state, ranks=[])]
    dist.broadcast_object_list(header, src=0)
    found = header[0]
    if found is None:
        return None, None
    same_world = found.world_size == world
    mine = [None]
    dist.scatter_object_list(mine, list(loaded.ranks) if (rank == 0 and same_world) else
                             ([None] * world if rank == 0 else None), src=0)
    return found, mine[0]


def run(train_fn: Callable[[Any, Context], Any], config: Any = None, *, checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 0, keep_last: int = 3, backend: Optional[str] = None,
        collective_timeout: float = 300.0) -> Any:
    """Runs ``train_fn(config, ctx)`` on this rank of a torchrun / Spark / local job; returns its result.

    Joins the process group from the environment (or uses the initialised one; with no launcher at all, runs
    as a world of one), resumes from the newest loadable checkpoint in ``checkpoint_dir`` and hands the
    :class:`Context` to ``train_fn``. ``checkpoint_every``: steps between checkpoints (``ctx.should_save``);
    ``keep_last``: checkpoints kept. ``backend``: default nccl when CUDA is present, else gloo.
    ``collective_timeout``: seconds after which a collective waiting on a dead or stuck peer raises.
    Every rank returns rank 0's result (so a per-rank result cannot leak out of Spark's local mode).
    The process group is destroyed on return only if this call created it.
    """
    created = _init_process_group(backend, collective_timeout)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        resumed, mine = _resume(checkpoint_dir, rank, world)
        ctx = Context(rank=rank, world_size=world, local_rank=_env_int("LOCAL_RANK", rank),
                      restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0), checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every, keep_last=keep_last, resumed=resumed,
                      _own_rank_state=mine)
        if resumed is not None and rank == 0:
            log.info("resuming from %s (step %d)", resumed.path, resumed.step)
        result = train_fn(config, ctx)
        if world > 1:
            # Every rank returns rank 0's result: Spark's local mode keeps whichever rank finishes last.
            box = [result if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        return result
    finally:
        if created:
            # Joins the backend's threads before the interpreter shuts down (gradshare.process_group).
            process_group.destroy_process_group()


# ------------------------------------------------------------------------------- `python -m gradshare.cluster`
def load_function(spec: str) -> Callable:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    if target.endswith(".py"):
        module_name = "_gradshare_job_" + os.path.splitext(os.path.basename(target))[0]
        loader = importlib.util.spec_from_file_location(module_name, target)
        if loader is None:
            raise ValueError(f"cannot load {target}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


def _read_config(text: Optional[str]) -> Any:
    if text is None:
        return None
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


def main(argv=None) -> int:
    """Entry point for torchrun: ``torchrun [torchrun options] -m gradshare.cluster FN [options]``."""
    p = argparse.ArgumentParser(prog="python -m gradshare.cluster",
                                description="Run a per-rank training function fn(config, ctx) under torchrun, "
                                            "resuming from the newest checkpoint.")
    p.add_argument("function", help="MODULE:FUNCTION or FILE.py:FUNCTION taking (config, ctx)")
    p.add_argument("--config", help="JSON text or a JSON file passed to the function as config")
    p.add_argument("--checkpoint-dir", help="where rank 0 keeps checkpoints (must survive restarts)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: never)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    p.add_argument("--collective-timeout", type=float, default=300.0,
                   help="seconds before a collective waiting on a dead or stuck peer fails")
    p.add_argument("--result", help="rank 0 writes the function's result here as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + os.environ.get("RANK", "?")
                        + " %(name)s: %(message)s")
    result = run(load_function(args.function), _read_config(args.config), checkpoint_dir=args.checkpoint_dir,
                 checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, backend=args.backend,
                 collective_timeout=args.collective_timeout)
    if args.result and _env_int("RANK", 0) == 0:
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
