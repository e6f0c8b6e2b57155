"""The production topologies tests and benches run keel in: PgBouncer in transaction pooling
mode in front of a PostgreSQL, and a Redis Cluster of three primaries and three replicas on
loopback ports. Both are Debian's binaries (``pgbouncer``, ``redis-server`` and
``redis-cli``), started by the test itself and stopped after.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from keel.errors import BackendUnavailableError
from keel.testing.servers import PostgresTestServer, free_port

__all__ = ["PgBouncer", "RedisClusterNode", "RedisTestCluster", "pgbouncer", "redis_cluster"]

PREPARED_POOL = "keel_one_connection"
"""A database PgBouncer serves from a pool of one server connection (to ``postgres``): two
clients there share one server session between transactions, as a managed pooler's do."""


def _wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise BackendUnavailableError(f"{what} did not start on {port}:\n{tail}") from None
            time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class PgBouncer:
    """A running PgBouncer (transaction pooling) on a loopback port."""

    port: int

    def url(self, database: str) -> str:
        """The URL of ``database`` through this PgBouncer: a database name, or a direct
        ``postgresql://`` URL of the server behind it (its database name is kept)."""
        name = urlsplit(database).path.lstrip("/") if "://" in database else database
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def pgbouncer(server: PostgresTestServer, *, pool_size: int = 20) -> Iterator[PgBouncer]:
    """Start PgBouncer in transaction pooling mode in front of ``server`` on a free loopback
    port; yield it ([`PgBouncer.url`][keel.testing.topologies.PgBouncer.url] turns a direct
    database URL into the same database through it). Every database of the server is
    reachable through it (a ``*`` entry), each with ``pool_size`` server connections, and
    `PREPARED_POOL` with one.

    PgBouncer refuses to run as root: started by root it runs as the system user the
    embedded PostgreSQL runs as.

    Raises:
        BackendUnavailableError: ``pgbouncer`` is not installed (``apt-get install
            pgbouncer``) or did not start.
    """
    binary = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer",) if Path(p).exists()), None
    )
    if binary is None:
        raise BackendUnavailableError("pgbouncer is not installed (apt-get install pgbouncer)")
    uri = urlsplit(server.uri())
    socket_dir = parse_qs(uri.query).get("host", ["/tmp"])[0]
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="keel-pgbouncer-"))
    log = folder / "pgbouncer.log"
    target = f"host={socket_dir} port={uri.port or 5432} user=postgres"
    (folder / "users.txt").write_text('"postgres" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{PREPARED_POOL} = {target} dbname=postgres pool_size=1\n"
        f"* = {target}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\nmax_client_conn = 1000\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {log}\npidfile = {folder / 'pgbouncer.pid'}\n"
        + ("user = embedded_postgres\n" if os.geteuid() == 0 else "")
    )
    if os.geteuid() == 0:
        shutil.chown(folder, user="embedded_postgres")
        for path in folder.iterdir():
            shutil.chown(path, user="embedded_postgres")
    process = subprocess.Popen(
        [binary, str(folder / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process, "pgbouncer", log)
        yield PgBouncer(port)
    finally:
        _stop(process)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class RedisClusterNode:
    """One redis-server of a [`RedisTestCluster`][keel.testing.topologies.RedisTestCluster]."""

    port: int
    process: subprocess.Popen[bytes] | None
    command: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class RedisTestCluster:
    """A running Redis Cluster: its nodes, its ``redis+cluster://`` URL, and the faults a test
    injects (kill a node, start it again)."""

    nodes: list[RedisClusterNode]
    folder: Path
    durable: bool
    cli: str
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a start-up node."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def node(self, port: int) -> RedisClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def redis_cli(self, *args: str, timeout: float = 120) -> str:
        """Run ``redis-cli`` (its output; raises on a non-zero exit)."""
        done = subprocess.run(
            [self.cli, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise BackendUnavailableError(f"redis-cli {' '.join(args)}: {done.stderr}")
        return done.stdout

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (a crash: no shutdown, no save)."""
        node = self.node(port)
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()
        node.process = None

    def start(self, port: int) -> None:
        """Start the node on ``port`` again from its own folder (its nodes.conf, and its AOF
        when durable)."""
        node = self.node(port)
        if node.process is None or node.process.poll() is not None:
            node.process = subprocess.Popen(
                node.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            _wait_for_port(port, node.process, "redis-server", self.folder / f"{port}.log")

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                _stop(node.process)
                node.process = None


def _cluster_ports(count: int) -> list[int]:
    """``count`` loopback ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    rng = random.Random()
    while len(ports) < count:
        port = rng.randrange(20000, 30000)
        if port in ports:
            continue
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        ports.append(port)
    return ports


@contextlib.contextmanager
def redis_cluster(
    *, primaries: int = 3, replicas: int = 1, durable: bool = False, node_timeout_ms: int = 1000
) -> Iterator[RedisTestCluster]:
    """Start a Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each on
    loopback ports; yield it once every slot is served and every replica is in sync; stop it
    and delete its files after.

    ``durable``: an append-only file fsynced on every write (``appendfsync always``), what
    keel requires of a Redis that holds its state; else no persistence at all (the test
    default, as [`redis_server`][keel.testing.servers.redis_server]).

    Raises:
        BackendUnavailableError: redis-server or redis-cli is not installed, or the cluster
            did not form.
    """
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise BackendUnavailableError(
            "redis-server and redis-cli are not installed (apt-get install redis-server)"
        )
    folder = Path(tempfile.mkdtemp(prefix="keel-redis-cluster-"))
    persistence = (
        ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        if durable
        else ["--appendonly", "no", "--save", ""]
    )
    nodes: list[RedisClusterNode] = []
    for port in _cluster_ports(primaries * (1 + replicas)):
        directory = folder / str(port)
        directory.mkdir()
        command = [
            server,
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--logfile", str(folder / f"{port}.log"),
            *persistence,
        ]  # fmt: skip
        nodes.append(RedisClusterNode(port, None, command))
    cluster = RedisTestCluster(nodes, folder, durable, cli)
    try:
        for node in nodes:
            cluster.start(node.port)
        cluster.redis_cli(
            "--cluster", "create", *(node.address for node in nodes),
            "--cluster-replicas", str(replicas), "--cluster-yes",
        )  # fmt: skip
        wait_until_healthy(cluster, replicas=replicas)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_until_healthy(cluster: RedisTestCluster, *, replicas: int, timeout_s: float = 60) -> None:
    """Wait until every live node says ``cluster_state:ok`` and each primary has ``replicas``
    replicas in sync (``redis-cli --cluster check`` passes)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        live = [n for n in cluster.nodes if n.process is not None]
        try:
            states = [
                cluster.redis_cli("-p", str(n.port), "cluster", "info", timeout=5) for n in live
            ]
            check = subprocess.run(
                [cluster.cli, "--cluster", "check", live[0].address],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            last = check.stdout
            synced = all(
                _replicas_in_sync(cluster, n.port) >= replicas
                for n in live
                if "role:master" in cluster.redis_cli("-p", str(n.port), "info", "replication")
            )
            if (
                all("cluster_state:ok" in s for s in states)
                and check.returncode == 0
                and "[OK] All 16384 slots covered" in check.stdout
                and synced
            ):
                return
        except (BackendUnavailableError, subprocess.TimeoutExpired) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise BackendUnavailableError(f"the Redis Cluster did not become healthy:\n{last[-2000:]}")


def _replicas_in_sync(cluster: RedisTestCluster, port: int) -> int:
    info = cluster.redis_cli("-p", str(port), "info", "replication")
    return sum(1 for line in info.splitlines() if line.startswith("slave") and "online" in line)
