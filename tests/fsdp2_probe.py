"""Launched by tests/test_fsdp2.py on 2 ranks (conftest.launcher): one FSDP2 training step of a tiny
GPT-2, then the bytes this rank holds in model states (its shards of the parameters, gradients and
AdamW's moments), written as JSON for the test to hold against lmrepo.estimate.fsdp2_state_bytes.
Usage: fsdp2_probe.py OUT_DIR [overrides...]"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import set_seed

from lmrepo.compose import compose_config
from lmrepo.data.loader import Layout, LMData
from lmrepo.ds_config import batch_of
from lmrepo.engines import build_engine
from lmrepo.launch import init_distributed, world_size
from lmrepo.plan import plan
from lmrepo.run import prepare_job


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def main(out: Path, overrides: list[str]) -> None:
    job = plan(compose_config(overrides, run_dir=out), world_size())
    tokenizer, sources, _ = prepare_job(job, out)
    config, ds = job.config, job.ds_config
    init_distributed()
    set_seed(config.trainer.seed)
    engine = build_engine(job)
    global_batch, micro_batch, _ = batch_of(ds)
    layout = Layout(global_batch, micro_batch, engine.dp_rank, engine.dp_size)
    data = LMData(sources, config.data.block_size, "gpt2", tokenizer, layout, config.trainer.seed, 1)
    engine.train_step(data.train_step(0))
    params = list(engine.module.parameters())
    held = {
        "parameters": sum(local_bytes(p) for p in params),
        # zero_grad(set_to_none) dropped them after the step: the gradients are the parameters' size
        "gradients": sum(local_bytes(p) for p in params),
        "optimizer": sum(
            local_bytes(v) for state in engine.optimizer.state.values() for v in state.values() if v.dim() > 0
        ),
        "model_parameters": sum(p.numel() for p in params),
    }
    (out / f"held_rank{dist.get_rank()}.json").write_text(json.dumps(held))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
