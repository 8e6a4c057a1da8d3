"""DeepSpeed checkpoints under run.dir/checkpoints that never lose work.

- `latest` only ever names a checkpoint every rank has finished writing (DeepSpeed's own
  pointer is written by rank 0 while other ranks may still be writing).
- Client state: the training position (step, samples consumed), the data-parallel size, the
  composed config; each rank also saves its RNG states. DeepSpeed itself saves model,
  optimizer, LR scheduler and loss scaler.
- A checkpoint is inspected before any process group starts: truncated files, another
  model's or another vocabulary's checkpoint stop with one line.
- Resuming on another data-parallel size goes through DeepSpeed's universal checkpoint
  (ds_to_universal, then `checkpoint.load_universal`), converted once, automatically.
"""
import os
import random
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from filelock import FileLock

from lmrepo.config import ModelConfig, PipelineConfig, from_dict
from lmrepo.engines.base import Engine
from lmrepo.errors import ConfigError
from lmrepo.loop import TrainState

# ZeRO-3 writes the model states (and our client state) per rank; the others once.
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def model_states_file(tag_dir: Path) -> Path | None:
    return next((tag_dir / name for name in MODEL_STATES if (tag_dir / name).is_file()), None)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# --- saving (every rank) -------------------------------------------------------------------

def save(engine: Engine, checkpoint_dir: Path, state: TrainState, config: dict, tokenizer_size: int,
         keep_last: int) -> None:
    tag = tag_for(state.step)
    client_state = {"step": state.step, "consumed": state.consumed, "dp_size": engine.dp_size,
                    "config": config, "tokenizer_size": tokenizer_size}
    engine.save(checkpoint_dir, tag, client_state)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, checkpoint_dir / tag / f"rng_rank{dist.get_rank():05d}.pt")
    dist.barrier()  # every rank's files are complete before `latest` may name them
    if dist.get_rank() == 0:
        tmp = checkpoint_dir / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, checkpoint_dir / "latest")  # atomic: a crash leaves the old pointer or the new
        prune(checkpoint_dir, keep_last, keep=tag)
    dist.barrier()


def size_gb(tag_dir: Path) -> float:
    return sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file()) / 2**30


def prune(checkpoint_dir: Path, keep_last: int, keep: str) -> None:
    """Deletes all but the newest `keep_last` checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    tags = sorted(p.name for p in checkpoint_dir.glob("step_*") if p.is_dir() and not p.name.endswith("_universal"))
    for old in tags[:-keep_last]:
        if old != keep:
            shutil.rmtree(checkpoint_dir / old, ignore_errors=True)
            shutil.rmtree(checkpoint_dir / f"{old}_universal", ignore_errors=True)


# --- finding and checking (before any process group) ---------------------------------------

@dataclass
class Resume:
    directory: Path
    tag: str
    step: int
    consumed: int
    dp_size: int
    partitioned: bool   # ZeRO (or bf16) optimizer state cut per data-parallel rank
    universal: bool = False


def find(resume: str | None, checkpoint_dir: Path) -> tuple[Path, str] | None:
    """(directory, tag) to load, or None to start fresh."""
    if resume is None:
        return None
    if resume == "auto":
        latest = checkpoint_dir / "latest"
        return (checkpoint_dir, latest.read_text().strip()) if latest.is_file() else None
    path = Path(resume)
    if (path / "checkpoints" / "latest").is_file():  # a run directory
        path = path / "checkpoints"
    if (path / "latest").is_file():
        return path, (path / "latest").read_text().strip()
    if model_states_file(path):
        return path.parent, path.name
    raise ConfigError(f"run.resume={resume} is not a checkpoint: point it at a run directory, its checkpoints/ "
                      "or a checkpoints/<tag> directory")


def check_files(tag_dir: Path) -> Path:
    """Returns the model-states file, after checking that no file is missing its end."""
    states = model_states_file(tag_dir)
    if states is None:
        raise ConfigError(f"checkpoint {tag_dir} has no model states file: it is incomplete; resume from another "
                          "(run.resume=PATH) or start fresh")
    for f in tag_dir.glob("*.pt"):
        # torch.save writes a zip archive; a truncated one has lost its central directory.
        if not zipfile.is_zipfile(f):
            raise ConfigError(f"checkpoint file {f} is truncated or corrupt: resume from another checkpoint (run.resume=PATH)")
    return states


def pipeline_layout(pipeline: PipelineConfig) -> dict:
    """What fixes which files a checkpoint has: the pipeline engine, its stages and the layer split.
    Schedules of one engine share the layout (gpipe <-> 1f1b_torch resume each other)."""
    return {"engine": pipeline.engine, "stages": pipeline.stages, "virtual_stages": pipeline.virtual_stages,
            "partition": pipeline.partition}


def inspect(directory: Path, tag: str, model_cfg: ModelConfig, tokenizer_size: int,
            pipeline_cfg: PipelineConfig | None = None) -> Resume:
    """Reads the checkpoint's client state and refuses one this run cannot continue."""
    tag_dir = directory / tag
    states_file = check_files(tag_dir)
    try:
        states = torch.load(states_file, map_location="cpu", weights_only=False)
    except Exception as err:  # unpickling errors of many kinds
        raise ConfigError(f"checkpoint {states_file} cannot be read ({type(err).__name__}): "
                          "resume from another checkpoint") from None
    if "consumed" not in states or "config" not in states:
        raise ConfigError(f"checkpoint {tag_dir} was not written by lmrepo (no training position): "
                          "point run.resume at an lmrepo checkpoint")
    saved = states["config"]["model"]
    shape_keys = ("family", "n_layer", "n_head", "n_embd", "vocab_size", "pretrained")
    differs = [k for k in shape_keys if saved.get(k) != getattr(model_cfg, k)]
    if differs:
        raise ConfigError(f"checkpoint {tag_dir} is of another model ({', '.join(f'model.{k}={saved.get(k)}' for k in differs)}): "
                          "resume with the same model settings or point run.resume elsewhere")
    saved_vocab = states.get("tokenizer_size")
    if saved_vocab is not None and saved_vocab != tokenizer_size:
        raise ConfigError(f"checkpoint {tag_dir} was trained with a {saved_vocab}-token vocabulary, this run's tokenizer "
                          f"has {tokenizer_size}: use the same model.tokenizer")
    saved_layout = pipeline_layout(from_dict(PipelineConfig, states["config"].get("pipeline") or {}))
    layout = pipeline_layout(pipeline_cfg or PipelineConfig())
    if pipeline_cfg is not None and saved_layout != layout:
        differs = ", ".join(f"pipeline.{k}={v}" for k, v in saved_layout.items() if layout[k] != v)
        raise ConfigError(f"checkpoint {tag_dir} was saved with another pipeline layout ({differs}): resume with the "
                          "same pipeline settings, or export it (scripts/export_hf.py) and start from model.pretrained")
    partitioned = any(tag_dir.glob("*zero_pp_rank_*"))
    return Resume(directory, tag, int(states["step"]), int(states["consumed"]), int(states["dp_size"]), partitioned)


def prepare_universal(resume: Resume, dp_size: int) -> Resume:
    """On another data-parallel size, ZeRO partitions must be re-cut: convert to DeepSpeed's
    universal format once (ranks wait on a lock), then load that."""
    if resume.dp_size == dp_size or not resume.partitioned:
        return resume
    source = resume.directory / resume.tag
    target = resume.directory / f"{resume.tag}_universal"
    with FileLock(str(target) + ".lock"):
        if not (target / "done").exists():
            shutil.rmtree(target, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                   "--input_folder", str(source), "--output_folder", str(target),
                                   "--inject_missing_state"], capture_output=True, text=True)
            if proc.returncode != 0:
                shutil.rmtree(target, ignore_errors=True)
                last_line = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise ConfigError(f"converting {source} for {dp_size} data-parallel ranks (it was saved on "
                                  f"{resume.dp_size}) failed: {last_line}")
            (target / "done").write_text("")
    return Resume(resume.directory, target.name, resume.step, resume.consumed, resume.dp_size, resume.partitioned,
                  universal=True)


# --- loading (every rank, after the engine is built) ---------------------------------------

def load(engine: Engine, resume: Resume) -> TrainState:
    engine.load(resume.directory, resume.tag)
    rng_file = resume.directory / resume.tag / f"rng_rank{dist.get_rank():05d}.pt"
    if not resume.universal and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return TrainState(step=resume.step, consumed=resume.consumed)
