"""`axplug launch --print slurm|k8s|tpu-vm`: job templates that run `axplug train` on every host."""

import pathlib
import shlex
import subprocess

import pytest

from axplug.api.run import HANG_EXIT_CODE, DistributedSpec, resolve_distributed

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "launch.md"
GPU_JOB = ["--preset", "llama2-7b", "--mesh-rule", "gpu-h100-8x4"]


def launch(capsys, *args):
    from axplug_testing import cli_main as main

    code = main(["launch", "--print", *args])
    out, err = capsys.readouterr()
    return code, out, err


def parse_train(command):
    from axplug_testing import command_parser as build_parser

    assert command[:2] == ["axplug", "train"]
    return build_parser().parse_args(command[1:])


def parse_agent(command):
    """`axplug launch --agent ... -- axplug train ...`: the agent's flags, the train args."""
    from axplug_testing import command_parser as build_parser

    assert command[:3] == ["axplug", "launch", "--agent"]
    args = build_parser(command[1:]).parse_args(command[1:])
    assert args.agent and args.command[0] == "--"
    return args, parse_train(args.command[1:])


def test_k8s_template_is_an_indexed_job_running_the_agent_around_axplug_train(capsys):
    yaml = pytest.importorskip("yaml")
    code, out, _ = launch(
        capsys, "k8s", *GPU_JOB, "--set", "learner.learning_rate=1e-4", "--spares", "1"
    )
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["PriorityClass", "PriorityClass", "Service", "Job", "Deployment"]
    train_class, standby_class, service, job, standby = docs
    spec = job["spec"]
    assert service["spec"]["clusterIP"] == "None"
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4  # 32 H100s, 8 per host
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    # The trainer preempts standby work; a SIGTERM leaves it 120 s to save.
    assert pod["priorityClassName"] == train_class["metadata"]["name"]
    assert train_class["value"] > 0 > standby_class["value"]
    assert standby_class["preemptionPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 120 and pod["restartPolicy"] == "Never"
    # Exit 75 and disruptions recreate the pod without counting; exit 2 fails the Job.
    rules = {
        (r["action"], tuple(r["onExitCodes"]["values"]) if "onExitCodes" in r else "disruption")
        for r in spec["podFailurePolicy"]["rules"]
    }
    assert rules == {("FailJob", (2,)), ("Ignore", (HANG_EXIT_CODE,)), ("Ignore", "disruption")}
    (container,) = pod["containers"]
    agent, args = parse_agent(container["command"])
    assert agent.max_restarts == 5
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
    # One standby pod holding a node of the same accelerators, at the lowest priority.
    assert standby["spec"]["replicas"] == 1
    standby_pod = standby["spec"]["template"]["spec"]
    assert standby_pod["priorityClassName"] == standby_class["metadata"]["name"]
    assert standby_pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}


def test_k8s_standby_runs_the_low_priority_command(capsys):
    yaml = pytest.importorskip("yaml")
    lowprio = "axplug train --preset llama-tiny --output-dir gs://b/lowprio"
    code, out, _ = launch(capsys, "k8s", *GPU_JOB, "--spares", "2", "--spare-command", lowprio)
    assert code == 0
    standby = list(yaml.safe_load_all(out))[-1]
    assert standby["spec"]["replicas"] == 2
    assert standby["spec"]["template"]["spec"]["containers"][0]["command"] == lowprio.split()


def _bash_syntax_ok(script, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


def test_slurm_template_has_spare_nodes_requeue_and_the_agent_in_srun(capsys, tmp_path):
    code, out, _ = launch(capsys, "slurm", *GPU_JOB, "--spares", "1")
    assert code == 0
    assert _bash_syntax_ok(out, tmp_path).returncode == 0
    assert "#SBATCH --nodes=5\n" in out and "TRAIN_NODES=4\n" in out  # 4 train, 1 stands by
    assert "#SBATCH --gpus-per-node=8\n" in out and "#SBATCH --ntasks-per-node=1\n" in out
    for line in ("#SBATCH --requeue", "#SBATCH --no-kill", "#SBATCH --signal=B:TERM@120"):
        assert line + "\n" in out
    assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n" in out
    words = shlex.split(out.replace("\\\n", " "), comments=True)
    srun = words.index("srun")
    assert words[srun + 1 : srun + 4] == [
        "--nodes=$TRAIN_NODES", "--ntasks=$TRAIN_NODES", "--kill-on-bad-exit=1"
    ]  # fmt: skip
    start = words.index("axplug", srun)
    agent, args = parse_agent(words[start : words.index("&", start)])
    assert args.overrides == ["watchdog.exit_on_hang=True"] and args.cluster == "auto"
    assert 'scontrol requeue "$SLURM_JOB_ID"' in out
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
    from axplug.api.sharding import device_spec_of

    code, out, _ = launch(capsys, "tpu-vm", "--preset", "llama2-7b", "--mesh-rule", "tpu-v5p-64")
    assert code == 0
    assert _bash_syntax_ok(out, tmp_path).returncode == 0
    hosts = 64 // device_spec_of("tpu-v5p-slice").chips_per_host
    assert f"on {hosts} hosts" in out
    line = next(line for line in out.splitlines() if line.startswith("gcloud "))
    words = shlex.split(line)
    assert "--worker=all" in words
    _, args = parse_agent(shlex.split(words[words.index("--command") + 1]))
    assert args.cluster == "tpu-vm" and args.mesh_rule == "tpu-v5p-64"


def test_docs_show_exactly_what_the_command_prints(capsys):
    docs = DOCS.read_text()
    examples = [
        ["slurm", *GPU_JOB, "--spares", "1"],
        ["k8s", *GPU_JOB, "--spares", "1", "--image", "ghcr.io/example/axplug:0.1",
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
    code, _, err = launch(capsys, "k8s", "--mesh-rule", "cpu")
    assert code == 2 and "launch --print needs --preset" in err
