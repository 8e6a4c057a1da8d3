"""DeepSpeed's engine around a plain transformers model: ZeRO 0-3, offload, precision, AutoTP,
sequence parallelism (Ulysses)."""

import torch
from deepspeed.utils import set_z3_leaf_module
from transformers.integrations import HfDeepSpeedConfig

from lmrepo.config import TrainConfig
from lmrepo.distributed.device import isolate_compile_cache
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.distributed.sequence_parallel import ulysses
from lmrepo.distributed.tp import count_every_shard_in_the_norm
from lmrepo.engines.deepspeed_runtime import DeepSpeedEngine, initialize
from lmrepo.engines.recompute import enable_activation_checkpointing
from lmrepo.models import build_model, transformer_blocks
from lmrepo.optim.muon import compile_muon as compile_muon_choice


def fetch_blocks_whole(model: torch.nn.Module, ds_config: dict) -> None:
    """At ZeRO-3, DeepSpeed gathers and releases parameters from hooks on every module that holds
    some, and runs them in Python: 6 modules in each GPT-2 block (two norms, four linears). Marked as
    DeepSpeed leaf modules, the transformer blocks are fetched whole, from one pre-forward and one
    pre-backward hook each (FSDP2's unit, and the same all-gathered values): on a CPU, GPT-2 124M's
    depth at width 64 (`bench_throughput.py --host`) takes about 0.7x the time per step. Not where
    parameters are swapped from NVMe: its `offload.buffer_count` buffers hold that many parameters
    at once, fewer than a block has."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") != 3 or zero.get("offload_param", {}).get("device") == "nvme":
        return
    for block in transformer_blocks(model):
        set_z3_leaf_module(block, True)


def tensor_parallel_groups(layout: ParallelLayout):
    """AutoTP's process groups, made before deepspeed.initialize and handed to it as `mpu`:
    without them DeepSpeed checks train_batch_size against the whole world, counting each
    tensor-parallel rank as a data-parallel one. DeepSpeed's mesh puts the tensor-parallel ranks
    innermost (consecutive), as the layout does."""
    if layout.tp <= 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=layout.tp)
    return groups


def build(config: TrainConfig, layout: ParallelLayout, ds_config: dict) -> DeepSpeedEngine:
    zero3 = None
    if config.model.zero_init and ds_config.get("zero_optimization", {}).get("stage") == 3:
        # While this object lives, transformers builds (and loads) the model under
        # deepspeed.zero.Init: each rank materializes only its partition. Random init then
        # draws in another order, so the weights differ from a run of another stage.
        zero3 = HfDeepSpeedConfig(ds_config)
    tiles = config.trainer.loss_tiles
    own_loss = tiles > 1 or layout.sp > 1
    model = build_model(config.model, loss_tiles=tiles if own_loss else None, expert_parallel_size=layout.ep)
    enable_activation_checkpointing(model, config.checkpointing, ds_config)
    fetch_blocks_whole(model, ds_config)
    compile_muon = compile_muon_choice(config.optimizer.compile)
    if layout.sp > 1:
        slicer = ulysses(model, config, ds_config["train_micro_batch_size_per_gpu"])
        engine = DeepSpeedEngine(
            initialize(model, ds_config, mpu=slicer.mpu, compile_muon=compile_muon), layout, slicer
        )
    else:
        mpu = tensor_parallel_groups(layout)
        engine = DeepSpeedEngine(initialize(model, ds_config, mpu=mpu, compile_muon=compile_muon), layout)
        count_every_shard_in_the_norm(engine.ds)
    if config.trainer.compile:
        isolate_compile_cache()
        # in place: parameter names, hence checkpoints, are unchanged
        engine.ds.compile(backend=str(config.trainer.compile_backend))
    engine.zero3_hf_config = zero3  # keep alive for the engine's lifetime
    return engine
