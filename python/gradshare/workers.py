"""Run a function on N local worker processes joined in a torch.distributed process group.

The one place gradshare starts local processes (ParallelWrapper, `gradshare train`, the tests). Every
wait is bounded: a worker that raises or dies ends the whole run with its traceback, never a hang. A run
that outlives its ``timeout`` first has every worker still alive print all its threads' Python stacks to
its stderr (faulthandler, on SIGUSR1: it works while a thread holds the GIL), so that a stall says where
it is before the workers are stopped.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import subprocess
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradshare import process_group


# The signal on which a worker prints every thread's stack (run_local sends it when a run times out).
STACKS_SIGNAL = signal.SIGUSR1


class WorkerError(RuntimeError):
    """A worker raised or died; the message carries its rank and traceback."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"worker {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


def stop_process_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stops a child started with ``start_new_session=True`` and everything it spawned.

    SIGTERM to its process group, up to ``grace`` seconds to exit, then SIGKILL (5 s more). Returns at once
    if the process has already exited.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _entry(rank: int, world_size: int, port: int, backend: str, threads: int, collective_timeout: float,
           fn: Callable, args: Sequence, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        faulthandler.register(STACKS_SIGNAL, all_threads=True)     # run_local's timeout asks for the stacks
    except (AttributeError, RuntimeError, ValueError, OSError):    # no usable stderr: no stacks, the run goes on
        pass
    torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=collective_timeout)
        # every rank a client of the store run_local serves (rank 0 serving a port chosen beforehand would race
        # any other process on the machine for it between the choice and the bind)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        process_group.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
        # Pickled here, to bytes: the queue's own pickler would pass a tensor's storage as a file descriptor that
        # this process serves until the parent takes it, and this process may exit first (the parent then fails
        # with FileNotFoundError). Pickling here also reports an unpicklable result as this worker's error.
        out = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
        results.put((rank, True, out))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            process_group.destroy_process_group()
        except Exception:
            pass


def _print_stacks(procs, done, settle: float = 2.0) -> List[int]:
    """Has each live worker that has not reported print its threads' stacks to its stderr; their ranks."""
    stalled = [r for r, p in enumerate(procs) if r not in done and p.is_alive()]
    for r in stalled:
        try:
            os.kill(procs[r].pid, STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    if stalled:
        time.sleep(settle)          # the dump is written by the worker's signal handler: give it a moment
    return stalled


def run_local(fn: Callable, world_size: int, args: Sequence = (), *, backend: str = "gloo",
              threads: Optional[int] = None, timeout: float = 300.0, collective_timeout: float = 60.0) -> List[Any]:
    """Runs ``fn(*args)`` on ``world_size`` spawned processes; returns each rank's result, by rank.

    ``fn`` must be importable (defined at module level). Inside it, torch.distributed is initialised
    (RANK/WORLD_SIZE/LOCAL_RANK are set). ``threads``: torch threads per worker (default: the cores split
    between workers). Raises WorkerError with the first failing worker's traceback, TimeoutError when the
    whole run exceeds ``timeout`` seconds (each worker still running has printed its threads' stacks to its
    stderr by then); collectives give up after ``collective_timeout``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The rendezvous store, served here on a port the system picks as it binds: nothing can take the port
    # between its choice and its use, as with a free port handed to the workers to bind.
    store = process_group.serving_store("127.0.0.1", 0, world_size, timedelta(seconds=collective_timeout))
    port = store.port
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world_size, port, backend, threads, collective_timeout, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: List[Any] = [None] * world_size
    done = set()
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and not p.is_alive() and p.exitcode not in (0, None):
                        # Give a dying worker's queued traceback a moment to arrive before blaming a signal.
                        try:
                            rank, ok, value = results.get(timeout=1.0)
                            break
                        except queue.Empty:
                            raise WorkerError(r, f"process exited with code {p.exitcode} without reporting") from None
                else:
                    if time.monotonic() > deadline:
                        stalled = _print_stacks(procs, done)
                        raise TimeoutError(f"local run did not finish within {timeout:.0f} s; workers {stalled} "
                                           "had not reported (their threads' stacks are on stderr)")
                    continue
            if not ok:
                # A peer's "connection reset" often follows another worker's death: name the dead one.
                time.sleep(0.5)
                for r, p in enumerate(procs):
                    if r != rank and not p.is_alive() and p.exitcode not in (0, None):
                        raise WorkerError(r, f"process exited with code {p.exitcode} without reporting "
                                             f"(worker {rank} then failed:\n{value})")
                raise WorkerError(rank, value)
            out[rank] = pickle.loads(value)
            done.add(rank)
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        results.close()
        del store          # after the workers: they used it until the end
    return out
