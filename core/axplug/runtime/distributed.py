"""Multi-process start-up: `jax.distributed` from flags, environment or the cluster's own variables.

One process runs per host (or per accelerator), all running the same command. Where the
coordinator, the process count and this process's id come from, first match wins:

1. explicit values (`axplug train --coordinator HOST:PORT --num-processes N --process-id I`);
2. the environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`;
3. JAX's cluster detection, used when the environment shows a multi-process job of a known
   scheduler (Slurm `srun`, Open MPI `mpirun`, GKE TPU slices), or when `cluster` names one
   (`slurm`, `ompi`, `k8s`, `gke-tpu`, `tpu-vm`, `mpi4py`);
4. otherwise the run is single-process and nothing is initialized.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from axplug.config import UsageError

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "CLUSTERS",
    "DistributedSpec",
    "resolve_distributed",
    "initialize_distributed",
]

log = logging.getLogger("axplug.runtime")

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX itself reads this one too
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# User-facing cluster names -> JAX's `cluster_detection_method` names.
CLUSTERS = {
    "slurm": "slurm",
    "ompi": "ompi",
    "k8s": "k8s",
    "gke-tpu": "gketpu",
    "tpu-vm": "gcetpu",
    "mpi4py": "mpi4py",
}


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """What to pass to `jax.distributed.initialize`; `None` fields are left to JAX's detection."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    cluster: str | None  # a JAX cluster_detection_method, or None
    source: str  # where the values came from, for the log line and errors


def _int(value: str | int | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None


def _check_address(address: str, name: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"{name} must be HOST:PORT (the address of process 0, e.g. 10.0.0.1:1234), "
            f"got {address!r}"
        )
    return address


def _detect_cluster(env: Mapping[str, str]) -> str | None:
    """The JAX detection method for a multi-process job visible in `env`, without I/O."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(k in env for k in slurm) and _int(env["SLURM_NTASKS"], "SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts:
        return "gketpu"
    return None


def resolve_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cluster: str = "auto",
    environ: Mapping[str, str] | None = None,
) -> DistributedSpec | None:
    """The multi-process settings for this process, or None for a single-process run.

    `cluster` is `auto` (detect), `none` (only explicit values and JAX_* variables count) or one
    of `CLUSTERS`. Raises UsageError (a ValueError) naming the flag or variable that is missing
    or malformed.
    """
    env = os.environ if environ is None else environ
    if cluster != "auto" and cluster != "none" and cluster not in CLUSTERS:
        raise UsageError(
            f"--cluster: unknown cluster {cluster!r}; choose auto, none or one of "
            f"{', '.join(CLUSTERS)}"
        )
    values = {
        "coordinator": (coordinator, "--coordinator", ENV_COORDINATOR),
        "num_processes": (num_processes, "--num-processes", ENV_NUM_PROCESSES),
        "process_id": (process_id, "--process-id", ENV_PROCESS_ID),
    }
    given: dict[str, object] = {}
    names: dict[str, str] = {}
    for key, (flag_value, flag, var) in values.items():
        if flag_value is not None:
            given[key], names[key] = flag_value, flag
        elif env.get(var):
            given[key], names[key] = env[var], var
    if "coordinator" in given:
        given["coordinator"] = _check_address(str(given["coordinator"]), names["coordinator"])
    for key in ("num_processes", "process_id"):
        if key in given:
            given[key] = _int(given[key], names[key])
    method = CLUSTERS.get(cluster)
    if method is None and cluster == "auto":
        method = _detect_cluster(env)
    if not given and method is None:
        return None
    spec = DistributedSpec(
        coordinator=given.get("coordinator"),
        num_processes=given.get("num_processes"),
        process_id=given.get("process_id"),
        cluster=method,
        source=", ".join(sorted(set(names.values()))) or f"{method} environment",
    )
    if method is None:
        # Without a cluster to fill the gaps, all three are needed.
        missing = [
            f"{flag} (or {var})" for key, (_, flag, var) in values.items() if key not in given
        ]
        if missing:
            raise UsageError(
                f"multi-process run ({spec.source} given) also needs {', '.join(missing)}; "
                "pass all three, or run under a scheduler JAX detects (see --cluster)"
            )
    if spec.num_processes is not None and spec.num_processes < 1:
        raise UsageError(f"{names['num_processes']} must be >= 1, got {spec.num_processes}")
    pid, count = spec.process_id, spec.num_processes
    if pid is not None and count is not None and not 0 <= pid < count:
        raise UsageError(
            f"{names['process_id']} must be in [0, {count}) for {count} processes, got {pid}"
        )
    return spec


def initialize_distributed(
    spec: DistributedSpec | None, *, timeout_s: int = 300, peer_timeout_s: float = 30.0
) -> tuple[int, int]:
    """Initializes `jax.distributed` for `spec` (None: nothing); returns (process index, count).

    Must run before anything touches a jax device. On CPU the collectives go over gloo. The
    coordination service's heartbeat timeout is set longer than `peer_timeout_s`, the
    `PeerMonitor`'s, so axplug's lost-peer line comes before the service's abort.
    """
    import jax

    from axplug.runtime.peers import service_heartbeat_timeout

    if spec is None:
        return 0, 1
    # The CPU backend needs a cross-process collectives library (gloo is jax 0.10's default;
    # set it where a version leaves it unset); GPU and TPU backends ignore this option.
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info(
        "initializing jax.distributed from %s: coordinator %s, %s processes, process id %s",
        spec.source,
        spec.coordinator or "(detected)",
        spec.num_processes if spec.num_processes is not None else "(detected)",
        spec.process_id if spec.process_id is not None else "(detected)",
    )
    kwargs = {}
    if spec.cluster is not None:
        kwargs["cluster_detection_method"] = spec.cluster
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=service_heartbeat_timeout(peer_timeout_s),
        **kwargs,
    )
    return jax.process_index(), jax.process_count()
