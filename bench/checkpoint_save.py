"""Checkpoint save time and step-blocked time: sync vs async, local disk vs an S3 server.

    python bench/checkpoint_save.py               # ~100 MB of f32 state, 3 saves per case
    python bench/checkpoint_save.py --mb 20 --repeats 2

"blocked" is how long `save()` holds the training loop (async: until the arrays are copied
off the device); "total" is until the step is committed. The S3 side is a moto server on
127.0.0.1 (needs axplug-checkpoint-cloud with its test extras); its numbers include moto's
own Python overhead, so they bound what a loopback server costs, not what S3 costs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import jax
import jax.numpy as jnp

from axplug.checkpoint import Checkpointer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)  # noqa: S310
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def _state(mb: int, seed: int) -> dict:
    n = mb * 2**20 // 4 // 8
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    return {f"w{i}": jax.random.normal(k, (n,), jnp.float32) for i, k in enumerate(keys)}


def measure(directory: str, options: dict | None, *, async_save: bool, mb: int, repeats: int):
    """Median (blocked, total) seconds of `repeats` saves after one warm-up save."""
    cfg = Checkpointer.default_config().set(
        directory=directory, storage_options=options, async_save=async_save, keep_last=2
    )
    blocked, total = [], []
    with cfg.instantiate() as ckpt:
        for i in range(repeats + 1):
            state = jax.block_until_ready(_state(mb, i))
            start = time.perf_counter()
            ckpt.save(i, state)
            returned = time.perf_counter()
            ckpt.wait_until_finished()
            done = time.perf_counter()
            if i:  # the first save also compiles the non-finite check
                blocked.append(returned - start)
                total.append(done - start)
    return statistics.median(blocked), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="state size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (False, True):
            rows.append(("local", mode, *measure(f"{tmp}/local-{mode}", None, async_save=mode,
                                                 mb=args.mb, repeats=args.repeats)))  # fmt: skip
        if not args.no_s3:
            import boto3

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            proc, url = _start_moto()
            try:
                boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
                    Bucket="bench"
                )
                for mode in (False, True):
                    directory = f"s3://bench/ckpt-{mode}"
                    blocked, total = measure(directory, {"endpoint": url}, async_save=mode,
                                             mb=args.mb, repeats=args.repeats)  # fmt: skip
                    rows.append(("s3 (moto)", mode, blocked, total))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    print(f"state: {args.mb} MB f32; median of {args.repeats} saves")
    print(f"{'storage':<10} {'mode':<6} {'blocked s':>10} {'total s':>9}")
    for storage, mode, blocked, total in rows:
        print(f"{storage:<10} {'async' if mode else 'sync':<6} {blocked:>10.3f} {total:>9.3f}")


if __name__ == "__main__":
    main()
