"""DeepSpeed checkpoints under run.dir/checkpoints, with a `latest` pointer that only ever names
a checkpoint every rank has finished writing."""
import os
from pathlib import Path

import torch.distributed as dist

from lmrepo.errors import ConfigError


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def save(engine, checkpoint_dir: Path, step: int, client_state: dict) -> None:
    """On every rank. DeepSpeed's own `latest` is written by rank 0 while other ranks may still be
    writing; ours is written after a barrier, atomically (rename)."""
    tag = tag_for(step)
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": step, **client_state}, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = checkpoint_dir / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, checkpoint_dir / "latest")
    dist.barrier()


def find_resume_path(resume: str | None, checkpoint_dir: Path) -> tuple[Path, str] | None:
    """(directory, tag) to load, or None to start fresh. Checked before any process group starts."""
    if resume is None:
        return None
    if resume == "auto":
        latest = checkpoint_dir / "latest"
        return (checkpoint_dir, latest.read_text().strip()) if latest.is_file() else None
    path = Path(resume)
    if (path / "latest").is_file():
        return path, (path / "latest").read_text().strip()
    if path.is_dir() and any(path.glob("*model_states.pt")):
        return path.parent, path.name
    raise ConfigError(f"run.resume={resume} is neither a checkpoint directory nor one holding a `latest` file: "
                      "point it at run.dir/checkpoints or run.dir/checkpoints/<tag>")


def load(engine, directory: Path, tag: str) -> int:
    """Loads model, optimizer, scheduler and loss-scaler state; returns the step to continue from."""
    _, client_state = engine.load_checkpoint(str(directory), tag=tag)
    if client_state is None:
        raise ConfigError(f"could not load checkpoint {directory / tag}: check run.resume")
    return int(client_state["step"])
