"""No hang: when a rank dies or stalls, every rank ends within a bounded time, and status.json
says which rank stopped at which step.

Two layers. Every collective has a timeout (`run.hang_timeout_s`, given to the process group and,
through torch's default, to every group DeepSpeed creates later), so a rank waiting for a dead or
stopped peer raises instead of waiting forever. Each rank also writes a heartbeat (its step, the
time) under run.dir/.heartbeat/ at every step: the rank that reports the failure names the peer
that stopped beating. A watchdog thread is the backstop for what no timeout covers (DeepSpeed's
CPU shared-memory all-reduce spins without one): a rank whose own loop makes no progress for
twice the timeout records the hang and exits.
"""

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

HEARTBEATS = ".heartbeat"


# Where a rank runs, as its cluster names it: Slurm's node name (which need not be a host name),
# else the host name.
NODE = os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world: int, timeout_s: float, on_hang):
        self.directory, self.rank, self.world, self.timeout_s = run_dir / HEARTBEATS, rank, world, timeout_s
        self.on_hang = on_hang  # called with the message, from the watchdog thread, before the process exits
        self.step, self.last = 0, time.monotonic()
        self.stopped_peers: set[int] = set()  # pids of peers on this machine found stopped by job control
        self.directory.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="lmrepo-watchdog", daemon=True).start()

    def beat(self, step: int) -> None:
        """Progress: this rank is at `step` now."""
        self.step, self.last = step, time.monotonic()
        path = self.directory / f"rank{self.rank:05d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "step": step,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "node": NODE,
                }
            )
        )
        os.replace(tmp, path)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(10.0, self.timeout_s / 4)):
            if time.monotonic() - self.last > 2 * self.timeout_s:
                self.on_hang(
                    f"rank {self.rank} made no progress for {2 * self.timeout_s:.0f} s after step "
                    f"{self.step} ({self.laggards() or 'no peer behind it'}; run.hang_timeout_s="
                    f"{self.timeout_s:g})"
                )
                self.end_stopped_peers()
                os._exit(1)

    def laggards(self) -> str:
        """The ranks that stopped: on this machine, a peer process that is gone or stopped
        (SIGSTOP, a debugger); elsewhere, a heartbeat behind the others'."""
        beats = {}
        for rank in range(self.world):
            try:
                beats[rank] = json.loads((self.directory / f"rank{rank:05d}.json").read_text())
            except (OSError, ValueError):
                beats[rank] = None
        newest = max((b["step"] for b in beats.values() if b), default=0)
        found, now = [], time.time()
        for rank, beat in beats.items():
            if rank == self.rank:
                continue
            if beat is None:
                found.append(f"rank {rank} never reported")
            elif beat["host"] == socket.gethostname() and (state := process_state(beat["pid"])) in ("gone", "stopped"):
                if state == "stopped" and job_control_stopped(beat["pid"]):
                    self.stopped_peers.add(beat["pid"])
                found.append(
                    f"rank {rank} (pid {beat['pid']} on {beat.get('node')}) is {state}, at step {beat['step']}"
                )
            elif beat["step"] < newest:
                ago = now - beat["time"]
                found.append(f"rank {rank} on {beat.get('node')} is behind, at step {beat['step']} {ago:.0f} s ago")
        return ", ".join(found)

    def describe(self, err: BaseException) -> str | None:
        """A collective that timed out or lost a peer, as one line naming the rank behind it."""
        text = str(err)
        if not any(sign in text for sign in ("Timed out", "Connection reset", "Connection closed", "timeout")):
            return None
        died = not ("imed out" in text or "timeout" in text)
        found = self.laggards()
        # A peer's sockets close while the kernel tears its process down, before /proc shows it
        # gone: a lost connection gives the dead rank a few seconds to show as gone
        deadline = time.monotonic() + 5
        while died and not found and time.monotonic() < deadline:
            time.sleep(0.2)
            found = self.laggards()
        cause = "a peer rank died" if died else "a collective timed out"
        return (
            f"{cause} after step {self.step}: {found or 'every rank reached the same step'} "
            f"(run.hang_timeout_s={self.timeout_s:g})"
        )

    def end_stopped_peers(self) -> None:
        """Kills the peers found stopped by job control (SIGSTOP, Ctrl-Z) once this rank has ended
        the run for them. A stopped process takes no signal but SIGKILL: the launcher's SIGTERM
        would sit until its grace period ran out (30 s under deepspeed and torchrun) before the
        job could end. A peer stopped by a debugger is left to its debugger and the launcher."""
        for pid in self.stopped_peers:
            if pid != os.getpid() and job_control_stopped(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # gone meanwhile, or not ours to end
                    pass


def job_control_stopped(pid: int) -> bool:
    """Stopped by SIGSTOP or Ctrl-Z (state T), not traced by a debugger (t)."""
    return state_letter(pid) == "T"


def state_letter(pid: int) -> str | None:
    """The process's state in /proc (Linux): R, S, T (stopped), t (traced), Z, ...; None once gone."""
    try:  # the field after the command's name, which may hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str:
    """gone | stopped | running, from /proc (Linux)."""
    return {None: "gone", "Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state_letter(pid), "running")
