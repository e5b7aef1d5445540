"""`python kill_at_save.py STEP train ARGS...`: `axplug train ARGS` that SIGKILLs itself once
the persistent save of STEP has started (its write still in flight; the local tier's last
write done, as every save waits for it): killed during a persistent save, at an exact point."""

import os
import signal
import sys

from axplug.cli._logging import configure_logging
from axplug.cli.main import build_parser
from axplug.cli.train_cmd import build_config, start_processes
from axplug.hookspecs import hookimpl
from axplug.trainer.run import train


class _KillDuringSave:
    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def on_checkpoint_saved(self, trainer, step, path):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    args = build_parser().parse_args(sys.argv[2:])
    start_processes(args)
    configure_logging(0)
    train(build_config(args), hooks=(_KillDuringSave(int(sys.argv[1])),))
    sys.exit("the run finished: the kill never happened")
