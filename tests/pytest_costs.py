"""This repository's test costs (loaded by its conftest.py): each test's backend compiles
(persistent-cache misses), child processes and CPU seconds (its own and its children's: on
2 cores the suite's wall time follows its CPU time, not its tests' wall times), the top ten
of each printed at the end (`--test-costs FILE` writes every test's as JSON);
`--compile-budget FILE` fails a session whose compiles grow more than 10% over FILE's count
(`--write-compile-budget` writes it). A harness of this suite, not of axplug's users: it
lives beside the tests, not in the package."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"  # recorded once per hit
_COUNTS = "axplug_costs"  # the user property that carries a test's counts to the controller
_REWRITE = "rerun with --write-compile-budget (make compile-budget)"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("axplug", "axplug test costs")
    help = "fail when the session's backend compiles exceed FILE's count by more than 10%%"
    group.addoption("--compile-budget", metavar="FILE", help=help)
    help = "write this session's backend compiles to --compile-budget's FILE"
    group.addoption("--write-compile-budget", action="store_true", help=help)
    help = "write each test's [backend compiles, child processes, CPU seconds] to FILE (JSON)"
    group.addoption("--test-costs", metavar="FILE", help=help)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Costs(config), "axplug-costs")


class _Costs:
    """Counts each test's backend compiles and child processes; reports and budgets them."""

    def __init__(self, config: pytest.Config):
        self.config, self.listening, self.verdict = config, False, None
        # xdist workers send their counts to the controller, which reports them once.
        self.reports = not os.environ.get("PYTEST_XDIST_WORKER")
        self.compiles = self.hits = self.children = 0
        self.cpu_start = 0.0
        self.per_test: dict[str, tuple[float, ...]] = {}
        sys.addaudithook(self._audit)

    def _audit(self, event: str, _args: tuple) -> None:
        if event in ("subprocess.Popen", "os.posix_spawn", "os.fork"):
            self.children += 1

    def _compiled(self, event: str, _secs: float, **_: object) -> None:
        self.compiles += event == _BACKEND_COMPILE  # a cache hit is one too: counted apart
        self.hits += event == _CACHE_HIT

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        if not self.listening:  # jax is imported by the tests, not by this plugin
            import jax

            jax.monitoring.register_event_duration_secs_listener(self._compiled)
            self.listening = True
        self.compiles = self.hits = self.children = 0
        self.cpu_start = _cpu_seconds()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.when == "teardown":  # the test's counts are final once its teardown ran
            counts = (self.compiles - self.hits, self.children,
                      round(_cpu_seconds() - self.cpu_start, 2))  # fmt: skip
            report.user_properties.append((_COUNTS, counts))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, counts in report.user_properties:
            if name == _COUNTS:
                self.per_test[report.nodeid] = tuple(counts)

    def totals(self) -> tuple[int, int, float]:
        return tuple(sum(c[i] for c in self.per_test.values()) for i in (0, 1, 2))  # type: ignore[return-value]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not (self.reports and self.per_test):
            return
        self.verdict, over = self._check_budget(self.totals()[0])
        if over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not (self.reports and self.per_test):
            return
        (compiles, children, cpu), tests = self.totals(), len(self.per_test)
        write = terminalreporter.write_line
        terminalreporter.section("axplug test costs")
        write(f"{compiles} backend compiles, {children} child processes and {cpu:.0f} CPU seconds "
              f"in {tests} tests")  # fmt: skip
        for index, what in ((0, "backend compiles"), (1, "child processes"), (2, "CPU seconds")):
            top = Counter({k: v[index] for k, v in self.per_test.items() if v[index]})
            write(f"most {what}:")
            for nodeid, count in top.most_common(10):
                write(f"  {count:6.0f}  {nodeid}")
        if self.verdict:
            write(self.verdict)
        if path := self.config.getoption("test_costs"):
            Path(path).write_text(json.dumps(self.per_test) + "\n")
            write(f"each test's [compiles, children, CPU seconds]: {path}")

    def _check_budget(self, compiles: float) -> tuple[str | None, bool]:
        """(what to print, whether the session is over its budget)."""
        path = self.config.getoption("compile_budget")
        if not path:
            return None, False
        if self.config.getoption("write_compile_budget"):
            Path(path).write_text(json.dumps({"backend_compiles": compiles}) + "\n")
            return f"compile budget: wrote {compiles} backend compiles to {path}", False
        try:
            budget = int(json.loads(Path(path).read_text())["backend_compiles"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"error: compile budget {path} is unreadable ({exc}): {_REWRITE}", True
        limit = int(budget * 1.1)  # the 10% a budget allows
        if compiles > limit:
            return (
                f"error: {compiles} backend compiles, over the budget of {budget} + 10% ({limit}) "
                f"in {path}: a test compiles a program again (see the list above); share it, or "
                f"if the compiles are intended, {_REWRITE}"
            ), True
        return f"compile budget: {compiles} backend compiles of {budget} (+10%: {limit})", False


def _cpu_seconds() -> float:
    """CPU seconds of this process's threads and of its children that have been waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
