"""The process group and the DeepSpeed engine around a plain transformers model (or its pipeline layers)."""
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from transformers.integrations import HfDeepSpeedConfig

from lmrepo.launch import ensure_single_process_env
from lmrepo.models import build_model, pipe


def init_distributed() -> None:
    ensure_single_process_env()
    # gloo on CPU (ccl when oneCCL is installed), NCCL on CUDA: the accelerator knows.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def release_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (shm comm op) leaves its per-rank buffer in /dev/shm, named
    after the master address and port, when the process exits: a machine that runs many jobs
    fills its shared memory (seen here: 15 GB, then the OOM killer). Each rank unlinks its own;
    the mapping stays valid until the process exits."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{os.environ.get('RANK')}")
    Path("/dev/shm", name).unlink(missing_ok=True)


def data_parallel(engine) -> tuple[int, int]:
    """(rank, size) of this process in its data-parallel group: the ranks that read different
    samples. Without pipeline or tensor parallelism that is every rank."""
    grid = getattr(engine, "grid", None)  # a PipelineEngine's process topology
    if grid is not None:
        return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    if getattr(engine, "autotp_size", lambda: 0)() > 1:  # AutoTP: one tensor-parallel group reads the same samples
        return engine.mpu.get_data_parallel_rank(), engine.mpu.get_data_parallel_world_size()
    return dist.get_rank(), dist.get_world_size()


def tensor_parallel_groups(ds_config: dict):
    """AutoTP's process groups, made before deepspeed.initialize and handed to it as `mpu`:
    without them DeepSpeed checks train_batch_size against the whole world, counting each
    tensor-parallel rank as a data-parallel one."""
    size = ds_config.get("tensor_parallel", {}).get("autotp_size", 0)
    if size <= 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=size)
    return groups


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights), not on biases and norms (as nanoGPT)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            # Under ZeRO-3's zero.Init a parameter is an empty placeholder; ds_shape is its real shape.
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def enable_activation_checkpointing(model, checkpointing, ds_config: dict) -> None:
    if not checkpointing.enabled:
        return
    model.activation_checkpointing_enable(every_n_layers=checkpointing.every_n_layers)
    if checkpointing.impl == "deepspeed":
        # transformers' checkpointed layers call `_gradient_checkpointing_func`; DeepSpeed's
        # version adds the ZeRO-R options of the `activation_checkpointing` section.
        # As keywords: configure(deepspeed_config=...) re-checks the batch keys against the
        # whole world, which a pipeline's data-parallel batch does not satisfy.
        section = ds_config.get("activation_checkpointing", {})
        deepspeed.checkpointing.configure(
            None, partition_activations=section.get("partition_activations"),
            contiguous_checkpointing=section.get("contiguous_memory_optimization"),
            num_checkpoints=section.get("number_checkpoints"), checkpoint_in_cpu=section.get("cpu_checkpointing"),
            synchronize=section.get("synchronize_checkpoint_boundary"))
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint


def count_every_stage_in_clip_norm(module: PipelineModule) -> None:
    """DeepSpeed's fp32 ZeRO-0 gradient clipping (deepspeed.runtime.utils.clip_grad_norm_) counts a
    gradient when `mpu.get_model_parallel_rank() == 0` or the parameter is marked model-parallel;
    a pipeline's grid answers that rank with the stage index, so only the first stage's gradients
    made the norm (measured: clip coefficient 0.651 where the whole model's norm gives 0.518).
    Marking each stage's own parameters counts them all once; the tied copies DeepSpeed marks
    `ds_pipe_replicated` stay unmarked, so only the first stage counts them. Every other
    DeepSpeed use of the mark tests the tensor-parallel rank, which is 0 here: no other effect."""
    for param in module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True


def build_pipeline_engine(model_cfg, checkpointing, pipeline, ds_config: dict):
    """GPT-2 / BERT split into pipeline layers (lmrepo.models.pipe). The whole transformers
    model is built on every rank first (the same seeded weights as a non-pipelined run); each
    rank then keeps only its stage's layers."""
    net = build_model(model_cfg)
    enable_activation_checkpointing(net, checkpointing, ds_config)  # the blocks checkpoint themselves
    layers, loss = pipe.pipeline_layers(net, model_cfg.family), pipe.LMLoss(model_cfg.family, net.config.vocab_size)
    if pipeline.engine == "torch":
        from lmrepo.pipelining import build_torch_pipeline

        return build_torch_pipeline(layers, loss, pipeline, ds_config)
    module = PipelineModule(layers=layers, num_stages=pipeline.stages, loss_fn=loss,
                            partition_method=pipeline.partition)  # type:GPT2Block also matches GPT2BlockPipe
    count_every_stage_in_clip_norm(module)
    weight_decay = ds_config["optimizer"]["params"].get("weight_decay", 0.0)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=param_groups(module, weight_decay), config=ds_config)
    return engine


def build_engine(model_cfg, checkpointing, ds_config: dict, compile: bool = False, pipeline=None):
    if pipeline is not None and pipeline.schedule != "none":
        return build_pipeline_engine(model_cfg, checkpointing, pipeline, ds_config)
    zero3 = None
    if model_cfg.zero_init and ds_config.get("zero_optimization", {}).get("stage") == 3:
        # While this object lives, transformers builds (and loads) the model under
        # deepspeed.zero.Init: each rank materializes only its partition. Random init then
        # draws in another order, so the weights differ from a run of another stage.
        zero3 = HfDeepSpeedConfig(ds_config)
    model = build_model(model_cfg)
    enable_activation_checkpointing(model, checkpointing, ds_config)
    weight_decay = ds_config["optimizer"]["params"].get("weight_decay", 0.0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay), config=ds_config,
                                      mpu=tensor_parallel_groups(ds_config))
    if compile:
        engine.compile()  # in place: parameter names, hence checkpoints, are unchanged
    engine.zero3_hf_config = zero3  # keep alive for the engine's lifetime
    return engine
