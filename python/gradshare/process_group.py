"""Joining and leaving a torch.distributed process group so that no collective outlives the interpreter.

Every process that gradshare starts or runs (``python -m gradshare.cluster`` under torchrun or Spark, the
local workers of ParallelWrapper and ``gradshare train``) joins its group with :func:`init_process_group`
and leaves it with :func:`destroy_process_group`.

Why this needs care: a gloo process group runs its collectives on native worker threads. When one of
them drops the last reference to a finished collective, it frees that collective's tensors, which needs
the GIL. Once the interpreter has begun to shut down, a thread asking for the GIL is ended with
``pthread_exit``, which unwinds through a ``noexcept`` frame: ``std::terminate``, "terminate called
without an active exception", exit status -6 after a job that finished. The threads are joined only
when the group itself is freed, and ``dist.destroy_process_group()`` frees it only if nothing else still
references it. Two things did:

- ``torch.distributed.nn.functional`` declares its ten collectives with ``group=group.WORLD`` defaults,
  evaluated when the module is first imported. ``torch._dynamo`` imports it, and DDP imports
  ``torch._dynamo`` in its constructor, so a DDP model built after ``init_process_group`` pinned the
  default group for the life of the process. Importing that module *before* joining makes those
  defaults ``None`` (no group exists yet), which is what they mean anyway.
- gradshare's own exchange channels kept a private payload group (gradshare.comm.Channel); they now hold
  it weakly.

The same abort can end a user's own script that registered gradshare's hook, whatever group it joined:
the callbacks that gradshare chains on a collective's future (:func:`chain`) run on the gloo thread that
completed it, which then releases them, and releasing a Python callable takes the GIL. Likewise, the thread
that ran a collective drops it (and its tensors, whose Python objects need the GIL) just after waking the
caller. So a script whose last step just ended can reach the interpreter's finalization while that thread
is still releasing either (seen: ~20% of 2-rank torchrun runs of a DDP script with the hook aborted at exit,
in ``AsyncAllgatherWork``'s destructor). Every callback gradshare chains is counted from when it runs until it
is released, and an ``atexit`` handler (which runs while the interpreter is still whole) waits, up to a few
seconds, until none is left and gloo's collective threads are seen asleep.

The rendezvous store that rank 0 serves listens on the rendezvous address only (:func:`serving_store`),
not on every interface of the host as torch's own does. Where gradshare picks the port itself (the local
workers, a world of one), the store binds port 0 and reports the port the system gave it: a port chosen
first and bound later could be taken by any other socket in between.

:func:`destroy_process_group` then checks that the backend's threads really ended and warns, naming the
likely cause, when something (a user object holding a group) still keeps one alive.
"""
from __future__ import annotations

import atexit
import gc
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist

# Native thread names of a gloo process group: its collective workers and its transport loop.
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


_released = threading.Condition(threading.RLock())   # re-entrant: a release may run inside a locked section
_running = 0                                          # callbacks that ran and are not released yet


class _Counted:
    """A future's callback, counted from when it runs until the thread that ran it releases it."""

    __slots__ = ("fn", "ran")

    def __init__(self, fn: Callable[[torch.futures.Future], Any]):
        self.fn, self.ran = fn, False

    def __call__(self, fut: torch.futures.Future) -> Any:
        global _running
        with _released:
            _running += 1
            self.ran = True
        return self.fn(fut)

    def __del__(self) -> None:
        global _running
        if self.ran:
            with _released:
                _running -= 1
                _released.notify_all()


def chain(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until the thread that runs it has released it (module docstring)."""
    return fut.then(_Counted(fn))


@atexit.register
def _let_backend_threads_finish(timeout: float = 5.0) -> None:
    """At exit, while the interpreter is still whole: until every chained callback that ran has been released
    and gloo's collective threads have been seen asleep three times in a row, 10 ms apart, without the GIL
    (a thread still dropping a finished collective, whose tensors' Python objects need the GIL, is running or
    runnable until it is done; on a loaded machine that can take longer than any fixed pause). At most
    ``timeout`` seconds (module docstring)."""
    deadline = time.monotonic() + timeout
    with _released:
        while _running > 0 and time.monotonic() < deadline:
            _released.wait(timeout=0.01)
    asleep = 0
    while asleep < 3 and time.monotonic() < deadline:
        states = _worker_states()
        if not states:
            return
        asleep = asleep + 1 if all(st in "SD" for st in states) else 0
        time.sleep(0.01)


def _worker_states() -> List[str]:
    """The scheduler state (R, S, D, ...) of each of this process's gloo collective threads (Linux)."""
    states = []
    for tid, name in _gloo_tasks():
        if name != GLOO_THREADS[0]:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states


def _import_before_joining() -> None:
    # Evaluates torch.distributed.nn.functional's `group=group.WORLD` defaults while no group exists.
    import torch.distributed.nn.functional  # noqa: F401


def serving_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server that listens on ``host``'s address only (torch's own listens on every interface), on
    ``port`` (0: a free one; the store's ``port`` tells which)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(512)
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()          # the store owns the descriptor now and closes it itself
    return store


def init_process_group(backend: str, *, rank: int, world_size: int, timeout: timedelta, store=None) -> None:
    """``dist.init_process_group`` after the imports that would otherwise pin the group. Without ``store``, the
    rendezvous is MASTER_ADDR:MASTER_PORT from the environment, served by rank 0 on that address only."""
    _import_before_joining()
    if store is None:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0:
            store = serving_store(host, port, world_size, timeout)
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _gloo_tasks() -> List[Tuple[str, str]]:
    """(thread id, name) of this process's live gloo threads (Linux; an empty list where /proc is not available)."""
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in GLOO_THREADS:
            out.append((tid, name))
    return out


def backend_threads() -> List[str]:
    """Names of this process's live gloo threads (Linux; an empty list where /proc is not available)."""
    return [name for _, name in _gloo_tasks()]


def destroy_process_group(wait: float = 5.0) -> List[str]:
    """Destroys every group (``dist.destroy_process_group()``) and waits until the backend threads ended.

    Returns the names of gloo threads still alive after ``wait`` seconds (an empty list when all ended)
    and warns when there are any: something still references a process group, and the interpreter may
    abort at exit.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups referenced only from reference cycles (a model wrapped in DDP) are freed here
    deadline = time.monotonic() + wait
    left = backend_threads()
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = backend_threads()
    if left:
        warnings.warn(f"{len(left)} gloo thread(s) still alive after destroy_process_group(): an object still "
                      "holds a process group (for example a module imported after init_process_group that "
                      "keeps dist.group.WORLD, or a group stored in a global). The process may abort "
                      "(SIGABRT) at exit.", RuntimeWarning, stacklevel=2)
    return left
