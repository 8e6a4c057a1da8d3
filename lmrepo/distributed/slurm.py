"""What a sweep asks Slurm while its jobs run: their states, with or without the cluster's
accounting. Imported by the Slurm launcher only (it imports submitit)."""

import subprocess

from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob


class SlurmStates(SlurmInfoWatcher):
    """submitit's job-state watcher, asking squeue instead of sacct where the cluster keeps no
    accounting (`AccountingStorageType=accounting_storage/none`: sacct only prints that it is
    disabled). squeue lists a job until MinJobAge (300 s by default) after it ended, in its final
    state (COMPLETED, FAILED, CANCELLED, NODE_FAIL, TIMEOUT), which the sweep reads within seconds."""

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self.squeue = not has_accounting()

    def _make_command(self) -> list[str] | None:
        command = super()._make_command()
        if command is None or not self.squeue:
            return command
        return ["squeue", "--me", "--states=all", "--format=%i|%T|%N"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        if self.squeue:
            text = string.decode() if isinstance(string, bytes) else string
            string = "\n".join(["JobID|State|NodeList", *text.splitlines()[1:]])
        return super().read_info(string)


def has_accounting() -> bool:
    """Whether this cluster records jobs for sacct (`scontrol show config`); True when it cannot
    tell, which leaves submitit as it is."""
    try:
        shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return True
    return "accounting_storage/none" not in shown


def watch_states() -> None:
    """Every submitit Slurm job of this process reads its state through SlurmStates."""
    if not isinstance(SlurmJob.watcher, SlurmStates):
        SlurmJob.watcher = SlurmStates(delay_s=60)  # submitit asks every 600 s late in a job
