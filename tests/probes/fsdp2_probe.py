"""Run by tests/test_fsdp2.py in one process (conftest.FORKED_PYTHON): for each world size, the
first and the last rank of an FSDP2 job built on torch's fake process group (the layout, mesh,
sharding and optimizer of that rank, real; every collective a no-op), one training step, then the
bytes that rank holds in model states (its shards of the parameters, gradients and AdamW's
moments), written as JSON for the test to hold against lmrepo.estimate.fsdp2_state_bytes. The
numbers a step computes from the no-op collectives mean nothing; the shapes are the job's.
Usage: fsdp2_probe.py OUT_DIR WORLD[,WORLD...] [overrides...]"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import set_seed

from lmrepo.data.loader import Layout, LMData
from lmrepo.distributed.device import detect_device
from lmrepo.engines import build_engine
from lmrepo.plan.compose import compose_config
from lmrepo.plan.ds_config import batch_of
from lmrepo.plan.job import plan
from lmrepo.run import prepare_job


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_by(out: Path, world: int, rank: int, overrides: list[str]) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        job = plan(compose_config(overrides, run_dir=out), world, detect_device("cpu"))
        tokenizer, sources, _ = prepare_job(job, out)
        config, ds = job.config, job.ds_config
        set_seed(config.trainer.seed)
        engine = build_engine(job)
        global_batch, micro_batch, _ = batch_of(ds)
        layout = Layout(global_batch, micro_batch, engine.dp_rank, engine.dp_size)
        data = LMData(sources, config.data.block_size, "gpt2", tokenizer, layout, config.trainer.seed, 1)
        engine.train_step(data.train_step(0))
        params = list(engine.module.parameters())
        return {
            "parameters": sum(local_bytes(p) for p in params),
            # zero_grad(set_to_none) dropped them after the step: the gradients are the parameters' size
            "gradients": sum(local_bytes(p) for p in params),
            "optimizer": sum(
                local_bytes(v) for state in engine.optimizer.state.values() for v in state.values() if v.dim() > 0
            ),
            "model_parameters": sum(p.numel() for p in params),
        }
    finally:
        dist.destroy_process_group()


def main(out: Path, worlds: list[int], overrides: list[str]) -> None:
    held = {
        f"{world}/{rank}": held_by(out, world, rank, overrides) for world in worlds for rank in sorted({0, world - 1})
    }
    (out / "held.json").write_text(json.dumps(held))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(w) for w in sys.argv[2].split(",")], sys.argv[3:])
