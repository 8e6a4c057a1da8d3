"""Launched by tests/test_ds_pipeline.py under `deepspeed --num_gpus 2`: one DeepSpeed pipeline
step (fp32, ZeRO-0) of tiny GPT-2 on 2 stages, recording on each stage the tied embedding's
gradient after DeepSpeed all-reduced it and the factor gradient clipping scaled it by, and
(rank 0) the same step on the whole transformers model. Usage: pipeline_probe.py OUT_DIR [overrides...]"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import set_seed

from lmrepo.distributed.launch import init_distributed, prepare_argv
from lmrepo.engines.base import pipeline_inputs
from lmrepo.models import build_model
from probe_job import start_job


def main(out: Path, overrides: list[str]) -> None:
    init_distributed()
    job, lmrepo_engine, data = start_job(overrides, out)
    cfg = job.config
    batches = data.train_step(0)

    engine = lmrepo_engine.ds  # DeepSpeed's PipelineEngine
    module, recorded = engine.module, {}
    take_model_step = engine._take_model_step

    tied = module.tied_modules["embed"].wte.weight
    optimizer_step = engine.optimizer.step

    def record_then_step(*args, **kwargs):
        # After the tied gradients are all-reduced, before clipping and the optimizer step.
        recorded["grad"] = tied.grad.detach().clone()
        take_model_step(*args, **kwargs)

    def record_clip_then_step(*args, **kwargs):
        # After clipping: the factor DeepSpeed scaled the gradients by.
        recorded["clip_coef"] = (tied.grad.norm() / recorded["grad"].norm()).item()
        return optimizer_step(*args, **kwargs)

    engine._take_model_step = record_then_step
    engine.optimizer.step = record_clip_then_step
    engine.train_batch(pipeline_inputs(batches))
    rank = dist.get_rank()
    torch.save(
        {"grad": recorded["grad"], "weight": tied.detach().clone(), "clip_coef": recorded["clip_coef"]},
        out / f"tied_rank{rank}.pt",
    )

    if rank == 0:
        # The same step on the whole model: DeepSpeed's pipeline divides each micro batch's loss
        # by the number of micro batches, as gradient accumulation does.
        set_seed(cfg.trainer.seed)
        net = build_model(cfg.model)
        for batch in batches:
            (net(**batch).loss / len(batches)).backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None])
        clip_coef = min(1.0, cfg.trainer.grad_clip / (float(grad_norm) + 1e-6))  # DeepSpeed's formula
        torch.save({"grad": net.transformer.wte.weight.grad, "clip_coef": clip_coef}, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    prepare_argv()  # the launcher's --local_rank
    main(Path(sys.argv[1]), sys.argv[2:])
