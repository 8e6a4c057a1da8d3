"""Training engines behind one interface (base.Engine): the loop, checkpointing and evaluation
never ask which one runs."""

from lmrepo.config import TrainConfig
from lmrepo.engines.base import Engine


def build_engine(config: TrainConfig, ds_config: dict) -> Engine:
    """The engine config.engine and config.pipeline ask for, each given the slices it reads.
    DeepSpeed's engines take the final DeepSpeed dict (a user's JSON included); FSDP2 and the
    torch pipeline are not DeepSpeed engines and take lmrepo's own settings, with the batch and
    the scheduler section from the same dict (one arithmetic for every engine)."""
    pipeline = config.pipeline
    if config.engine.name == "fsdp2":
        from lmrepo.ds_config import batch_of
        from lmrepo.engines import fsdp2

        return fsdp2.build(config, ds_config["scheduler"], batch_of(ds_config)[2])
    if pipeline.engine == "torch":
        from lmrepo.ds_config import batch_of, scheduler_section
        from lmrepo.engines import torch_pipeline

        return torch_pipeline.build(
            config.model,
            config.checkpointing,
            pipeline,
            config.optimizer,
            scheduler_section(config.schedule, config.optimizer.lr, config.trainer.max_steps),
            config.trainer.grad_clip,
            batch_of(ds_config)[2],
            config.precision.dtype == "bf16",
        )
    if pipeline.engine == "deepspeed":
        from lmrepo.engines import deepspeed_pipeline

        return deepspeed_pipeline.build(config.model, config.checkpointing, pipeline, ds_config)
    from lmrepo.engines import deepspeed

    return deepspeed.build(
        config.model,
        config.checkpointing,
        ds_config,
        compile=config.trainer.compile,
        compile_muon=compile_muon(config.optimizer.compile),
        loss_tiles=config.trainer.loss_tiles,
        expert_parallel_size=config.expert_parallel.size,
    )


def compile_muon(choice: bool | None) -> bool:
    """optimizer.compile: null compiles Muon's update on CUDA only, where its steps are many and
    its matrices large; on a CPU the first step's compile costs more than it saves."""
    if choice is not None:
        return choice
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"
