import os

import pytest
import torch
import torch.distributed as dist

from gradshare.workers import WorkerError, run_local


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


def test_worker_exception_is_raised_with_traceback():
    with pytest.raises(WorkerError, match="boom from rank 1") as info:
        run_local(_fail_on_rank_1, 2, timeout=60, collective_timeout=30)
    assert info.value.rank == 1


def test_dead_worker_ends_the_run():
    with pytest.raises(WorkerError, match="exited with code 7"):
        run_local(_die_on_rank_0, 2, timeout=60, collective_timeout=30)
