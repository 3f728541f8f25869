"""A finished job exits 0: no process group, and so no gloo thread, outlives gradshare's teardown.

A gloo thread still running when the interpreter shuts down is ended when it asks for the GIL (to free
a finished collective's tensors), which aborts the process (SIGABRT) after training finished
(gradshare.process_group explains the mechanism). The first test checks the cause directly: after
``cluster.run`` returns, no gloo thread is left. The second checks the symptom: many short two-rank jobs,
all started at once so that the machine is loaded, all exit 0.
"""
import json
import os
import random
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_PORTS_USED = set()


def _port() -> int:
    """A MASTER_PORT for one job that no other process takes before its rank 0 binds it: below the system's
    ephemeral range (which every connect() and bind to port 0 draws from, gloo's sockets included), not given
    to another job of this module, and free now. (A port from bind(("", 0)), closed and handed over, can be
    drawn again by any socket in between: two jobs then met on one port and one hung.)"""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _PORTS_USED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_USED.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")

SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import cluster_job
from gradshare import cluster, process_group
config = json.loads(sys.argv[1])
out = cluster.run(getattr(cluster_job, config.pop("job", "train")), config)
print("RESULT " + json.dumps({{"threads": process_group.backend_threads(), "steps": out["stats"]["steps"]}}))
"""


# A user's own DDP script with the hook, joining and leaving as torch's documentation shows: gradshare does not
# manage its process group, so only what gradshare launches (its chained callbacks, its collectives' tensors,
# released by gloo's threads) can race the interpreter's exit (gradshare.process_group).
USER_SCRIPT = """
import json, sys
import torch, torch.nn as nn, torch.distributed as dist
import gradshare
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
ddp.register_comm_hook(gradshare.ThresholdState(optimizer=opt, link=None), gradshare.threshold_hook)
for step in range(json.loads(sys.argv[1])["steps"]):
    x = torch.randn(16, 16)
    loss = nn.functional.cross_entropy(ddp(x), x[:, :4].argmax(1))
    opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
print("RESULT " + json.dumps({{"steps": json.loads(sys.argv[1])["steps"]}}), flush=True)
"""


def _start_job(config, tag):
    """Two plain processes (RANK/WORLD_SIZE set, no launcher) running cluster.run on cluster_job.train."""
    port = str(_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT.format(here=HERE), json.dumps(config)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return tag, procs


def _finish(job, timeout=120):
    tag, procs = job
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs = []                             # every rank's output: the one that failed first explains it
            for r, q in enumerate(procs):
                text = results[r][2] if r < len(results) else q.communicate()[0]
                outs.append(f"rank {r} (exit {q.returncode}):\n{text[-1500:]}")
            pytest.fail(f"job {tag}: a rank did not finish within {timeout} s\n" + "\n----\n".join(outs))
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append((p.returncode, json.loads(line[-1][7:]) if line else None, out))
    return results


@pytest.mark.parametrize("config", [{"hook": False}, {"hook": True}, {"job": "exchange_once"}],
                         ids=["ddp", "ddp+gradshare_hook", "exchange_async"])
def test_cluster_run_leaves_no_gloo_thread_behind(config):
    config = dict({"data": "synthetic", "steps": 5, "batch": 16}, **config)
    expected_steps = 1 if config.get("job") == "exchange_once" else 5
    for code, result, out in _finish(_start_job(config, "single")):
        assert code == 0, out[-3000:]
        assert result is not None and result["steps"] == expected_steps, out[-3000:]
        assert result["threads"] == [], f"gloo threads outlived cluster.run: {result['threads']}"


@pytest.mark.slow
def test_many_short_jobs_all_exit_zero():
    # 12 jobs of 2 ranks, 4 at a time on a small machine: the teardown races the scheduler.
    config = {"data": "synthetic", "steps": 3, "batch": 16, "hook": True}
    failures = []
    for wave in range(3):
        jobs = [_start_job(config, f"{wave}.{i}") for i in range(4)]
        for job in jobs:
            for code, result, out in _finish(job):
                if code != 0 or result is None:
                    failures.append(f"job {job[0]}: exit {code}\n{out[-1500:]}")
    assert not failures, f"{len(failures)} of 24 ranks failed:\n" + "\n----\n".join(failures[:3])


@pytest.mark.slow
def test_a_users_own_script_with_the_hook_exits_zero(tmp_path):
    """12 torchrun jobs of 2 ranks running a user's DDP script with the hook (torch's own init and destroy), 3
    at a time: about one in five aborted at exit before gradshare let gloo's threads finish at exit."""
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT.format())
    failures = []
    for wave in range(4):
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                   "--master_addr", "127.0.0.1", "--master_port", str(_port()), str(script),
                                   json.dumps({"steps": 10})],
                                  env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)]
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"job {wave}.{i} did not finish within 120 s")
            if p.returncode != 0 or out.count("RESULT ") != 2:
                failures.append(f"job {wave}.{i}: exit {p.returncode}\n{out[-1500:]}")
    assert not failures, f"{len(failures)} of 12 jobs failed:\n" + "\n----\n".join(failures[:3])
