"""`axplug launch --print k8s`: an Indexed Job with standby capacity, priorities and a
failure policy that restarts on exit 75 and on disruption without counting a failure;
`--print k8s-indexed`: `axplug prepare-data` as an Indexed Job, one slice of the sources a pod."""

from __future__ import annotations

from axplug_launch.plan import RESTART_EXIT_CODE, ArrayPlan, JobPlan, title, yaml_string

__all__ = ["render_k8s", "render_k8s_indexed"]

# Kubernetes resource names of one accelerator, by DeviceSpec platform.
_RESOURCES = {
    "gpu": "nvidia.com/gpu",
    "tpu": "google.com/tpu",
    "neuron": "aws.amazon.com/neuron",
}
OBJECT_STORE_SECRET = "axplug-object-store"  # optional: its keys become the pods' environment
BACKOFF_LIMIT_PER_INDEX = 3
TRAIN_PRIORITY = 1000000
STANDBY_PRIORITY = -10  # below every default (0) pod: the first to go


def _limits(plan: JobPlan, indent: str) -> str:
    resource = _RESOURCES.get(plan.platform)
    if not resource:
        return ""
    return (
        f"\n{indent}resources:\n{indent}  limits:\n{indent}    {resource}: {plan.devices_per_host}"
    )


def _command(args: tuple[str, ...], indent: str) -> str:
    return "\n".join(f"{indent}- {yaml_string(a)}" for a in args)


def _priority_classes(plan: JobPlan) -> str:
    return f"""apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata:
  name: {plan.name}-train
value: {TRAIN_PRIORITY}
preemptionPolicy: PreemptLowerPriority
description: "axplug training pods: a recreated pod takes a standby node"
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata:
  name: {plan.name}-standby
value: {STANDBY_PRIORITY}
preemptionPolicy: Never
description: "standby capacity and low-priority work, preempted by training pods"
---
"""


def _standby(plan: JobPlan) -> str:
    command = plan.spare_command or ("sleep", "infinity")
    return f"""---
# {plan.spares} standby node(s): pods of the lowest priority that hold a node each (the same
# accelerators) and run low-priority work. A training pod recreated after a failure preempts
# one (SIGTERM, {plan.grace_s} s to yield) and starts at once instead of waiting for a new node.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {plan.name}-standby
spec:
  replicas: {plan.spares}
  selector:
    matchLabels:
      app: {plan.name}-standby
  template:
    metadata:
      labels:
        app: {plan.name}-standby
    spec:
      priorityClassName: {plan.name}-standby
      terminationGracePeriodSeconds: {plan.grace_s}
      containers:
        - name: standby
          image: {yaml_string(plan.image)}
          command:
{_command(command, "            ")}{_limits(plan, "          ")}
"""


def render_k8s(plan: JobPlan) -> str:
    """PriorityClasses, a headless Service, the Indexed Job, and a standby Deployment."""
    standby = _standby(plan) if plan.spares else ""
    return f"""{title(plan)}
# A headless Service gives pod i the name {plan.name}-i.{plan.name}; pod 0 is the coordinator.
# The Job is Indexed: each pod's completion index is its JAX process id.
{_priority_classes(plan)}apiVersion: v1
kind: Service
metadata:
  name: {plan.name}
spec:
  clusterIP: None
  selector:
    job-name: {plan.name}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: {plan.name}
spec:
  completionMode: Indexed
  completions: {plan.hosts}
  parallelism: {plan.hosts}
  # In a pod the agent restarts a trainer that exits {RESTART_EXIT_CODE} (hung, lost peer) in place.
  # A pod that fails is recreated under the same index: exit {RESTART_EXIT_CODE} (stopped with the
  # state safe) and disruptions (preemption, node drain or loss) count no failure; exit 2 (bad
  # flags or config) fails the Job; anything else counts toward backoffLimit.
  backoffLimit: {max(3, plan.hosts)}
  podFailurePolicy:
    rules:
      - action: FailJob
        onExitCodes:
          containerName: train
          operator: In
          values: [2]
      - action: Ignore
        onExitCodes:
          containerName: train
          operator: In
          values: [{RESTART_EXIT_CODE}]
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
  template:
    spec:
      subdomain: {plan.name}
      restartPolicy: Never
      priorityClassName: {plan.name}-train
      # SIGTERM, then this long to finish the step in flight and save it.
      terminationGracePeriodSeconds: {plan.grace_s}
      containers:
        - name: train
          image: {yaml_string(plan.image)}
          command:
{_command(plan.agent_args, "            ")}
          env:
            - name: JAX_COORDINATOR_ADDRESS
              value: {yaml_string(f"{plan.name}-0.{plan.name}:{plan.port}")}
            - name: JAX_NUM_PROCESSES
              value: {yaml_string(str(plan.hosts))}
            - name: JAX_PROCESS_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
          ports:
            - containerPort: {plan.port}{_limits(plan, "          ")}
{standby}"""


def _verbatim(arg: str) -> str:
    """`arg` as a YAML string Kubernetes passes on unchanged: `$$` is its escape for `$`."""
    return yaml_string(arg.replace("$", "$$"))


def render_k8s_indexed(plan: ArrayPlan) -> str:
    """An Indexed Job: pod i runs `axplug prepare-data --task-index i`; an index retries alone."""
    parallelism = min(plan.max_parallel or plan.tasks, plan.tasks)
    indent = "            "
    command = "\n".join(f"{indent}- {_verbatim(a)}" for a in plan.prepare_args)
    tasks, cpus = plan.tasks, plan.cpus_per_task
    return f"""# axplug: prepare-data in {tasks} pods, {parallelism} at a time, {cpus} CPUs each
# Pod i (completion index i) tokenizes the i-th slice of the sources into the output every pod
# shares; the last to finish writes meta.json. Sources, tokenizer and output must be reachable
# from every pod: object-store URLs, or a shared volume you mount (volumes, volumeMounts).
apiVersion: batch/v1
kind: Job
metadata:
  name: {plan.name}
spec:
  completionMode: Indexed
  completions: {plan.tasks}
  parallelism: {parallelism}
  # A failed index is retried alone (up to {BACKOFF_LIMIT_PER_INDEX} times; Kubernetes 1.29+)
  # while the others run on, and resumes: prepare-data skips the shards it finished. Exit 2
  # (bad flags or arguments, which a retry repeats) fails the Job; disruptions (preemption,
  # node drain) count no failure.
  backoffLimitPerIndex: {BACKOFF_LIMIT_PER_INDEX}
  podFailurePolicy:
    rules:
      - action: FailJob
        onExitCodes:
          containerName: prepare-data
          operator: In
          values: [2]
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: prepare-data
          image: {yaml_string(plan.image)}
          command:
{command}
            - "--num-tasks"
            - {yaml_string(str(plan.tasks))}
            - "--task-index"
            - "$(JOB_COMPLETION_INDEX)"
          env:
            # The Job controller sets it too; declared here, $(JOB_COMPLETION_INDEX) above
            # expands to it.
            - name: JOB_COMPLETION_INDEX
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
          # Object-store settings (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
          # AWS_SECRET_ACCESS_KEY, ...) from this Secret, when it exists:
          #   kubectl create secret generic {OBJECT_STORE_SECRET} \\
          #       --from-literal=AWS_ENDPOINT_URL=https://... --from-literal=AWS_REGION=...
          envFrom:
            - secretRef:
                name: {OBJECT_STORE_SECRET}
                optional: true
          resources:
            requests:
              cpu: {yaml_string(str(plan.cpus_per_task))}
"""
