"""Profiling: `axplug train --profile` traces a window of steps, modules run in named scopes
(so traces and HLO read by layer), and a bad window is refused before training."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
from types import SimpleNamespace

import jax
import pytest
from axplug_testing import tiny_train_args, tiny_trainer_config

from axplug.cli.main import main
from axplug.config import ConfigError
from axplug.trainer.profiling import StepProfiler, check_profile_steps, profile_window

# A layer's scope path as jax.named_scope writes it: only the scopes make the `/` path.
LAYER_SCOPE = "transformer/layer0/attention"


def _events(xplane):
    data = jax.profiler.ProfileData.from_file(str(xplane))
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                yield event.name, dict(event.stats)


def test_profile_traces_the_window_with_its_device_work(tmp_path, capsys):
    argv = tiny_train_args(tmp_path, max_steps=4)
    assert main([*argv, "--profile", "2:4"]) == 0
    runs = list((tmp_path / "profile" / "plugins" / "profile").iterdir())
    assert len(runs) == 1
    (xplane,) = runs[0].glob("*.xplane.pb")
    assert xplane.stat().st_size > 0
    events = list(_events(xplane))
    # Steps 2 and 3, each one execution of the compiled step (the trace stops after the
    # last one's results are ready); not step 1 (compiled ahead) nor step 4.
    steps = sorted(int(stats["step_num"]) for name, stats in events if "step_num" in stats)
    assert steps == [2, 3]
    executions = {s["run_id"] for _, s in events if s.get("hlo_module") == "jit_step"}
    assert len(executions) == 2
    # The named scopes reach the trace: its HLO metadata names ops by module path.
    assert LAYER_SCOPE.encode() in xplane.read_bytes()
    with gzip.open(runs[0] / "perfetto_trace.json.gz") as f:
        trace = json.load(f)
    device_ops = [e for e in trace["traceEvents"] if e.get("args", {}).get("hlo_module")]
    assert device_ops and all(e["args"]["hlo_module"] == "jit_step" for e in device_ops)
    err = capsys.readouterr().err
    assert "profiling steps 2..3" in err and f"tensorboard --logdir {tmp_path}/profile" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--profile", "3:2"], "B must be > A, got '3:2'"),
        (["--profile", "-1"], "steps count from 1"),
        (["--profile", "0:2"], "steps count from 1"),
        (["--profile", "2:9"], "ends at step 8, after the run's last step (max_steps 4)"),
        (["--profile", "five"], "expected A:B (steps A to B-1) or N"),
        (["--set", "profile.steps=5"], "ends at step 5, after the run's last step"),
    ],
)
def test_bad_window_is_one_error_before_training(tmp_path, capsys, flags, message):
    run_dir = tmp_path / "run"
    assert main([*tiny_train_args(run_dir, max_steps=4), *flags]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and errors[0].startswith("error: profile.steps: ")
    assert message in errors[0]
    assert not run_dir.exists()  # refused before anything is written


def test_window_parsing():
    assert profile_window("10:13", 20) == (10, 12)
    assert profile_window("7", 7) == (7, 7)
    assert profile_window(3, 7) == (3, 3)  # an int from a config file
    for bad in ("", "1:", ":3", "2:2", "1:2:3", "-2:4", "8"):
        assert isinstance(profile_window(bad, 7), str), bad
    cfg = tiny_trainer_config("/tmp/unused", "profile.steps='1:3'", max_steps=2)
    assert check_profile_steps(cfg) == (1, 2)  # steps 1 and 2 of 2
    cfg.profile.steps = "2:4"
    with pytest.raises(ConfigError, match="profile.steps"):
        check_profile_steps(cfg)


def test_a_resumed_run_traces_what_is_left_of_the_window(tmp_path):
    cfg = SimpleNamespace(
        profile=SimpleNamespace(steps="5:9"), max_steps=10, output_dir=str(tmp_path)
    )
    assert StepProfiler.for_run(cfg, start=8) is None  # steps 5..8 were done
    profiler = StepProfiler.for_run(cfg, start=6)
    assert (profiler.first, profiler.last) == (7, 8)
    assert profiler.log_dir == str(tmp_path / "profile")
    assert (
        StepProfiler.for_run(SimpleNamespace(profile=SimpleNamespace(steps=None)), start=0) is None
    )


def test_a_run_raising_inside_the_window_still_writes_and_stops_its_trace(tmp_path):
    profiler = StepProfiler(1, 3, str(tmp_path))
    x = jax.numpy.ones((8, 8))
    with pytest.raises(RuntimeError, match="boom"):
        try:
            for step in (1, 2, 3):
                profiler.before_step(step)
                y = jax.jit(lambda a: a @ a)(x)
                profiler.after_step(step, y)
                if step == 2:
                    raise RuntimeError("boom")
        finally:
            profiler.close()
    assert not profiler.tracing
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    # No trace is left running: another one starts and stops.
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def _tiny_step(tmp_path, named_scope=None):
    """The tiny model's train step, lowered (and compiled), with `jax.named_scope` replaced."""
    from axplug.trainer import Trainer

    with contextlib.ExitStack() as stack:
        if named_scope is not None:
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                jax, "named_scope", named_scope
            )
        lowered = Trainer(tiny_trainer_config(tmp_path)).lower_step()
        compiled = lowered.compile()
    return lowered, compiled.as_text()


def _instructions(hlo: str) -> list[str]:
    """The opcode of each instruction of an HLO module's text."""
    return re.findall(r"^\s+(?:ROOT )?\S+ = \S+ ([\w-]+)\(", hlo, re.M)


def test_named_scopes_name_ops_by_module_path_and_add_no_ops(tmp_path):
    lowered, hlo = _tiny_step(tmp_path)
    assert LAYER_SCOPE in lowered.as_text(debug_info=True)  # StableHLO locations
    names = re.findall(r'op_name="([^"]+)"', hlo)
    assert any(f"(decoder)/{LAYER_SCOPE}/" in name and "dot_general" in name for name in names)
    assert any("/layer1/feed_forward/" in name for name in names)
    # Without the scopes: the same program, only the names differ.
    plain_lowered, plain_hlo = _tiny_step(tmp_path, lambda name: contextlib.nullcontext())
    assert LAYER_SCOPE not in plain_lowered.as_text(debug_info=True)
    assert plain_lowered.as_text() == lowered.as_text()
    assert sorted(_instructions(plain_hlo)) == sorted(_instructions(hlo))
    assert len(_instructions(hlo)) > 100
