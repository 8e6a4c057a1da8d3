"""Training engines behind one interface (base.Engine): the loop, checkpointing and evaluation
never ask which one runs."""

from lmrepo.config import TrainConfig
from lmrepo.engines.base import Engine


def build_engine(config: TrainConfig, ds_config: dict) -> Engine:
    """The engine config.pipeline asks for, each given the slices it reads. DeepSpeed's engines
    take the final DeepSpeed dict (a user's JSON included); the torch pipeline is not a
    DeepSpeed engine and takes lmrepo's own settings."""
    pipeline = config.pipeline
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

    return deepspeed.build(config.model, config.checkpointing, ds_config, compile=config.trainer.compile)
