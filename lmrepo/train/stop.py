"""A stop request: the signals that ask a run to save a checkpoint and stop. Without torch, so
train.py installs it first, before the config is composed and the model is built: a signal that
comes during a start-up of minutes (a sweep's timeout, a scheduler's pre-emption) is answered
like one that comes during training, with a checkpoint after the first step."""

import os
import signal
import sys

from lmrepo.distributed import launch


def preemption_signal() -> signal.Signals:
    """The signal Slurm sends before a job's time limit under submitit (`--signal=USR2@<delay>`;
    SUBMITIT_PREEMPT_SIGNAL changes it)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")]


class StopRequest:
    """SIGTERM (a scheduler's pre-emption), SIGINT (Ctrl-C) or submitit's time-limit signal
    (SIGUSR2) asks for a checkpoint at the next step boundary on every rank; a second SIGINT
    interrupts at once. A handler that was there before (submitit's, which requeues the job) is
    called once the checkpoint is saved (`hand_back`)."""

    def __init__(self):
        self.signal_name, self.signum = None, None
        self.previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT, preemption_signal()):
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signal_name, self.signum = signal.Signals(signum).name, signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if launch.rank() == 0:  # a Ctrl-C during a long start-up is not left unanswered
                print(
                    "lmrepo: SIGINT: a checkpoint at the next step, then stop (Ctrl-C again stops at once)",
                    file=sys.stderr,
                    flush=True,
                )

    def hand_back(self) -> None:
        previous = self.previous.get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            if "wandb" in sys.modules:  # submitit's requeue ends the job's processes: W&B's service first
                sys.modules["wandb"].teardown()
            previous(self.signum, None)
