"""One training job: validate -> prepare data -> process group -> engine -> fit -> close."""
import atexit
import sys
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from transformers import set_seed

from lmrepo import checkpoint, launch
from lmrepo.config import check_vocab, detect_device, model_shape, validate
from lmrepo.data.loader import Layout, LMData
from lmrepo.data.prepare import prepare_sources
from lmrepo.engine import build_engine, data_parallel, init_distributed, release_shm_buffer
from lmrepo.errors import ConfigError, TrainingError
from lmrepo.loggers import build_sinks
from lmrepo.loop import StopRequest, Throughput, TrainState, fit
from lmrepo.estimate import checkpointed_layers
from lmrepo.metrics import device_name, executed_flops_per_token, flops_per_token, peak_tflops
from lmrepo.rundir import remove_if_empty, truncate_metrics, write_config_files, write_status
from lmrepo.tokenizer import load_tokenizer


def fail(message: str, run_dir: Path | None, code: int = 2):
    if launch.rank() == 0:
        print(f"lmrepo: error: {message}", file=sys.stderr, flush=True)
    if run_dir is not None:
        remove_if_empty(run_dir)
    raise SystemExit(code)


def prepare_job(cfg: DictConfig, run_dir: Path):
    """Everything that can reject the job, before any process group starts."""
    device = detect_device(cfg.trainer.device)
    world = launch.world_size()
    ds_config, user_changed = validate(cfg, world, device)
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.pretrained)
    except OSError as err:
        raise ConfigError(f"model.tokenizer={cfg.model.tokenizer}: {str(err).splitlines()[0][:200]}") from None
    check_vocab(cfg.model, len(tokenizer))
    resume = None
    found = checkpoint.find(cfg.run.resume, run_dir / "checkpoints")
    if found:
        resume = checkpoint.inspect(*found, cfg.model, len(tokenizer), cfg.pipeline)
        dp_size = ds_config["train_batch_size"] // (ds_config["train_micro_batch_size_per_gpu"]
                                                     * ds_config["gradient_accumulation_steps"])
        if resume.partitioned and resume.dp_size != dp_size and cfg.pipeline.schedule != "none":
            raise ConfigError(f"this pipeline checkpoint was saved with {resume.dp_size} data-parallel replica(s), this run "
                              f"has {dp_size}: resume with {resume.dp_size * cfg.pipeline.stages} ranks (a universal "
                              "checkpoint conversion is not supported for pipelines here)")
        resume = checkpoint.prepare_universal(resume, dp_size)
        if resume.universal:
            ds_config["checkpoint"] = {"load_universal": True}
    data_sources = prepare_sources(cfg.data, tokenizer)
    return device, ds_config, user_changed, tokenizer, data_sources, resume


def throughput_of(cfg: DictConfig, ds_config: dict, device) -> Throughput:
    shape = model_shape(cfg.model)
    args = (shape["n_layer"], shape["n_embd"], cfg.data.block_size, shape["vocab_size"])
    dtype = next((k for k in ("fp16", "bf16") if ds_config.get(k, {}).get("enabled")), "fp32")
    return Throughput(
        tokens_per_step=ds_config["train_batch_size"] * cfg.data.block_size,
        flops_per_token=executed_flops_per_token(*args, checkpointed_layers(shape["n_layer"], cfg.checkpointing)),
        model_flops_per_token=flops_per_token(*args, recompute=False), world_size=launch.world_size(),
        peak_tflops=peak_tflops(device_name(device.type), dtype, cfg.metrics.peak_tflops), device_type=device.type)


def train(cfg: DictConfig) -> dict:
    started = time.time()  # status.json's wall_s covers start-up too
    launch.adopt_slurm_env()
    run_dir = Path(cfg.run.dir)
    rank0 = launch.rank() == 0
    try:
        device, ds_config, user_changed, tokenizer, data_sources, resume = prepare_job(cfg, run_dir)
    except ConfigError as err:
        fail(str(err), run_dir)

    checkpoint_requests = StopRequest()  # before the process group: a signal during start-up still counts
    init_distributed()
    atexit.register(release_shm_buffer)  # also after a failure; only kill -9 escapes it
    set_seed(cfg.trainer.seed)
    if rank0:
        write_config_files(run_dir, cfg, ds_config)
        if user_changed:
            print(f"lmrepo: deepspeed_config={cfg.deepspeed_config} sets {', '.join(user_changed)}", flush=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    checkpoint_dir = run_dir / "checkpoints"

    def save(state: TrainState) -> None:
        saving = time.perf_counter()
        checkpoint.save(engine, checkpoint_dir, state, config, len(tokenizer), cfg.trainer.keep_last)
        if rank0:
            sinks.log({"step": state.step, "checkpoint_save_s": time.perf_counter() - saving,
                       "checkpoint_gb": checkpoint.size_gb(checkpoint_dir / checkpoint.tag_for(state.step))})

    sinks = None
    try:
        engine = build_engine(cfg.model, cfg.checkpointing, ds_config, compile=cfg.trainer.compile,
                              pipeline=cfg.pipeline)
        dp_rank, dp_size = data_parallel(engine)
        layout = Layout(global_batch=ds_config["train_batch_size"],
                        micro_batch=ds_config["train_micro_batch_size_per_gpu"], dp_rank=dp_rank, dp_size=dp_size)
        data = LMData(data_sources, cfg.data.block_size, cfg.model.family, tokenizer, layout, cfg.trainer.seed,
                      cfg.trainer.eval_batches)
        loading = time.perf_counter()
        state = checkpoint.load(engine, resume) if resume else TrainState()
        load_seconds = time.perf_counter() - loading
        if rank0:
            if resume:
                truncate_metrics(run_dir, state.step)  # a crashed run's lines past the checkpoint are redone
                print(f"lmrepo: resumed from {resume.directory / resume.tag} at step {state.step}", flush=True)
            sinks = build_sinks(cfg.logger, run_dir, config, ds_config)
            if resume:
                sinks.log({"step": state.step, "checkpoint_load_s": load_seconds})
        fp16 = ds_config.get("fp16", {})
        last, stopped = fit(engine, data, cfg.trainer, throughput_of(cfg, ds_config, device), sinks, state, save,
                            checkpoint_requests, rank0,
                            min_loss_scale=fp16.get("min_loss_scale", 1) if fp16.get("enabled") else None)
    except (ConfigError, TrainingError) as err:
        if rank0:
            write_status(run_dir, "failed", started, error=str(err))
        fail(str(err), None, code=1)
    except BaseException as err:
        if rank0:
            write_status(run_dir, "failed", started, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if sinks is not None:
            sinks.finish()
    if rank0:
        summary = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if isinstance(v, float) and k != "time")
        if stopped:
            write_status(run_dir, "stopped", started, final=last, signal=stopped)
            print(f"lmrepo: {stopped} received: checkpoint saved at step {state.step} in {checkpoint_dir}. "
                  f"Resume with the same command plus run.dir={run_dir} run.resume=auto", flush=True)
        else:
            write_status(run_dir, "completed", started, final=last)
            print(f"lmrepo: done at step {last.get('step')}: {summary}. Run directory: {run_dir}", flush=True)
    dist.destroy_process_group()
    return last
