"""`axplug launch --print slurm-array|k8s-indexed`: `axplug prepare-data` split into array tasks."""

import os
import pathlib
import re
import shlex
import subprocess

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

SOURCES = ["my docs/part a.jsonl", "b.jsonl"]  # a space in a path: one argument, quoted
PREPARE = ["prepare-data", *SOURCES, "--tokenizer", "tok.json", "--output", "s3://bucket/data"]


def launch(capsys, *args):
    from axplug_testing import cli_main as main

    code = main(["launch", "--print", *args])
    out, err = capsys.readouterr()
    return code, out, err


def check_prepare_data(args):
    """The rendered command as the core's `axplug prepare-data` parser reads it."""
    from axplug_testing import command_parser as build_parser

    assert args[:2] == ["axplug", "prepare-data"]
    parsed, unknown = build_parser(args[1:]).parse_known_args(args[1:])
    # --num-tasks/--task-index: parsed where the core has them, left over where it does not yet.
    assert unknown in ([], args[-4:]), unknown
    return parsed


def fake_axplug(tmp_path):
    """A PATH with an `axplug` that prints each of its arguments on a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    axplug = bin_dir / "axplug"
    axplug.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    axplug.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def run_script(script, tmp_path, **env):
    path = tmp_path / "prep.sbatch"
    path.write_text(script)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ.update(PATH=fake_axplug(tmp_path), **env)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=environ)


def test_slurm_array_runs_task_i_of_n_with_the_array_index(capsys, tmp_path):
    code, out, err = launch(
        capsys, "slurm-array", "--tasks", "4", "--max-parallel", "2", "--cpus-per-task", "8",
        "--job-name", "prep-web", *PREPARE,
    )  # fmt: skip
    assert code == 0, err
    for line in (
        "#SBATCH --array=0-3%2",  # indices 0..3, at most 2 at a time
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --job-name=prep-web",
        "#SBATCH --output=prep-web-%A_%a.log",  # array job id, task index
        "#SBATCH --requeue",
    ):
        assert line + "\n" in out
    path = tmp_path / "prep.sbatch"
    path.write_text(out)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "'my docs/part a.jsonl'" in out  # shell-quoted: one argument
    assert '--task-index "$SLURM_ARRAY_TASK_ID"' in out
    # The script under Slurm's environment, `axplug` printing the arguments it gets.
    ran = run_script(out, tmp_path, SLURM_ARRAY_TASK_ID="2")
    assert ran.returncode == 0, ran.stderr
    args = ["axplug", *ran.stdout.splitlines()]
    assert args == [
        "axplug", *PREPARE, "--workers", "8", "--num-tasks", "4", "--task-index", "2"
    ]  # fmt: skip
    parsed = check_prepare_data(args)
    assert parsed.files == SOURCES and parsed.workers == 8 and parsed.output == "s3://bucket/data"
    # Outside an array the script stops before running anything, saying why.
    ran = run_script(out, tmp_path)
    assert (
        ran.returncode != 0
        and ran.stdout == ""
        and "submit this script with sbatch" in (ran.stderr)
    )


def test_slurm_array_defaults_and_the_merge_fallback(capsys):
    code, out, _ = launch(capsys, "slurm-array", "--tasks", "8", *PREPARE)
    assert code == 0
    assert "#SBATCH --array=0-7\n" in out  # no throttle
    assert "#SBATCH --cpus-per-task=16\n" in out and "--workers 16 \\\n" in out
    assert "#SBATCH --job-name=axplug-prepare-data\n" in out
    # The dependent merge job, commented: it writes meta.json if no task did.
    comments = "\n".join(line[2:] for line in out.splitlines() if line.startswith("#   "))
    words = shlex.split(comments.replace("\\\n", " "))
    assert "JOBID=$(sbatch --parsable THIS_SCRIPT)" in comments
    sbatch = words.index("sbatch")  # the second line: the first is in JOBID=$(...)
    assert words[sbatch + 1] == "--dependency=afterok:$JOBID"
    wrap = next(w for w in words[sbatch:] if w.startswith("--wrap="))
    merge = shlex.split(wrap.removeprefix("--wrap="))
    assert merge == ["axplug", "prepare-data", "--merge", "--output", "s3://bucket/data"]


def test_slurm_array_keeps_the_workers_given(capsys, tmp_path):
    code, out, _ = launch(
        capsys, "slurm-array", "--tasks", "2", "--", *PREPARE, "--workers", "6"
    )  # fmt: skip
    assert code == 0
    assert "#SBATCH --cpus-per-task=6\n" in out and out.count("--workers") == 1
    ran = run_script(out, tmp_path, SLURM_ARRAY_TASK_ID="1")
    assert ran.stdout.splitlines()[-6:] == [
        "--workers",
        "6",
        "--num-tasks",
        "2",
        "--task-index",
        "1",
    ]


def test_k8s_indexed_job_gives_each_pod_its_completion_index(capsys):
    yaml = pytest.importorskip("yaml")
    prepare = [*PREPARE, "--field", "a $(FIELD) $HOME"]  # `$` passed on as given
    code, out, err = launch(
        capsys, "k8s-indexed", "--tasks", "64", "--max-parallel", "16", "--cpus-per-task", "4",
        "--image", "ghcr.io/me/axplug:1", *prepare,
    )  # fmt: skip
    assert code == 0, err
    (job,) = list(yaml.safe_load_all(out))
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert (spec["completions"], spec["parallelism"]) == (64, 16)
    assert (
        spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    )  # an index retries alone
    rules = {(r["action"], tuple(r.get("onExitCodes", {}).get("values", ()))) for r in
             spec["podFailurePolicy"]["rules"]}  # fmt: skip
    assert rules == {("FailJob", (2,)), ("Ignore", ())}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what backoffLimitPerIndex requires
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/me/axplug:1"
    assert container["resources"]["requests"] == {"cpu": "4"}
    command = container["command"]
    assert command[-4:] == ["--num-tasks", "64", "--task-index", "$(JOB_COMPLETION_INDEX)"]
    # Kubernetes expands $(VAR) in a command and reads `$$` as `$`: every given `$` is escaped.
    assert command[:-4] == ["axplug", *prepare[:-1], "a $$(FIELD) $$HOME", "--workers", "4"]
    env = {e["name"]: e for e in container["env"]}
    field = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # What the kubelet runs for pod 5.
    expanded = [
        re.sub(r"\$\$|\$\(JOB_COMPLETION_INDEX\)", lambda m: "$" if m[0] == "$$" else "5", a)
        for a in command
    ]
    parsed = check_prepare_data(expanded)
    assert parsed.files == SOURCES and parsed.field == "a $(FIELD) $HOME"
    assert expanded[-2:] == ["--task-index", "5"]
    # Object-store settings from a Secret, when one exists.
    (source,) = container["envFrom"]
    assert source["secretRef"]["optional"] is True
    assert "AWS_ENDPOINT_URL" in out


def test_k8s_indexed_parallelism_defaults_to_every_task(capsys):
    yaml = pytest.importorskip("yaml")
    code, out, _ = launch(capsys, "k8s-indexed", "--tasks", "3", "--max-parallel", "9", *PREPARE)
    assert code == 0
    spec = yaml.safe_load(out)["spec"]
    assert (spec["completions"], spec["parallelism"]) == (3, 3)
    container = spec["template"]["spec"]["containers"][0]
    assert container["image"] == "REGISTRY/axplug:latest"  # as the training template
    assert container["resources"]["requests"] == {"cpu": "16"}


@pytest.mark.parametrize(
    "args, message",
    [
        (PREPARE, "needs --tasks N (>= 1)"),
        (["--tasks", "0", *PREPARE], "needs --tasks N (>= 1), got 0"),
        ([*PREPARE, "--tasks", "4"], "(launch's flags go before prepare-data)"),
        (["--tasks", "4"], "end with the command to split"),
        (["--tasks", "4", "train", "--preset", "llama-tiny"], "got 'train --preset'"),
        (["--tasks", "4", *PREPARE, "--num-tasks", "4"], "drop --num-tasks from the prepare"),
        (["--tasks", "4", *PREPARE, "--task-index=1"], "drop --task-index from the prepare"),
        (["--tasks", "4", *PREPARE, "--merge"], "drop --merge"),
        (["--tasks", "4", *PREPARE[:-2]], "prepare-data needs --output DIR"),
        (["--tasks", "4", "--max-parallel", "0", *PREPARE], "--max-parallel must be >= 1"),
        (["--tasks", "4", "--cpus-per-task", "0", *PREPARE], "--cpus-per-task must be >= 1"),
    ],
)
@pytest.mark.parametrize("target", ["slurm-array", "k8s-indexed"])
def test_array_errors_are_one_line_naming_the_fix(capsys, target, args, message):
    code, out, err = launch(capsys, target, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_training_targets_refuse_the_array_flags_and_still_render(capsys):
    job = ["--preset", "gpt-tiny", "--mesh-rule", "cpu", "--hosts", "2", "--devices-per-host", "4"]
    code, _, err = launch(capsys, "slurm", *job, "--tasks", "4")
    assert code == 2 and "--tasks is for --print slurm-array|k8s-indexed, not slurm" in err
    code, out, _ = launch(capsys, "k8s", *job, "--job-name", "tiny")  # --job-name: --name
    assert code == 0 and "name: tiny\n" in out


def test_help_examples_render_and_the_readme_shows_them(capsys):
    from axplug_testing import cli_main as main

    assert main(["launch", "--help"]) == 0
    help_text = capsys.readouterr().out
    examples = re.findall(r"axplug launch --print (?:slurm-array|k8s-indexed)[^>]*", help_text)
    assert len(examples) == 2
    readme = " ".join(README.read_text().split())
    for example in examples:
        assert " ".join(example.split()) in readme
        args = shlex.split(example.replace("\\\n", " "))
        code, out, err = launch(capsys, *args[3:])
        assert code == 0 and "--task-index" in out, err
