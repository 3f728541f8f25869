import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from gradshare.workers import WorkerError, run_local, stop_process_group


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return (dist.get_rank(), dist.get_world_size(), float(t))


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait forever without the run's error handling
    return "unreachable"


def _die_on_rank_0():
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def test_run_local_returns_results_by_rank():
    assert run_local(_sum_ranks, 2, timeout=60) == [(0, 2, 3.0), (1, 2, 3.0)]


def _tensor_and_exit():
    return torch.full((1000,), float(dist.get_rank()))


def _unpicklable():
    return lambda: None


def test_results_arrive_as_copies_that_outlive_their_worker():
    # A tensor passed as a shared-memory file descriptor needs its worker alive until the parent takes it; a
    # worker that had already exited made the parent fail with FileNotFoundError. Results now arrive as copies.
    out = run_local(_tensor_and_exit, 2, timeout=60)
    for rank, t in enumerate(out):
        assert not t.is_shared()
        assert torch.equal(t, torch.full((1000,), float(rank)))


def test_an_unpicklable_result_is_the_worker_s_error():
    with pytest.raises(WorkerError, match="pickle|lambda"):
        run_local(_unpicklable, 2, timeout=60)


def test_worker_exception_is_raised_with_traceback():
    with pytest.raises(WorkerError, match="boom from rank 1") as info:
        run_local(_fail_on_rank_1, 2, timeout=60, collective_timeout=30)
    assert info.value.rank == 1


def test_dead_worker_ends_the_run():
    with pytest.raises(WorkerError, match="exited with code 7"):
        run_local(_die_on_rank_0, 2, timeout=60, collective_timeout=30)


def _stall_in_rank_1():
    # both ranks connected first: else rank 0, done at once, may leave while rank 1 still connects to it (on a
    # loaded machine), and rank 1's process group fails instead of stalling
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(600)


def test_a_stalled_run_prints_where_its_workers_are(capfd):
    # A timeout says which workers had not reported, and each prints every thread's stack to its stderr first,
    # so that a stall anywhere (a collective, a lock, the process group's teardown) shows where it is.
    with pytest.raises(TimeoutError, match=r"workers \[1\] had not reported"):
        run_local(_stall_in_rank_1, 2, timeout=20, collective_timeout=30)
    err = capfd.readouterr().err
    assert "most recent call first" in err and "in _stall_in_rank_1" in err


def _alive(pid: int) -> bool:
    """Running (a zombie that only waits to be reaped counts as stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_process_group_stops_the_child_and_what_it_spawned():
    # the child ignores SIGTERM and starts a grandchild: only the SIGKILL to the whole group ends both
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(g.pid, flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(proc.stdout.readline())
    assert _alive(grandchild)
    stop_process_group(proc, grace=0.5)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    stop_process_group(proc)          # already stopped: returns at once


def _listening_addresses():
    import subprocess

    out = subprocess.run(["ss", "-ltn", "-p"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_workers_listen_on_the_rendezvous_address_only():
    # torch's own store (and gloo, without GLOO_SOCKET_IFNAME) would listen on every interface of the host
    for addresses in run_local(_listening_addresses, 2, timeout=60):
        assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
