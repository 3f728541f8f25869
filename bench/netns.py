"""Workers as separate hosts on one machine: network namespaces, veth links, tc shaping, torchrun per namespace.

Use it for any benchmark whose result depends on the link (bytes on the wire, time at 100 Mbit/s). Needs root
and iproute2. Each worker gets a namespace with one interface ``gs0`` at 10.231.0.<rank+1>/24. Two workers are
joined by one veth pair; more go through a bridge in an extra namespace. Shaping applies to every direction:
``tbf`` below 1 Gbit/s, ``htb`` at 1 Gbit/s and above (the tbf rate is inaccurate there); for ``rate=None`` a plain ``pfifo``
(no shaping) so that tc byte counters exist on every link (``count_unshaped=False``: veth's default noqueue). Every run is bounded in time and killed as a process group; namespaces are always removed
(context manager + atexit + SIGTERM/SIGHUP handlers), and stale ones left by a dead run of this harness
(same prefix, owner pid gone) are removed on start.

    with NetnsCluster(2, rate="100mbit") as net:
        results = net.torchrun("bench/e2e_worker.py", ["--contender", "ddp"], timeout=600)
        print(net.counters())

Self-test (25M-float all_reduce between 2 namespaces; environment.md measured 9.2 s shaped, 0.09 s unshaped):
    timeout 300 python bench/netns.py --selftest --rates 100mbit,none

``--op all_gather`` times an all-gather of ``--floats`` float32 a worker instead; ``--pause-ms P`` starts each
timed call after P ms asleep instead of right after a barrier, as a training step's exchange starts after its
compute (on these shaped links a message sent after a pause takes longer than one sent after a small exchange:
README, "End to end").
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from gradshare.workers import stop_process_group

PREFIX = "gsb"
IFNAME = "gs0"
SUBNET = "10.231.0"
MASTER_PORT = 29531
_LIVE: List["NetnsCluster"] = []


def _ip(*args: str, check: bool = True, timeout: float = 20) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _tc(ns: str, *args: str, check: bool = True) -> str:
    r = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = PREFIX) -> List[str]:
    """Deletes namespaces named ``<prefix>-<pid>-*`` whose owning process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)-[\w-]+", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def rate_bps(rate: Optional[str]) -> Optional[float]:
    if rate is None or str(rate).lower() in ("none", "unshaped", "0", ""):
        return None
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", str(rate).lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use tc units such as 100mbit or 1gbit, or none")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


@dataclass
class RunResult:
    rank: int
    returncode: Optional[int]   # None: killed at the timeout
    elapsed: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class NetnsCluster:
    """N worker namespaces joined by veth (2) or a bridge (more), optionally shaped with tc."""

    def __init__(self, workers: int = 2, rate: Optional[str] = None, prefix: str = PREFIX,
                 topology: str = "auto", cpus: Optional[Sequence[int]] = None, count_unshaped: bool = True):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.rate = None if rate_bps(rate) is None else str(rate).lower()
        self.prefix = prefix
        self.count_unshaped = count_unshaped
        self.topology = ("veth" if workers <= 2 else "bridge") if topology == "auto" else topology
        if self.topology == "veth" and workers > 2:
            raise ValueError("veth topology joins at most 2 workers; use bridge")
        ncpu = os.cpu_count() or 1
        self.cpus = list(cpus) if cpus is not None else [i % ncpu for i in range(workers)]
        tag = f"{prefix}-{os.getpid()}-{id(self) % 10000}"
        self.namespaces = [f"{tag}-w{i}" for i in range(workers)]
        self.bridge_ns = f"{tag}-br" if self.topology == "bridge" else None
        self._procs: List[subprocess.Popen] = []
        self._up = False

    # ----------------------------------------------------------------------------------- set-up
    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    def up(self) -> "NetnsCluster":
        cleanup_stale(self.prefix)
        _LIVE.append(self)
        self._up = True
        try:
            for ns in self.namespaces + ([self.bridge_ns] if self.bridge_ns else []):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            if self.topology == "veth":
                if self.workers == 2:
                    _ip("link", "add", IFNAME, "netns", self.namespaces[0], "type", "veth",
                        "peer", "name", IFNAME, "netns", self.namespaces[1])
                else:  # one worker: a dangling veth peer in its own namespace keeps the interface usable
                    _ip("link", "add", IFNAME, "netns", self.namespaces[0], "type", "veth", "peer", "name", "gs1",
                        "netns", self.namespaces[0])
            else:
                br = self.bridge_ns
                _ip("-n", br, "link", "add", "br0", "type", "bridge")
                _ip("-n", br, "link", "set", "br0", "up")
                for i, ns in enumerate(self.namespaces):
                    _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", br)
                    _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
                    _ip("-n", br, "link", "set", f"p{i}", "up")
            for i, ns in enumerate(self.namespaces):
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
            if self.rate or self.count_unshaped:
                for ns, dev in self._shaped_devices():
                    self._shape(ns, dev)
        except BaseException:
            self.down()
            raise
        return self

    def _shaped_devices(self):
        out = [(ns, IFNAME) for ns in self.namespaces]
        if self.bridge_ns:
            out += [(self.bridge_ns, f"p{i}") for i in range(self.workers)]
        return out

    def _shape(self, ns: str, dev: str) -> None:
        bps = rate_bps(self.rate)
        if bps is None:
            _tc(ns, "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "10000")
        elif bps < 1e9:
            _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "32kbit",
                "latency", "50ms")
        else:
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", self.rate,
                "ceil", self.rate)

    def down(self) -> None:
        """Kills this cluster's processes and deletes its namespaces (idempotent)."""
        for p in self._procs:
            stop_process_group(p)
        self._procs.clear()
        for ns in self.namespaces + ([self.bridge_ns] if self.bridge_ns else []):
            _ip("netns", "del", ns, check=False)
        self._up = False
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> "NetnsCluster":
        _install_signal_handlers()
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ----------------------------------------------------------------------------------- counters
    def counters(self) -> List[Dict[str, int]]:
        """Per worker: bytes sent on its interface (kernel link counter) and through its tc qdisc (if shaped)."""
        out = []
        for ns in self.namespaces:
            link = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", IFNAME))[0]
            row = {"tx_bytes": int(link["stats64"]["tx"]["bytes"]), "tx_packets": int(link["stats64"]["tx"]["packets"]),
                   "rx_bytes": int(link["stats64"]["rx"]["bytes"])}
            if self.rate or self.count_unshaped:
                q = json.loads(_tc(ns, "-s", "-j", "qdisc", "show", "dev", IFNAME))
                root = [x for x in q if x.get("root")] or q
                row["tc_bytes"] = int(root[0]["bytes"])
                row["tc_drops"] = int(root[0].get("drops", 0))
            out.append(row)
        return out

    # ----------------------------------------------------------------------------------- running
    def exec_argv(self, rank: int, argv: Sequence[str]) -> List[str]:
        """The command line running ``argv`` inside worker ``rank``'s namespace, pinned to its core."""
        return ["ip", "netns", "exec", self.namespaces[rank], "taskset", "-c", str(self.cpus[rank]), *argv]

    def worker_env(self, rank: int, extra: Optional[dict] = None) -> dict:
        env = dict(os.environ)
        env.update(GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   GRADSHARE_NETNS_IFNAME=IFNAME, PYTHONUNBUFFERED="1")
        env.update(extra or {})
        return env

    def run(self, argvs: Sequence[Sequence[str]], timeout: float, env: Optional[dict] = None) -> List[RunResult]:
        """Starts ``argvs[rank]`` in each namespace at once; waits at most ``timeout`` s for all, kills the rest."""
        if not self._up:
            raise RuntimeError("cluster is not up")
        procs, files, t0 = [], [], time.monotonic()
        # Output goes to files, not pipes: a chatty rank must never block on a full pipe while we wait on another.
        for rank, argv in enumerate(argvs):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            p = subprocess.Popen(self.exec_argv(rank, argv), env=self.worker_env(rank, env), stdout=out, stderr=err,
                                 text=True, start_new_session=True)
            procs.append(p)
            self._procs.append(p)
        codes: List[Optional[int]] = [None] * len(procs)
        deadline = t0 + timeout
        elapsed = [0.0] * len(procs)
        try:
            for rank, p in enumerate(procs):
                try:
                    codes[rank] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
                    elapsed[rank] = time.monotonic() - t0
                except subprocess.TimeoutExpired:
                    break
        finally:
            results = []
            for rank, p in enumerate(procs):
                note = ""
                if codes[rank] is None:
                    stop_process_group(p)
                    elapsed[rank] = time.monotonic() - t0
                    note = f"\n[netns] killed after the {timeout:g} s timeout\n"
                out, err = files[rank]
                out.seek(0)
                err.seek(0)
                results.append(RunResult(rank, codes[rank], elapsed[rank], out.read(), err.read() + note))
                out.close()
                err.close()
                if p in self._procs:
                    self._procs.remove(p)
        return results

    def torchrun(self, script: str, args: Sequence[str] = (), timeout: float = 600.0, env: Optional[dict] = None,
                 nproc_per_node: int = 1, port: int = MASTER_PORT) -> List[RunResult]:
        """One torchrun node per namespace (static rendezvous at worker 0), ``script args`` on each."""
        argvs = []
        for rank in range(self.workers):
            argvs.append([sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.workers}",
                          f"--node_rank={rank}", f"--nproc_per_node={nproc_per_node}",
                          f"--master_addr={self.master_addr}", f"--master_port={port}", script, *args])
        return self.run(argvs, timeout, env)


def _teardown_all() -> None:
    for c in list(_LIVE):
        c.down()


_handlers_installed = False


def _install_signal_handlers() -> None:
    """SIGTERM/SIGHUP become SystemExit so with-blocks and atexit tear the namespaces down."""
    global _handlers_installed
    if _handlers_installed:
        return
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, handler)
    _handlers_installed = True


atexit.register(_teardown_all)


# ----------------------------------------------------------------------------------------------- self-test
def _allreduce_worker(floats: int, repeats: int, op: str = "all_reduce", pause_ms: float = 0.0) -> None:
    """Runs under torchrun inside a namespace: times ``repeats`` calls of ``op`` (all_reduce, or all_gather of
    ``floats`` float32 from each worker), each after a barrier, or after ``pause_ms`` asleep when that is > 0."""
    import torch
    import torch.distributed as dist

    from gradshare.cluster import _init_process_group   # the torchrun environment, as the cluster trainer joins it
    from gradshare import process_group

    torch.set_num_threads(1)
    _init_process_group("gloo", collective_timeout=300.0)
    x = torch.ones(floats)
    gathered = torch.empty(floats * dist.get_world_size()) if op == "all_gather" else None
    dist.all_reduce(torch.ones(1))                     # connect before timing
    times = []
    for _ in range(repeats):
        if pause_ms > 0:
            time.sleep(pause_ms / 1e3)
        else:
            dist.barrier()
        t0 = time.perf_counter()
        if gathered is None:
            dist.all_reduce(x)
        else:
            dist.all_gather_into_tensor(gathered, x)
        times.append(time.perf_counter() - t0)
    ok = bool(x[0].item() == dist.get_world_size() ** repeats) if gathered is None else bool((gathered == 1).all())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"floats": floats, "op": op, "pause_ms": pause_ms, "seconds": times,
                                      "correct": ok}), flush=True)
    process_group.destroy_process_group()


def selftest(rates: Sequence[str], workers: int, floats: int, repeats: int, timeout: float,
             op: str = "all_reduce", pause_ms: float = 0.0) -> List[dict]:
    rows = []
    for rate in rates:
        with NetnsCluster(workers, rate=rate) as net:
            before = net.counters()
            res = net.torchrun(os.path.abspath(__file__), ["--allreduce-worker", "--floats", str(floats),
                                                           "--repeats", str(repeats), "--op", op,
                                                           "--pause-ms", str(pause_ms)], timeout=timeout)
            after = net.counters()
            names = list(net.namespaces)
        line = next((l for l in res[0].stdout.splitlines() if l.startswith("RESULT ")), None)
        if not all(r.ok for r in res) or line is None:
            raise RuntimeError(f"self-test at {rate} failed:\n" + "\n".join(r.stderr[-3000:] for r in res))
        data = json.loads(line[len("RESULT "):])
        sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]
        row = {"rate": rate, "workers": workers, "floats": floats, "op": op, "pause_ms": pause_ms,
               "seconds": data["seconds"], "correct": data["correct"], "tx_bytes": sent,
               "payload_bytes_per_worker_per_call": (2 * (workers - 1) / workers * 4 * floats if op == "all_reduce"
                                                     else (workers - 1) * 4 * floats)}
        if "tc_bytes" in after[0]:
            row["tc_bytes"] = [a["tc_bytes"] - b["tc_bytes"] for a, b in zip(after, before)]
        leftover = [n for n in _ip("netns", "list", check=False).split() if n in names]
        row["namespaces_left"] = leftover
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="time a collective under each --rates setting")
    ap.add_argument("--op", choices=("all_reduce", "all_gather"), default="all_reduce", help="the self-test's collective")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="self-test: each timed call after this long asleep instead of right after a barrier")
    ap.add_argument("--rates", default="100mbit,none", help="comma list: 100mbit, 1gbit, none")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--floats", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")
    ap.add_argument("--cleanup", action="store_true", help="only remove stale namespaces of this harness")
    ap.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.allreduce_worker:
        _allreduce_worker(a.floats, a.repeats, a.op, a.pause_ms)
        return 0
    if a.cleanup:
        print("removed:", cleanup_stale())
        return 0
    if a.selftest:
        selftest([r.strip() for r in a.rates.split(",") if r.strip()], a.workers, a.floats, a.repeats, a.timeout,
                 a.op, a.pause_ms)
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
