"""Launched by tests/test_tp.py on 2 AutoTP ranks and as one process: a few training steps of
lmrepo's DeepSpeed engine, recording per step the learning rate, the loss, the metrics line's
grad_norm and the factor DeepSpeed scaled the gradients by (gradient clipping) before its optimizer
took them. Writes OUT_DIR/steps_rank{R}.json. Usage: grad_clip_probe.py OUT_DIR STEPS [overrides...]"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmrepo.distributed.launch import init_distributed
from probe_job import start_job


def squares(tensors) -> torch.Tensor:
    return sum(t.double().square().sum() for t in tensors if t is not None)


def main(out: Path, steps: int, overrides: list[str]) -> None:
    init_distributed()
    _, engine, data = start_job(overrides, out)

    optimizer, scales = engine.ds.basic_optimizer, []
    optimizer_step = optimizer.step

    def record_scale_then_step(*args, **kwargs):
        # The model's gradients as backward left them, against the copies the optimizer takes
        # (DeepSpeed's mixed-precision wrapper scaled those by the clip factor): one factor for all.
        before = squares(p.grad for p in engine.module.parameters())
        after = squares(p.grad for group in optimizer.param_groups for p in group["params"])
        scales.append(float((after / before).sqrt()))
        return optimizer_step(*args, **kwargs)

    optimizer.step = record_scale_then_step
    records = []
    for step in range(steps):
        lr = engine.lr()  # the rate this step uses
        loss = engine.train_step(data.train_step(step))
        records.append({"lr": lr, "loss": float(loss), **engine.step_record(), "clip_scale": scales[-1]})
    (out / f"steps_rank{dist.get_rank()}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
