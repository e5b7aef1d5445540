"""The exit codes of `axplug train` that a scheduler acts on."""

__all__ = ["RESTART_EXIT_CODE"]

# EX_TEMPFAIL in sysexits.h: "try again". The run stopped before max_steps with its state safe
# on disk (preempted and saved, hung, or a lost peer); rerunning the same command resumes. One
# code for all three, so one retry rule (a Kubernetes podFailurePolicy, a Slurm requeue test)
# covers them; the log line says which it was.
RESTART_EXIT_CODE = 75
