"""One training job: validate -> prepare data -> process group -> engine -> fit -> close."""

import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from transformers import set_seed

from lmrepo.config import TrainConfig, to_dict
from lmrepo.data.loader import Layout, LMData
from lmrepo.data.prepare import prepare_sources
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.distributed import launch
from lmrepo.engines import build_engine
from lmrepo.estimate import active_block_params, checkpointed_layers
from lmrepo.evaluation import Downstream
from lmrepo.evaluation.tasks import TaskSet
from lmrepo.observability.figures import read_metrics, run_figures
from lmrepo.observability.loggers import build_sinks
from lmrepo.observability.metrics import (
    device_name,
    executed_flops_per_token,
    flops_per_token,
    machine_name,
    peak_tflops,
)
from lmrepo.plan.ds_config import batch_of, continue_with_saved_adam
from lmrepo.plan.job import Plan
from lmrepo.plan.user_config import redact
from lmrepo.train import checkpoint
from lmrepo.train.hooks import Progress, Throughput, training_hooks
from lmrepo.train.loop import TrainState, fit
from lmrepo.train.nvme import use_per_run_swap
from lmrepo.train.rundir import (
    check_unused,
    own,
    refuse,
    remove_if_empty,
    truncate_metrics,
    write_config_files,
    write_status,
)
from lmrepo.train.stop import StopRequest
from lmrepo.train.watchdog import Watchdog
from lmrepo.utils import cpu_malloc
from lmrepo.utils.errors import ConfigError, TrainingError, exit_error


def prepare_job(job: Plan, run_dir: Path):
    """Everything else that can reject the planned job, before any process group starts: its
    tokenizer, data sources and the checkpoint to resume (or None). May add to job.notes."""
    config, ds_config = job.config, job.ds_config
    try:
        tokenizer = load_tokenizer(config.model.tokenizer, config.model.pretrained)
    except OSError as err:
        raise ConfigError(f"model.tokenizer={config.model.tokenizer}: {str(err).splitlines()[0][:200]}") from None
    config.model.check_vocab(len(tokenizer))
    if config.model.family == "bert" and tokenizer.mask_token_id is None:
        # transformers' masked-LM collator raised a ValueError in every rank's start instead
        raise ConfigError(
            f"model.tokenizer={config.model.tokenizer} has no mask token, which BERT's masked-LM "
            "training needs: choose model.tokenizer=bert (or a tokenizer with [MASK])"
        )
    resume = None
    if config.run.resume is None and (restarts := launch.slurm_restarts()):
        # Slurm requeued the job (its time limit, a pre-emption, a node that failed): the same
        # command again, which continues from the checkpoint its last attempt saved.
        config.run.resume = "auto"
        job.notes.append(f"Slurm restarted this job ({restarts} time(s)): it continues from its last checkpoint")
    check_unused(run_dir, resuming=config.run.resume is not None, owner=launch.rank() == 0)
    found = checkpoint.find(config.run.resume, run_dir / "checkpoints")
    if found:
        resume = checkpoint.inspect(*found, config.model, len(tokenizer), config.pipeline, config.engine.name)
        dp_size = job.layout.dp
        if resume.partitioned and resume.dp_size != dp_size and config.pipeline.engine:
            raise ConfigError(
                f"this pipeline checkpoint was saved with {resume.dp_size} data-parallel replica(s), this run "
                f"has {dp_size}: resume with {resume.dp_size * config.pipeline.stages} ranks (a universal "
                "checkpoint conversion is not supported for pipelines here)"
            )
        check_optimizer_layout(resume, ds_config, config.engine.name)
        saved_optimizer = (resume.config.get("optimizer") or {}).get("name", "adamw")
        if saved_optimizer != config.optimizer.name and {saved_optimizer, config.optimizer.name} != {"adam", "adamw"}:
            raise ConfigError(
                f"this checkpoint was saved with optimizer={saved_optimizer}, this run has "
                f"optimizer={config.optimizer.name}: their states differ; resume with optimizer={saved_optimizer}, "
                "or export it (scripts/export_hf.py RUN OUT) and start from model.pretrained=OUT"
            )
        saved_ep = (resume.config.get("expert_parallel") or {}).get("size", 1)
        # engine=fsdp2's checkpoints name each expert by its global index, and DCP reshards them
        if saved_ep != config.expert_parallel.size and config.engine.name != "fsdp2":
            raise ConfigError(
                f"this checkpoint was saved with expert_parallel.size={saved_ep}, this run has "
                f"expert_parallel.size={config.expert_parallel.size}: resume with expert_parallel.size={saved_ep} (its "
                "expert optimizer states are partitioned for that layout; re-cutting them is not supported)"
            )
        if config.model.family == "mixtral" and resume.partitioned and resume.dp_size != dp_size:
            raise ConfigError(
                f"this mixture-of-experts checkpoint was saved with {resume.dp_size} data-parallel rank(s), this run "
                f"has {dp_size}: resume with {resume.dp_size} ranks (DeepSpeed's universal checkpoint conversion does "
                "not re-cut expert partitions)"
            )
        resume = checkpoint.prepare_universal(resume, dp_size)
        job.notes += [line for line in [continue_with_saved_adam(ds_config, resume.ds_config)] if line]
        job.notes += [line for line in [schedule_change(resume.config, config, resume.step)] if line]
        job.notes += [line for line in [optimizer_change(resume.config, config)] if line]
    data_sources = prepare_sources(config.data, tokenizer)
    return tokenizer, data_sources, resume


def optimizer_layout(ds_config: dict) -> tuple[int, str]:
    """(ZeRO stage, precision) of a DeepSpeed config: what decides how its checkpoints keep the
    optimizer states."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    precision = next((p for p in ("bf16", "fp16") if (ds_config.get(p) or {}).get("enabled")), "fp32")
    return stage, precision


def check_optimizer_layout(resume: checkpoint.Resume, ds_config: dict, engine: str) -> None:
    """DeepSpeed keeps the optimizer states of each ZeRO stage and precision in its own layout:
    ZeRO-0's fp32 states in the model file, bf16's in files of their own, ZeRO-1's and ZeRO-2's in
    the same partitioned files (either loads the other's, bit for bit), ZeRO-3's with the
    parameters' partitions. Another pair failed deep in DeepSpeed (a missing file, a KeyError, an
    assertion)."""
    if engine != "deepspeed" or not resume.ds_config:
        return
    (saved_stage, saved_precision), (stage, precision) = optimizer_layout(resume.ds_config), optimizer_layout(ds_config)
    if saved_precision != precision or (saved_stage != stage and {saved_stage, stage} != {1, 2}):
        raise ConfigError(
            f"this checkpoint was saved at ZeRO stage {saved_stage} in {saved_precision}, this run is at stage "
            f"{stage} in {precision}, and DeepSpeed keeps the optimizer states of the two in other layouts: resume "
            f"with zero=stage{saved_stage} precision={saved_precision}, or export it (scripts/export_hf.py RUN OUT) "
            "and start from model.pretrained=OUT"
        )


def changed_keys(saved: dict, config: TrainConfig, keys: tuple[str, ...]) -> list[str]:
    """`key=now (was then)` for each of `keys` the checkpoint's config holds with another value."""
    now, then = OmegaConf.create(to_dict(config)), OmegaConf.create(saved)
    return [
        f"{key}={OmegaConf.select(now, key)} (was {OmegaConf.select(then, key)})"
        for key in keys
        if OmegaConf.select(then, key) not in (None, OmegaConf.select(now, key))
    ]


def schedule_change(saved: dict, config: TrainConfig, step: int) -> str | None:
    """A resume with another run length or schedule takes the learning rate of the new schedule
    from the checkpoint's step on (the old one's would not reach its end): said in one line."""
    keys = ("trainer.max_steps", "optimizer.lr", "schedule.name", "schedule.warmup_steps", "schedule.min_lr_ratio")
    changed = changed_keys(saved, config, keys)
    if not changed:
        return None
    return (
        f"lmrepo: note: resuming at step {step} with {', '.join(changed)}: the learning rate follows the new "
        "schedule from this step"
    )


def optimizer_change(saved: dict, config: TrainConfig) -> str | None:
    """A resume with other optimizer hyperparameters: the checkpoint's moments continue under this
    run's values (lmrepo.train.checkpoint.load sets them back after the load): said in one line."""
    keys = ("optimizer.weight_decay", "optimizer.betas", "optimizer.eps", "optimizer.momentum", "optimizer.ns_method")
    changed = changed_keys(saved, config, keys)
    if not changed:
        return None
    return f"lmrepo: note: resuming with {', '.join(changed)}: the checkpoint's optimizer moments continue under them"


def done_line(figures: dict, last: dict) -> str:
    """The run's figures as the tables show them (lmrepo.observability.figures), each named; then the last
    record's downstream task metrics (eval.tasks)."""
    parts = [f"loss {figures['loss']:.4g}" if figures["loss"] is not None else None]
    if figures["eval_loss"] is not None:
        parts.append(f"eval_loss {figures['eval_loss']:.4g}")
    if figures["tokens_per_s"] is not None:
        first, final = figures["steady_steps"]
        low, high = figures["tokens_per_s_min"], figures["tokens_per_s_max"]
        spread = f"windows {low:.0f}-{high:.0f}" if figures["windows"] > 1 else "one logging window"
        parts.append(f"tokens/s {figures['tokens_per_s']:.0f} steady over steps {first}-{final} ({spread})")
    if figures["tflops"] is not None:
        parts.append(f"TFLOP/s {figures['tflops']:.4g}")
    if figures["mfu"] is not None:
        parts.append(f"MFU {figures['mfu']:.2%}")
    if figures["mem_gb"] is not None:
        parts.append(f"peak mem_gb {figures['mem_gb']:.3g}")
    parts += [f"{k} {v:.4g}" for k, v in last.items() if k.startswith("eval/") and isinstance(v, float)]
    return ", ".join(p for p in parts if p)


def downstream_tasks(names: list[str]):
    """eval.tasks resolved and their data read before any process group starts (an unknown name
    or a hub task offline is refused here), or None."""
    if not names:
        return None
    tasks = TaskSet(names)
    tasks.load()
    return tasks


def agree_with_rank0(run_dir: Path, resume):
    """Every rank writes into rank 0's run directory and resumes rank 0's checkpoint: ranks on
    other nodes name their run directory from their own launcher's start time (or srun's), and a
    second late can make another name; the empty directory Hydra made there is removed."""
    chosen = [run_dir, resume]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0].resolve() != run_dir.resolve():
        remove_if_empty(run_dir)
    return chosen[0], chosen[1]


def throughput_of(config: TrainConfig, ds_config: dict, device) -> Throughput:
    shape = config.model.shape()
    args = (shape["n_layer"], shape["n_embd"], config.data.block_size, shape["vocab_size"])
    dtype = next((k for k in ("fp16", "bf16") if ds_config.get(k, {}).get("enabled")), "fp32")
    return Throughput(
        tokens_per_step=ds_config["train_batch_size"] * config.data.block_size,
        flops_per_token=executed_flops_per_token(
            *args, checkpointed_layers(shape["n_layer"], config.checkpointing), active_block_params(config.model)
        ),
        model_flops_per_token=flops_per_token(*args, recompute=False, block_params=active_block_params(config.model)),
        world_size=launch.world_size(),
        peak_tflops=peak_tflops(device_name(device.type), dtype, config.metrics.peak_tflops),
        device_type=device.type,
    )


def engine_data(config: TrainConfig, ds_config: dict, engine, sources, tokenizer) -> LMData:
    """The job's batches for this rank's data-parallel position in `engine`."""
    global_batch, micro_batch, _ = batch_of(ds_config)
    return LMData(
        sources,
        config.data.block_size,
        config.model.family,
        tokenizer,
        Layout(global_batch, micro_batch, engine.dp_rank, engine.dp_size),
        config.trainer.seed,
        config.trainer.eval_batches,
        config.data.cross_document_attention,
    )


@dataclass
class Started:
    """What the job has once it passed every check that needs no process group."""

    run_dir: Path
    tokenizer: object
    sources: list
    resume: object  # checkpoint.Resume, or None
    tasks: object  # the downstream TaskSet, or None
    run_lock: object  # rank 0's lock on the run directory, held until train() returns


def start(job: Plan, run_dir: Path, rank0: bool) -> Started:
    """Everything that can still refuse the job before its process group starts (one line and a
    non-zero exit, as train.py's own checks): the tokenizer, the data, the checkpoint to resume,
    the downstream tasks, the master port, the run directory's lock."""
    try:
        tokenizer, data_sources, resume = prepare_job(job, run_dir)
        tasks = downstream_tasks(job.config.eval.tasks)
        launch.refuse_a_taken_master_port()
        run_lock = own(run_dir) if rank0 else None  # held until train() returns (the OS frees it on any death)
    except ConfigError as err:
        refuse(str(err), run_dir)
    return Started(run_dir, tokenizer, data_sources, resume, tasks, run_lock)


def join(job: Plan, started: Started, rank0: bool) -> dict:
    """The process group, every rank on rank 0's run directory and checkpoint (verified), the seed,
    and rank 0's config files and notes. Returns the config as plain Python."""
    config, ds_config = job.config, job.ds_config
    if job.device.type == "cpu" and config.run.cpu_keep_freed_memory:
        cpu_malloc.keep_freed_memory()
    launch.init_distributed(config.run.hang_timeout_s)
    started.run_dir, started.resume = agree_with_rank0(started.run_dir, started.resume)
    if started.resume and started.resume.universal:
        ds_config["checkpoint"] = {"load_universal": True}
    if started.resume:
        try:
            checkpoint.verify(started.resume)  # the checksums, shared out over the ranks
        except ConfigError as err:
            refuse(str(err), None)
    use_per_run_swap(ds_config, started.run_dir.name)
    set_seed(config.trainer.seed)
    plain_config = to_dict(config)
    if rank0:
        write_config_files(started.run_dir, plain_config, ds_config)
        for line in job.notes:
            print(line, flush=True)
        if job.user_changed:
            print(f"lmrepo: deepspeed_config={config.deepspeed_config} sets {', '.join(job.user_changed)}", flush=True)
    return plain_config


@dataclass
class Finished:
    last: dict  # the last metrics line, with the evaluations after it
    stopped: str | None  # the signal that stopped training, or None
    step: int
    figures: dict | None  # rank 0's run figures (lmrepo.observability.figures)


def run_fit(job: Plan, started: Started, plain_config: dict, watchdog, requests: StopRequest, rank0: bool) -> Finished:
    """The engine, its data, the resumed state and the hooks; then the loop. The sinks are finished
    however it ends."""
    config, ds_config, run_dir = job.config, job.ds_config, started.run_dir
    sinks = None

    def saved(step: int, seconds: float, sync_s: float, size_gb: float) -> None:
        sinks.log({"step": step, "checkpoint_save_s": seconds, "checkpoint_sync_s": sync_s, "checkpoint_gb": size_gb})

    try:
        engine = build_engine(job)
        data = engine_data(config, ds_config, engine, started.sources, started.tokenizer)
        tasks = started.tasks
        downstream = Downstream(config.eval, tasks, engine, started.tokenizer, run_dir) if tasks else None
        loading = time.perf_counter()
        state = checkpoint.load(engine, started.resume) if started.resume else TrainState()
        load_seconds = time.perf_counter() - loading
        if rank0:
            if config.run.resume:  # a crashed run's lines past the checkpoint (all of them: none) are redone
                truncate_metrics(run_dir, state.step)
            if started.resume:
                print(f"lmrepo: resumed from {started.resume.directory / started.resume.tag} at step {state.step}")
            sinks = build_sinks(config.logger, run_dir, plain_config, redact(ds_config))
            if started.resume:
                sinks.log({"step": state.step, "checkpoint_load_s": load_seconds})
        fp16 = ds_config.get("fp16", {})
        checkpoints = checkpoint.Checkpointer(
            engine,
            run_dir / "checkpoints",
            plain_config,
            len(started.tokenizer),
            config.trainer.keep_last,
            on_saved=saved if rank0 else None,
        )
        progress = Progress(sinks, config.trainer.max_steps, state.step, enabled=rank0)
        hooks = training_hooks(
            progress,
            engine,
            data,
            config.trainer,
            throughput_of(config, ds_config, job.device),
            state,
            checkpoints,
            downstream,
            watchdog.beat,
            min_loss_scale=fp16.get("min_loss_scale", 1) if fp16.get("enabled") else None,
        )
        stopped = fit(engine, data, config.trainer, state, hooks, requests, watchdog.beat)
        # The figures a comparison cites, from metrics.jsonl as compare.py reads it
        # (lmrepo.observability.figures): the done line, status.json and the W&B summary say what the tables say.
        figures = run_figures(read_metrics(run_dir / "metrics.jsonl")) if rank0 else None
        if rank0:
            sinks.summarize(figures)
        return Finished(progress.last, stopped, state.step, figures)
    finally:
        if sinks is not None:
            sinks.finish()


def say_how_it_ended(run_dir: Path, started_at: float, finished: Finished, setting: dict) -> None:
    """status.json and the last line: a stop (and how to resume), or done (and the run's figures)."""
    last, figures, stopped = finished.last, finished.figures, finished.stopped
    if stopped:
        write_status(run_dir, "stopped", started_at, final=last, summary=figures, setting=setting, signal=stopped)
        print(
            f"lmrepo: {stopped} received: checkpoint saved at step {finished.step} in {run_dir / 'checkpoints'}. "
            f"Resume with the same command plus run.dir={run_dir} run.resume=auto",
            flush=True,
        )
    else:
        write_status(run_dir, "completed", started_at, final=last, summary=figures, setting=setting)
        print(
            f"lmrepo: done at step {last.get('step')}: {done_line(figures, last)}. Run directory: {run_dir}", flush=True
        )


def train(cfg: DictConfig, job: Plan, checkpoint_requests: StopRequest) -> dict:
    """The job `plan(cfg, ...)` planned (train.py plans it first, see lmrepo.plan.job).
    `checkpoint_requests` is the stop request train.py installed first thing: a signal during
    start-up still counts."""
    # status.json's wall_s covers the whole command: the interpreter's start, imports and planning too
    started_at = psutil.Process().create_time()
    rank0 = launch.rank() == 0
    started = start(job, Path(cfg.run.dir), rank0)
    try:
        plain_config = join(job, started, rank0)
    except TrainingError as err:  # the ranks did not meet: a verdict each rank reaches alone
        exit_error(str(err), 1, every_rank=True)
    run_dir = started.run_dir

    def hung(message: str) -> None:  # the watchdog's last word, from its thread, before the process exits
        write_status(run_dir, "failed", started_at, error=message, step=watchdog.step)

    watchdog = Watchdog(run_dir, dist.get_rank(), dist.get_world_size(), job.config.run.hang_timeout_s, hung)
    # What a comparison says about the run besides its config: the ranks and the machine.
    setting = {
        "ranks": dist.get_world_size(),
        "machine": machine_name(job.device.type),
        "device": job.device.description,
    }
    try:
        finished = run_fit(job, started, plain_config, watchdog, checkpoint_requests, rank0)
    except (ConfigError, TrainingError) as err:
        if rank0:
            write_status(run_dir, "failed", started_at, error=str(err))
        refuse(str(err), None, code=1)
    except BaseException as err:
        if (hang := watchdog.describe(err)) is not None:
            # Any rank that lost its peer can tell: the same verdict, written atomically.
            write_status(run_dir, "failed", started_at, error=hang, step=watchdog.step)
            watchdog.end_stopped_peers()
            refuse(hang, None, code=1)
        if rank0:
            write_status(run_dir, "failed", started_at, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        watchdog.stop()
    if rank0:
        say_how_it_ended(run_dir, started_at, finished, setting)
    dist.destroy_process_group()
    if started.run_lock is not None:
        started.run_lock.release()
    checkpoint_requests.hand_back()  # a scheduler's own handler (submitit requeues the job) now the checkpoint is saved
    return finished.last
