"""Multi-host rehearsal: two network namespaces joined by a veth pair act as two hosts, one torchrun node each.

Needs root and iproute2 (skipped otherwise). The namespaces are always deleted, and every command is
bounded in time. Node 0 (namespace A, 10.78.5.1) hosts the rendezvous; gloo talks over the veth pair only.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

import cluster_job

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "cluster_job.py")
CONFIG = {"data": "synthetic", "steps": 40, "batch": 16, "lr": 0.05, "seed": 5}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("torchrun") is None,
                       reason="needs root, iproute2 and torchrun"),
]


def _ip(*args):
    subprocess.run(["ip", *args], check=True, timeout=20, capture_output=True)


@contextlib.contextmanager
def two_hosts():
    tag = str(os.getpid() % 100000)
    a, b, va, vb = f"gs5a{tag}", f"gs5b{tag}", f"gs5va{tag}", f"gs5vb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        _ip("-n", a, "addr", "add", "10.78.5.1/24", "dev", va)
        _ip("-n", b, "addr", "add", "10.78.5.2/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield (a, va), (b, vb)
    finally:
        for ns in (a, b):  # deleting a namespace kills its end of the veth pair, and with it the other end
            subprocess.run(["ip", "netns", "pids", ns], timeout=20, capture_output=True)
            subprocess.run(["ip", "netns", "delete", ns], timeout=20, capture_output=True)
        subprocess.run(["ip", "link", "delete", va], timeout=20, capture_output=True)


def _node(ns, dev, node_rank, config, tmp_path, max_restarts):
    env = dict(os.environ, GLOO_SOCKET_IFNAME=dev)
    # --local_addr: both "hosts" share one host name, which resolves outside the namespaces.
    cmd = ["ip", "netns", "exec", ns, "torchrun", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
           f"--local_addr=10.78.5.{node_rank + 1}",
           "--rdzv_backend=c10d", "--rdzv_endpoint=10.78.5.1:29555", "--rdzv_id=gradshare-netns",
           # torchrun guesses the store's host by the machine's host name, which names neither namespace.
           f"--rdzv_conf=is_host={str(node_rank == 0).lower()}",
           f"--max-restarts={max_restarts}", "-m", "gradshare.cluster", f"{JOB}:train",
           "--config", json.dumps(config), "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10",
           "--result", str(tmp_path / "result.json"), "--collective-timeout", "60"]
    return subprocess.Popen(cmd, env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_all(procs, timeout):
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        tails = [p.communicate()[0][-3000:] for p in procs[len(outputs):]]
        pytest.fail("a torchrun node did not finish in time (a hang):\n" + "\n----\n".join(outputs + tails))
    return [p.returncode for p in procs], outputs


def _run_across_hosts(tmp_path, config, max_restarts=0):
    with two_hosts() as ((a, va), (b, vb)):
        procs = [_node(a, va, 0, config, tmp_path, max_restarts),
                 _node(b, vb, 1, config, tmp_path, max_restarts)]
        codes, outputs = _wait_all(procs, timeout=120)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return json.loads((tmp_path / "result.json").read_text()), outputs


@pytest.fixture(scope="module")
def reference():
    return cluster_job.reference(CONFIG)


def test_two_hosts_train_together(tmp_path, reference):
    out, outputs = _run_across_hosts(tmp_path, CONFIG)
    assert out["world_size"] == 2 and out["stats"]["steps"] == 40
    assert out["params"] == reference["params"]


def test_two_hosts_recover_from_a_killed_worker(tmp_path, reference):
    # The restart count is per node (a node restarted for the other's failure keeps 0): kill once by marker.
    config = dict(CONFIG, kill_at_step=25, kill_rank=1, kill_once_file=str(tmp_path / "killed"))
    out, outputs = _run_across_hosts(tmp_path, config, max_restarts=1)
    assert (tmp_path / "killed").exists()
    assert out["resumed_from"] == 20
    assert out["stats"]["steps_seen"] == list(range(40))
    assert out["params"] == reference["params"]
