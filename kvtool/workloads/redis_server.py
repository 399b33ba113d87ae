"""Real `redis-server` processes on loopback: one server, a three-master Redis Cluster, or a
master and a replica watched by a Redis Sentinel.

Used by the `redis` and `redis-cluster` arms of `kvtool replay` / `kvtool bench` (and by the
tests). `redis-server` and `redis-cli` are found on PATH (Debian's `redis-server` package; the
install script adds it for the tests). Servers run in the foreground with no persistence
(`--save '' --appendonly no`) in a temporary directory, bound to 127.0.0.1 on free ports, and are
stopped by PID.

Every server starts with jemalloc keeping the pages it frees (`KV_MALLOC_CONF`), as a server that
holds KV chunks should run: redis-server (7.0 and Valkey 8.0 alike) copies each GET reply into a
fresh buffer of the value's size, and with jemalloc's default decay the pages of the last reply go
back to the OS and fault in again for the next one, one minor fault per 4 KiB page, 9,216 per
37.7 MB chunk. That bounds a server to about a third of what its socket can send; with the pages
kept there are none. Debian's package links the system jemalloc, which reads MALLOC_CONF; a build
from source links its bundled copy, which reads JE_MALLOC_CONF; both are set. The cost is that the
server's resident memory stays at its peak. A MALLOC_CONF or JE_MALLOC_CONF already in the
environment is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvtool.engine.errors import ConfigError, PeerError
from kvtool.workloads import local_process
from kvtool.workloads.local_process import HOST, stop_by_pid

START_TIMEOUT_S = 30.0
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000
# jemalloc keeps the pages it frees for reuse instead of returning them (see the module docstring).
KV_MALLOC_CONF = "dirty_decay_ms:-1"


def server_env(malloc_conf: str | None = KV_MALLOC_CONF) -> dict[str, str]:
    """The environment a redis-server starts in: this process's, with `malloc_conf` as jemalloc's
    options under both names (MALLOC_CONF, JE_MALLOC_CONF) unless already set; None or '': as is."""
    env = dict(os.environ)
    if malloc_conf:
        for name in ("MALLOC_CONF", "JE_MALLOC_CONF"):
            env.setdefault(name, malloc_conf)
    return env


def redis_binary(name: str = "redis-server") -> str:
    """The path of `name` on PATH. Raises ConfigError naming the package when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"{name} is not on PATH; install Redis (Debian: apt-get install redis-server)")
    return path


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one whose bus port (port + 10000) is free too."""
    for _ in range(100):
        port = local_process.free_port()
        if not cluster:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + CLUSTER_BUS_OFFSET))
                    return port
                except OSError:
                    continue
    raise PeerError("no free loopback port for a Redis cluster node")


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll `ready` until it is true; PeerError saying `what` did not happen within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise PeerError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def ping(port: int, timeout_s: float = 1.0) -> bool:
    """Whether a Redis server answers on `port` (a NOAUTH error counts: it is up, with a password)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


class RedisServer:
    """One `redis-server` in the foreground, on 127.0.0.1:`port`, with `extra` arguments and
    jemalloc's options `malloc_conf` (`server_env`)."""

    def __init__(self, port: int, workdir: Path, extra: Sequence[str] = (),
                 malloc_conf: str | None = KV_MALLOC_CONF) -> None:
        self.port = port
        self.workdir = workdir
        self.extra = list(extra)
        self.malloc_conf = malloc_conf
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"redis-{port}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not running"
        return self.proc.pid

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING. Raises PeerError when it does not."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [redis_binary(), "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no", *self.extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=server_env(self.malloc_conf))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ping(self.port):
            if self.proc.poll() is not None:
                raise PeerError(f"redis-server exited with status {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise PeerError(f"redis-server did not answer PING within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it by PID and wait. Idempotent."""
        if self.proc is not None:
            stop_by_pid(self.proc, sig)
            self.proc = None

    def restart_empty(self) -> None:
        """Kill it hard (as a crash would) and start it again on its port: it holds nothing."""
        self.stop(signal.SIGKILL)
        self.start()

    def log_tail(self, num_bytes: int = 2000) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace").strip()


class RedisClusterProcesses:
    """`num_masters` cluster-enabled servers joined by `redis-cli --cluster create`, no replicas;
    each node gets the `extra` arguments too."""

    def __init__(self, workdir: Path, num_masters: int = 3, node_timeout_ms: int = 2000,
                 extra: Sequence[str] = (), malloc_conf: str | None = KV_MALLOC_CONF) -> None:
        self.workdir = workdir
        self.nodes: list[RedisServer] = []
        for _ in range(num_masters):
            port = free_port(cluster=True)
            args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no", *extra]
            self.nodes.append(RedisServer(port, workdir / f"node-{port}", args, malloc_conf))

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterProcesses:
        """Start the nodes, create the cluster, and wait until every node reports it ok."""
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"{HOST}:{n.port}" for n in self.nodes]
            out = subprocess.run([redis_binary("redis-cli"), "--cluster", "create", *addresses, "--cluster-replicas",
                                  "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise PeerError(f"redis-cli --cluster create failed: {(out.stdout + out.stderr).strip()[-2000:]}")
            wait_until(lambda: all(self._cluster_ok(n.port) for n in self.nodes), "the Redis cluster was not ok")
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _cluster_ok(port: int) -> bool:
        out = subprocess.run([redis_binary("redis-cli"), "-h", HOST, "-p", str(port), "cluster", "info"],
                             capture_output=True, text=True, timeout=10)
        return "cluster_state:ok" in out.stdout

    def stop(self) -> None:
        """Stop every node by PID. Idempotent."""
        for node in self.nodes:
            node.stop()


class RedisSentinelSet:
    """A master, a replica of it, and one `redis-server --sentinel` watching them under
    `service_name` (quorum 1, a master down after `down_after_ms`): killing the master makes the
    sentinel promote the replica."""

    def __init__(self, workdir: Path, service_name: str = "redismaster", down_after_ms: int = 500) -> None:
        self.workdir = workdir
        self.service_name = service_name
        self.down_after_ms = down_after_ms
        self.master = RedisServer(free_port(), workdir / "master")
        self.replica = RedisServer(free_port(), workdir / "replica", ["--replicaof", HOST, str(self.master.port)])
        self.sentinel_port = free_port()
        self.sentinel = RedisServer(self.sentinel_port, workdir / "sentinel")

    @property
    def url(self) -> str:
        return f"redis-sentinel://{HOST}:{self.sentinel_port}"

    def start(self) -> RedisSentinelSet:
        try:
            self.master.start()
            self.replica.start()
            conf = self.workdir / "sentinel" / "sentinel.conf"  # the sentinel rewrites it as it learns
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(f"sentinel monitor {self.service_name} {HOST} {self.master.port} 1\n"
                            f"sentinel down-after-milliseconds {self.service_name} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {self.service_name} 5000\n")
            self._start_sentinel(conf)
            wait_until(lambda: self.master_port() == self.master.port and self._replica_linked(),
                       "the sentinel did not see master and replica")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinel(self, conf: Path) -> None:
        # A sentinel takes its config file first and refuses --save/--appendonly: its own command line.
        s = self.sentinel
        with open(s.log_path, "ab") as log:
            s.proc = subprocess.Popen([redis_binary(), str(conf), "--sentinel", "--port", str(s.port), "--bind", HOST],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ping(s.port):
            if s.proc.poll() is not None or time.monotonic() > deadline:
                s.stop()
                raise PeerError(f"redis-server --sentinel did not start: {s.log_tail()}")
            time.sleep(0.02)

    def _cli(self, port: int, *args: str) -> str:
        out = subprocess.run([redis_binary("redis-cli"), "-h", HOST, "-p", str(port), *args], capture_output=True,
                             text=True, timeout=10)
        return out.stdout

    def _replica_linked(self) -> bool:
        return "master_link_status:up" in self._cli(self.replica.port, "info", "replication")

    def master_port(self) -> int | None:
        """The port of the master the sentinel names now (None before it names one)."""
        lines = self._cli(self.sentinel_port, "sentinel", "get-master-addr-by-name", self.service_name).split()
        return int(lines[1]) if len(lines) == 2 else None

    def kill_master(self) -> None:
        """Kill the master (as a crash would): the sentinel promotes the replica."""
        self.master.stop(signal.SIGKILL)

    def master_flags(self) -> str:
        """The sentinel's flags for the master ("master" when it is up and no failover runs)."""
        out = self._cli(self.sentinel_port, "sentinel", "master", self.service_name).split()
        return dict(zip(out[::2], out[1::2])).get("flags", "")

    def wait_for_failover(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until the sentinel names the promoted replica as a healthy master (clients such as
        redis-py's refuse a master still flagged down while the failover finishes)."""
        wait_until(lambda: self.master_port() == self.replica.port and self.master_flags() == "master",
                   "the sentinel did not promote the replica", timeout_s)

    def stop(self) -> None:
        """Stop every process by PID. Idempotent."""
        for server in (self.sentinel, self.replica, self.master):
            server.stop()


@contextlib.contextmanager
def redis_server(extra: Sequence[str] = (), malloc_conf: str | None = KV_MALLOC_CONF) -> Iterator[RedisServer]:
    """A running redis-server on a free loopback port, stopped (and its directory removed) after."""
    with tempfile.TemporaryDirectory(prefix="kvtool-redis-") as tmp:
        server = RedisServer(free_port(), Path(tmp), extra, malloc_conf).start()
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def redis_cluster(num_masters: int = 3, extra: Sequence[str] = (),
                  malloc_conf: str | None = KV_MALLOC_CONF) -> Iterator[RedisClusterProcesses]:
    """A running `num_masters`-master Redis Cluster on loopback (`extra` arguments on every node), stopped after."""
    with tempfile.TemporaryDirectory(prefix="kvtool-redis-cluster-") as tmp:
        cluster = RedisClusterProcesses(Path(tmp), num_masters, extra=extra, malloc_conf=malloc_conf).start()
        try:
            yield cluster
        finally:
            cluster.stop()


@contextlib.contextmanager
def redis_sentinel(service_name: str = "redismaster") -> Iterator[RedisSentinelSet]:
    """A running master, replica and sentinel on loopback, stopped after."""
    with tempfile.TemporaryDirectory(prefix="kvtool-redis-sentinel-") as tmp:
        group = RedisSentinelSet(Path(tmp), service_name).start()
        try:
            yield group
        finally:
            group.stop()
