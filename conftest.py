"""Test setup for every test directory (tests/ and plugins/*/tests/): 8 fake CPU devices for
mesh tests, set before jax is imported, per-test cleanup of the CLI's logging, and the suite's
test costs and compile budget (tests/pytest_costs.py). The fixtures and the session's
compilation cache come from axplug's pytest plugin (axplug_testing)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
# pytester: tests of the harness run sessions of their own.
pytest_plugins = ["pytester", "pytest_costs"]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch (the transformers references, PEFT) and numpy's BLAS on one thread: with a thread per
# core, each tiny op of a tiny model waits on the pool, ~50x the CPU of the op itself, while the
# test workers share the cores. Set before either is imported; XLA's own pool is unaffected.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


@pytest.fixture(autouse=True)
def _axplug_logging_reset():
    """`axplug train` in-process gives the `axplug` logger its own handler and stops it
    propagating; undo that after each test, so caplog (on the root) sees axplug's records."""
    yield
    import logging

    logger = logging.getLogger("axplug")
    for handler in list(logger.handlers):
        if type(handler).__name__ == "_Handler":
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
