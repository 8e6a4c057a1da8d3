"""Training engines behind one interface (base.Engine), and what only engines share (DeepSpeed's
runtime wrapper, activation checkpointing, per-layer checkpoint files, pipeline timelines): the
loop, checkpointing and evaluation never ask which engine runs. Each engine module has one
`build(config, layout, ds_config)`: the loaded config, the job's parallel layout
(lmrepo.distributed.layout: every size and rank order) and the final DeepSpeed dict (DeepSpeed's
engines run on it; the torch engines take its batch and scheduler section, one arithmetic for every
engine)."""

from lmrepo.engines.base import Engine


def build_engine(job) -> Engine:
    """The engine a planned job (lmrepo.plan.job.Plan) asks for."""
    config = job.config
    if config.pipeline.engine == "torch":  # under engine=fsdp2 too: each stage fully_shard'ed
        from lmrepo.engines import torch_pipeline as module
    elif config.engine.name == "fsdp2":
        from lmrepo.engines import fsdp2 as module
    elif config.pipeline.engine == "deepspeed":
        from lmrepo.engines import deepspeed_pipeline as module
    else:
        from lmrepo.engines import deepspeed as module
    return module.build(config, job.layout, job.ds_config)
