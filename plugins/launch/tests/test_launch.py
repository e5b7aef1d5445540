"""`axplug launch --print slurm|k8s|tpu-vm`: job templates that run `axplug train` on every host."""

import pathlib
import shlex
import subprocess

import pytest

from axplug.runtime import HANG_EXIT_CODE, DistributedSpec, resolve_distributed

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "launch.md"
GPU_JOB = ["--preset", "llama2-7b", "--mesh-rule", "gpu-h100-8x4"]


def launch(capsys, *args):
    from axplug.cli.main import main

    code = main(["launch", "--print", *args])
    out, err = capsys.readouterr()
    return code, out, err


def parse_train(command):
    from axplug.cli.main import build_parser

    assert command[:2] == ["axplug", "train"]
    return build_parser().parse_args(command[1:])


def test_k8s_template_is_an_indexed_job_running_axplug_train(capsys):
    yaml = pytest.importorskip("yaml")
    code, out, _ = launch(capsys, "k8s", *GPU_JOB, "--set", "learner.learning_rate=1e-4")
    assert code == 0
    service, job = yaml.safe_load_all(out)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4  # 32 H100s, 8 per host
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    (container,) = pod["containers"]
    args = parse_train(container["command"])
    assert (args.preset, args.mesh_rule) == ("llama2-7b", "gpu-h100-8x4")
    assert args.overrides == ["learner.learning_rate=1e-4", "watchdog.exit_on_hang=True"]
    env = {
        e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
    }
    name = job["metadata"]["name"]
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-0.{name}:1234"
    assert env["JAX_NUM_PROCESSES"] == "4"
    assert "job-completion-index" in env["JAX_PROCESS_ID"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    # What each pod's environment gives `axplug train`.
    pod_env = {**env, "JAX_PROCESS_ID": "3"}
    assert resolve_distributed(environ=pod_env) == DistributedSpec(
        f"{name}-0.{name}:1234", 4, 3, None, resolve_distributed(environ=pod_env).source
    )


def _bash_syntax_ok(script, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


def test_slurm_template_is_valid_bash_and_srun_runs_axplug_train(capsys, tmp_path):
    code, out, _ = launch(capsys, "slurm", *GPU_JOB)
    assert code == 0
    assert _bash_syntax_ok(out, tmp_path).returncode == 0
    assert "#SBATCH --nodes=4\n" in out and "#SBATCH --gpus-per-node=8\n" in out
    assert "#SBATCH --ntasks-per-node=1\n" in out
    assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n" in out
    words = shlex.split(out.replace("\\\n", " "), comments=True)
    command = words[words.index("srun") + 2 : words.index("||")]
    args = parse_train(command)
    assert args.overrides == ["watchdog.exit_on_hang=True"] and args.cluster == "auto"
    assert f"-eq {HANG_EXIT_CODE} ]; then scontrol requeue" in out
    # Under srun, `axplug train` detects the job and leaves the details to JAX.
    slurm = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_NODELIST": "gpu[01-04]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
    }
    assert resolve_distributed(environ=slurm).cluster == "slurm"


def test_tpu_vm_template_runs_the_command_on_every_worker(capsys, tmp_path):
    from axplug.mesh_rules import device_spec_of

    code, out, _ = launch(capsys, "tpu-vm", "--preset", "llama2-7b", "--mesh-rule", "tpu-v5p-64")
    assert code == 0
    assert _bash_syntax_ok(out, tmp_path).returncode == 0
    hosts = 64 // device_spec_of("tpu-v5p-slice").chips_per_host
    assert f"on {hosts} hosts" in out
    line = next(line for line in out.splitlines() if line.startswith("gcloud "))
    words = shlex.split(line)
    assert "--worker=all" in words
    args = parse_train(shlex.split(words[words.index("--command") + 1]))
    assert args.cluster == "tpu-vm" and args.mesh_rule == "tpu-v5p-64"


def test_docs_show_exactly_what_the_command_prints(capsys):
    docs = DOCS.read_text()
    examples = [
        ["slurm", *GPU_JOB],
        ["k8s", *GPU_JOB, "--image", "ghcr.io/example/axplug:0.1",
         "--output-dir", "gs://my-bucket/runs/llama2-7b"],
        ["tpu-vm", "--preset", "llama2-7b", "--mesh-rule", "tpu-v5p-64",
         "--output-dir", "gs://my-bucket/runs/llama2-7b"],
    ]  # fmt: skip
    for example in examples:
        assert f"`axplug launch --print {' '.join(example)}`" in docs
        code, out, _ = launch(capsys, *example)
        assert code == 0 and out.strip() in docs, f"docs/launch.md is out of date for {example}"


def test_launch_errors_name_the_fix(capsys):
    code, _, err = launch(capsys, "slurm", "--preset", "llama-huge", "--mesh-rule", "cpu")
    assert code == 2 and "--preset: no presets component named 'llama-huge'" in err
    code, _, err = launch(capsys, "slurm", "--preset", "gpt-tiny", "--mesh-rule", "cpu")
    assert code == 2 and "names no device spec; pass --devices-per-host" in err
    code, out, _ = launch(
        capsys, "k8s", "--preset", "gpt-tiny", "--mesh-rule", "cpu", "--hosts", "2",
        "--devices-per-host", "4",
    )  # fmt: skip
    assert code == 0 and "completions: 2" in out and "resources" not in out
