"""Running at scale: multi-process start-up, per-process input, the watchdog, goodput and
the run directory's lease."""

from axplug.runtime.distributed import (
    CLUSTERS,
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    DistributedSpec,
    initialize_distributed,
    resolve_distributed,
)
from axplug.runtime.exit_codes import RESTART_EXIT_CODE
from axplug.runtime.goodput import PHASES, GoodputRecorder, format_goodput
from axplug.runtime.host_batch import process_rows, put_process_batch, shard_input_config
from axplug.runtime.peers import (
    DEFAULT_PEER_TIMEOUT_S,
    PeerMonitor,
    await_lost_peer,
    service_heartbeat_timeout,
    set_last_saved,
    start_peer_monitor,
    stop_peer_monitor,
)
from axplug.runtime.preemption import Preempted, StopAgreement, StopSignals
from axplug.runtime.run_lock import RunDirLock, RunDirLockedError, StoreLease
from axplug.runtime.watchdog import HANG_EXIT_CODE, Watchdog, thread_stacks

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "PeerMonitor",
    "Preempted",
    "await_lost_peer",
    "StopAgreement",
    "StopSignals",
    "service_heartbeat_timeout",
    "set_last_saved",
    "start_peer_monitor",
    "stop_peer_monitor",
    "CLUSTERS",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "HANG_EXIT_CODE",
    "PHASES",
    "RESTART_EXIT_CODE",
    "DistributedSpec",
    "RunDirLock",
    "RunDirLockedError",
    "StoreLease",
    "GoodputRecorder",
    "Watchdog",
    "format_goodput",
    "initialize_distributed",
    "process_rows",
    "put_process_batch",
    "resolve_distributed",
    "shard_input_config",
    "thread_stacks",
]
