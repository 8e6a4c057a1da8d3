"""DeepSpeed checkpoints under run.dir/checkpoints that never lose work.

- `latest` only ever names a checkpoint every rank has finished writing (DeepSpeed's own
  pointer is written by rank 0 while other ranks may still be writing), and only once its
  files are on disk (fsync) with their sizes and checksums recorded in its `manifest.json`;
  older checkpoints are pruned only after that.
- Client state: the training position (step, samples consumed), the data-parallel size, the
  composed config; each rank also saves its RNG states (as tensors and numbers). DeepSpeed
  itself saves model, optimizer, LR scheduler and loss scaler.
- A checkpoint is inspected before any process group starts (missing or truncated files,
  another model's or another vocabulary's checkpoint) and its checksums verified before the
  engine loads it: each is one line. Every file is read weights-only (lmrepo.utils.safe_load).
- Resuming on another data-parallel size goes through DeepSpeed's universal checkpoint
  (ds_to_universal, then `checkpoint.load_universal`), converted once, automatically.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from filelock import FileLock

from lmrepo.config import ModelConfig, PipelineConfig, from_dict
from lmrepo.engines.base import Engine
from lmrepo.engines.layer_files import has_layer_optimizer_states
from lmrepo.train.loop import TrainState
from lmrepo.train.rundir import fsync_dir, write_durably
from lmrepo.utils import safe_load
from lmrepo.utils.errors import ConfigError, TrainingError, disk_error

# ZeRO-3 writes the model states (and our client state) per rank; the others once.
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def model_states_file(tag_dir: Path) -> Path | None:
    return next((tag_dir / name for name in MODEL_STATES if (tag_dir / name).is_file()), None)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# --- saving (every rank) -------------------------------------------------------------------

MANIFEST = "manifest.json"


def rng_state() -> dict:
    """This rank's RNG states as tensors and numbers: loadable weights-only."""
    version, keys, gauss = random.getstate()
    kind, state, pos, has_gauss, cached = np.random.get_state()
    rng = {
        "python": {"version": version, "state": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "state": torch.from_numpy(state.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def set_rng_state(rng: dict) -> None:
    python, numpy = rng["python"], rng["numpy"]
    if isinstance(python, tuple):  # written before lmrepo 0.2: the states as Python and numpy objects
        random.setstate(python)
        np.random.set_state(numpy)
    else:
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
        np.random.set_state(
            (
                numpy["kind"],
                numpy["state"].numpy().astype(np.uint32),
                numpy["pos"],
                numpy["has_gauss"],
                numpy["cached_gaussian"],
            )
        )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def file_record(path: Path) -> tuple[int, str]:
    """(size, checksum), the file forced to disk on the way: blake2b reads ~1 GB/s."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "blake2b").hexdigest()[:32]
        os.fsync(f.fileno())
    return path.stat().st_size, digest


def write_manifest(tag_dir: Path) -> int:
    """Every rank records (and syncs) its share of the files; rank 0 writes them all down. After
    this, a file that differs from its record in size or content is detected before loading.
    Returns the checkpoint's bytes, from the records (no rank lists the directory again while rank
    0 renames the manifest into it)."""
    files = sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {str(p.relative_to(tag_dir)): file_record(p) for p in files[rank::world]}
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        records = {name: record for share in shares for name, record in share.items()}
        write_durably(tag_dir / MANIFEST, json.dumps({"files": records}, indent=1, sort_keys=True))
        fsync_dir(tag_dir)
    return sum(size for share in shares for size, _ in share.values())


def save(engine: Engine, checkpoint_dir: Path, state: TrainState, config: dict, tokenizer_size: int) -> str:
    """Every rank starts its files of checkpoint step_N (an engine that writes in the background
    goes on after this returns); finish() completes and records them, and nothing names the
    checkpoint before that (promote). Returns the tag."""
    tag = tag_for(state.step)
    client_state = {
        "step": state.step,
        "consumed": state.consumed,
        "dp_size": engine.dp_size,
        "config": config,
        "tokenizer_size": tokenizer_size,
    }
    if dist.get_rank() == 0 and (checkpoint_dir / tag).exists():
        shutil.rmtree(checkpoint_dir / tag)  # a crashed run's unconfirmed save of this step: its files must not mix in
    dist.barrier()
    with failed_saves_removed(checkpoint_dir, tag):
        engine.save(checkpoint_dir, tag, client_state)
        torch.save(rng_state(), checkpoint_dir / tag / f"rng_rank{dist.get_rank():05d}.pt")
    return tag


def finish(engine: Engine, checkpoint_dir: Path, tag: str) -> tuple[float, int]:
    """Every rank's files of `tag` written, synced and recorded in its manifest. Returns the
    seconds the manifest took (fsync and checksums: the price of durability, logged as
    checkpoint_sync_s) and the checkpoint's bytes."""
    with failed_saves_removed(checkpoint_dir, tag):
        engine.finish_save()
        dist.barrier()  # every rank's files are complete before they are recorded and `latest` may name them
        synced = time.perf_counter()
        size = write_manifest(checkpoint_dir / tag)
        return time.perf_counter() - synced, size


@contextmanager
def failed_saves_removed(checkpoint_dir: Path, tag: str):
    """A save that fails for want of room or permission is one TrainingError, and its files go:
    never half a checkpoint; `latest` still names a whole one."""
    try:
        yield
    except Exception as err:
        if (reason := disk_error(err) or write_failure(err, checkpoint_dir)) is None:
            raise
        shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
        latest = checkpoint_dir / "latest"
        kept = f"{latest.read_text().strip()} is intact" if latest.is_file() else "there is no earlier checkpoint"
        raise TrainingError(
            f"saving checkpoint {checkpoint_dir / tag} failed: {reason}; {kept}: fix that, then resume "
            "with run.resume=auto"
        ) from None


def write_failure(err: BaseException, directory: Path) -> str | None:
    """torch.save reports a failed write (a full disk, a file-size limit, a quota, an I/O error) as
    a RuntimeError of its zip writer ("file write failed", "unexpected pos ..."), without the
    errno: ask the directory why writes fail there. None: not a failed write."""
    messages = []
    while err is not None and len(messages) < 8:
        messages.append(str(err))
        err = err.__cause__ or err.__context__
    zip_writer = any(s in m for m in messages for s in ("write failed", "unexpected pos", "inline_container"))
    free = shutil.disk_usage(directory).free
    if free < 2**26:
        return f"no space left on device ({free / 2**20:.0f} MiB free in {directory})"
    return why_writes_fail(directory) if zip_writer else None


# A probe as large as this finds a file-size limit or a quota a checkpoint file would meet.
PROBE_BYTES = 2**26


def why_writes_fail(directory: Path) -> str:
    """The reason a large write into `directory` fails: a file-size limit (`ulimit -f`), or the
    error a probe file meets (a quota, a read-only file system, an I/O error)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    reached = limit != resource.RLIM_INFINITY and any(
        p.is_file() and p.stat().st_size >= limit for p in directory.rglob("*")
    )
    if reached:  # the file that failed stopped at the limit
        return f"a file reached this process's file-size limit of {limit / 2**20:.1f} MiB (ulimit -f): raise it"
    probe = directory / f".lmrepo-write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            for _ in range(PROBE_BYTES // 2**20):
                f.write(bytes(2**20))
            os.fsync(f.fileno())
    except OSError as err:
        return f"{err.strerror.lower()} in {directory}"
    finally:
        probe.unlink(missing_ok=True)
    return f"a write into {directory} failed (torch's writer gave no reason)"


def promote(checkpoint_dir: Path, tag: str, keep_last: int) -> None:
    """`latest` names `tag` (the old pointer or the new one survives a crash), then older
    checkpoints beyond keep_last go: a pruned checkpoint is never one `latest` names."""
    if dist.get_rank() == 0:
        write_durably(checkpoint_dir / "latest", tag)
        prune(checkpoint_dir, keep_last, keep=tag)
    dist.barrier()


class Checkpointer:
    """A saved checkpoint is on probation until the loss of the next step (or the final
    evaluation) shows its weights are finite: only then does `latest` name it and pruning
    count it. A non-finite loss discards the checkpoint on probation instead, so NaN weights
    are never what `latest` names and never push a good checkpoint out."""

    def __init__(
        self, engine: Engine, checkpoint_dir: Path, config: dict, tokenizer_size: int, keep_last: int, on_saved=None
    ):
        self.engine, self.directory, self.config = engine, checkpoint_dir, config
        self.tokenizer_size, self.keep_last, self.on_saved = tokenizer_size, keep_last, on_saved
        self.pending: str | None = None  # the tag on probation
        self.unrecorded = False  # its files are still being written (an engine that saves in the background)
        self.step, self.blocked_s = 0, 0.0

    def save(self, state: TrainState) -> None:
        started = time.perf_counter()
        self.pending, self.step = save(self.engine, self.directory, state, self.config, self.tokenizer_size), state.step
        self.unrecorded, self.blocked_s = True, time.perf_counter() - started
        if not self.engine.background_save:
            self._record()

    def _record(self) -> None:
        """Waits for the files (training went on meanwhile), records them in the manifest, logs the
        save: checkpoint_save_s is the time the training loop waited for it."""
        if not self.unrecorded:
            return
        started = time.perf_counter()
        sync_s, size = finish(self.engine, self.directory, self.pending)
        self.unrecorded = False
        if self.on_saved is not None:
            self.on_saved(self.step, self.blocked_s + time.perf_counter() - started, sync_s, size / 2**30)

    def confirm(self) -> None:
        """The weights of the checkpoint on probation gave a finite loss."""
        if self.pending is not None:
            self._record()
            promote(self.directory, self.pending, self.keep_last)
            self.pending = None

    def abandon(self) -> None:
        """The checkpoint on probation holds weights that gave a non-finite loss."""
        if self.pending is not None:
            if self.unrecorded:
                self.engine.finish_save()  # its writer must stop writing before its files go
                self.unrecorded = False
            if dist.get_rank() == 0:
                shutil.rmtree(self.directory / self.pending, ignore_errors=True)
            self.pending = None


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
    partitioned: bool  # ZeRO (or bf16) optimizer state cut per data-parallel rank
    universal: bool = False
    ds_config: dict = field(default_factory=dict)  # the DeepSpeed dict it was written with (empty: a torch pipeline's)
    config: dict = field(default_factory=dict)  # the composed config of the run that wrote it


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
    raise ConfigError(
        f"run.resume={resume} is not a checkpoint: point it at a run directory, its checkpoints/ "
        "or a checkpoints/<tag> directory"
    )


def check_files(tag_dir: Path) -> Path:
    """Returns the model-states file, after checking that every file the manifest lists is there
    with its recorded size (checkpoints without a manifest, from before lmrepo 0.2: that no
    file is missing its end)."""
    states = model_states_file(tag_dir)
    if states is None:
        raise ConfigError(
            f"checkpoint {tag_dir} has no model states file: it is incomplete; resume from another "
            "(run.resume=PATH) or start fresh"
        )
    manifest = read_manifest(tag_dir)
    if manifest is None:
        for f in tag_dir.glob("*.pt"):
            # torch.save writes a zip archive; a truncated one has lost its central directory.
            if not zipfile.is_zipfile(f):
                raise ConfigError(
                    f"checkpoint file {f} is truncated or corrupt: resume from another checkpoint (run.resume=PATH)"
                )
        return states
    for name, (size, _) in manifest.items():
        path = tag_dir / name
        if not path.is_file():
            raise ConfigError(f"checkpoint file {path} is missing: resume from another checkpoint (run.resume=PATH)")
        if path.stat().st_size != size:
            raise ConfigError(
                f"checkpoint file {path} has {path.stat().st_size} bytes, {size} were saved: it is "
                "truncated or overwritten; resume from another checkpoint (run.resume=PATH)"
            )
    return states


def read_manifest(tag_dir: Path) -> dict | None:
    path = tag_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is corrupt: resume from another checkpoint (run.resume=PATH)") from None


def verify(resume: "Resume") -> None:
    """Every rank checks the checksums of its share of the checkpoint's files (after the process
    group exists, so the ranks share the work and reach one verdict): a file changed anywhere,
    not only at its end, is one line before the engine reads it."""
    tag_dir = resume.directory / resume.tag
    manifest = read_manifest(tag_dir) or {}
    names = sorted(manifest)
    bad = [
        name
        for name in names[dist.get_rank() :: dist.get_world_size()]
        if file_record(tag_dir / name)[1] != manifest[name][1]
    ]
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, bad)
    damaged = sorted(name for verdict in verdicts for name in verdict)
    if damaged:
        raise ConfigError(
            f"checkpoint file {tag_dir / damaged[0]} differs from what was saved (checksum): it is "
            "corrupt; resume from another checkpoint (run.resume=PATH)"
        )


def pipeline_layout(pipeline: PipelineConfig) -> dict:
    """What fixes which files a checkpoint has: the pipeline engine, its stages and the layer split.
    Schedules of one engine share the layout (gpipe <-> 1f1b_torch resume each other)."""
    return {
        "engine": pipeline.engine,
        "stages": pipeline.stages,
        "virtual_stages": pipeline.virtual_stages,
        "partition": pipeline.partition,
    }


# The model keys that change the weights' shapes: a checkpoint resumes only into the same ones.
SHAPE_KEYS = (
    "family",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "vocab_size",
    "n_inner",
    "n_kv_head",
    "tie_embeddings",
    "pretrained",
)


def inspect(
    directory: Path,
    tag: str,
    model_cfg: ModelConfig,
    tokenizer_size: int,
    pipeline_cfg: PipelineConfig | None = None,
    engine: str = "deepspeed",
) -> Resume:
    """Reads the checkpoint's client state and refuses one this run cannot continue."""
    tag_dir = directory / tag
    states = _client_states(tag_dir)
    _check_model(tag_dir, states, model_cfg, tokenizer_size)
    _check_layout(tag_dir, states, pipeline_cfg, engine)
    partitioned = any(tag_dir.glob("*zero_pp_rank_*"))
    return Resume(
        directory,
        tag,
        int(states["step"]),
        int(states["consumed"]),
        int(states["dp_size"]),
        partitioned,
        ds_config=states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {},
        config=states["config"],
    )


def _client_states(tag_dir: Path) -> dict:
    """The checkpoint's client state (weights-only), refused when it cannot be read or lmrepo did not write it."""
    states_file = check_files(tag_dir)
    try:
        states = safe_load.load(states_file)
    except ConfigError:
        raise
    except Exception as err:  # unpickling errors of many kinds
        raise ConfigError(
            f"checkpoint {states_file} cannot be read ({type(err).__name__}): resume from another checkpoint"
        ) from None
    if "consumed" not in states or "config" not in states:
        raise ConfigError(
            f"checkpoint {tag_dir} was not written by lmrepo (no training position): "
            "point run.resume at an lmrepo checkpoint"
        )
    return states


def _check_model(tag_dir: Path, states: dict, model_cfg: ModelConfig, tokenizer_size: int) -> None:
    """The same model shape (a mixture of experts' too) and vocabulary as the checkpoint's."""
    saved = states["config"]["model"]
    # A key the checkpoint's config does not have (older lmrepo) is the schema's default.
    saved_model = from_dict(ModelConfig, saved)
    differs = [f"{k}={saved.get(k)}" for k in SHAPE_KEYS if getattr(saved_model, k) != getattr(model_cfg, k)]
    # a mixture of experts' shape: how many experts, in which blocks
    differs += [
        f"moe.{k}={getattr(saved_model.moe, k)}"
        for k in ("experts", "every")
        if getattr(saved_model.moe, k) != getattr(model_cfg.moe, k)
    ]
    if differs:
        raise ConfigError(
            f"checkpoint {tag_dir} is of another model ({', '.join(f'model.{k}' for k in differs)}): "
            "resume with the same model settings or point run.resume elsewhere"
        )
    saved_vocab = states.get("tokenizer_size")
    if saved_vocab is not None and saved_vocab != tokenizer_size:
        raise ConfigError(
            f"checkpoint {tag_dir} was trained with a {saved_vocab}-token vocabulary, this run's tokenizer "
            f"has {tokenizer_size}: use the same model.tokenizer"
        )


def _check_layout(tag_dir: Path, states: dict, pipeline_cfg: PipelineConfig | None, engine: str) -> None:
    """A pipeline layout and an engine this run can load the checkpoint's files into."""
    saved_layout = pipeline_layout(from_dict(PipelineConfig, states["config"].get("pipeline") or {}))
    layout = pipeline_layout(pipeline_cfg or PipelineConfig())
    if saved_layout["engine"] == "torch" and not has_layer_optimizer_states(tag_dir):
        raise ConfigError(
            f"checkpoint {tag_dir} holds a torch pipeline's optimizer states per rank, as an older lmrepo wrote "
            "them: resume it with that version, or export it (scripts/export_hf.py RUN OUT) and start from "
            "model.pretrained=OUT"
        )
    # A torch pipeline's layer files (the same under either engine) load into any split, and into
    # engine=fsdp2 without a pipeline.
    any_layout = saved_layout["engine"] == "torch" and (layout["engine"] == "torch" or engine == "fsdp2")
    if pipeline_cfg is not None and saved_layout != layout and not any_layout:
        differs = ", ".join(f"pipeline.{k}={v}" for k, v in saved_layout.items() if layout[k] != v)
        raise ConfigError(
            f"checkpoint {tag_dir} was saved with another pipeline layout ({differs}): resume with the "
            "same pipeline settings, or export it (scripts/export_hf.py) and start from model.pretrained"
        )
    saved_engine = (states["config"].get("engine") or {}).get("name", "deepspeed")
    if saved_engine != engine and not any_layout:
        raise ConfigError(
            f"checkpoint {tag_dir} was written by engine={saved_engine}, this run is engine={engine}: resume with "
            f"engine={saved_engine}, or export it (scripts/export_hf.py RUN OUT) and start from model.pretrained=OUT"
        )


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
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "lmrepo.utils.safe_load",
                    "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder",
                    str(source),
                    "--output_folder",
                    str(target),
                    "--inject_missing_state",
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                shutil.rmtree(target, ignore_errors=True)
                last_line = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise ConfigError(
                    f"converting {source} for {dp_size} data-parallel ranks (it was saved on "
                    f"{resume.dp_size}) failed: {last_line}"
                )
            (target / "done").write_text("")
    return replace(resume, tag=target.name, universal=True)


# --- loading (every rank, after the engine is built) ---------------------------------------

# RNG files written before lmrepo 0.2 hold numpy's state as an array: these rebuild it, nothing else.
NUMPY_STATE_GLOBALS = (np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType)


# The hyperparameters of a parameter group that lmrepo's optimizer keys (or a user's DeepSpeed
# JSON) set, which a resume takes from this run. The rest stays as loaded: the learning rate (the
# schedule, restored with it, sets it each step) and what an optimizer counts in its groups
# (DeepSpeed's FusedAdam keeps Adam's step there).
THIS_RUNS = ("weight_decay", "betas", "eps", "momentum", "ns_method")


def load(engine: Engine, resume: Resume) -> TrainState:
    """torch's and DeepSpeed's optimizers load their parameter groups' hyperparameters with the
    moments: a resume with optimizer.weight_decay, betas or eps changed trained on with the
    checkpoint's values while the run's config recorded the new ones. They are set back to this
    run's after the load (run.py's note names what changed)."""
    ours = [{k: group[k] for k in THIS_RUNS if k in group} for group in engine.optimizer_groups()]
    with safe_load.weights_only_loads(resume.directory / resume.tag):
        engine.load(resume.directory, resume.tag)
    for group, settings in zip(engine.optimizer_groups(), ours, strict=True):
        group.update(settings)
    rng_file = resume.directory / resume.tag / f"rng_rank{dist.get_rank():05d}.pt"
    if not resume.universal and rng_file.is_file():
        set_rng_state(safe_load.load(rng_file, extra_globals=NUMPY_STATE_GLOBALS))
    return TrainState(step=resume.step, consumed=resume.consumed)
