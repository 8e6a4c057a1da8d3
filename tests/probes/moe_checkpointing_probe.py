"""Launched by tests/test_moe.py as one process: the same mixture-of-experts steps without activation
checkpointing, with DeepSpeed's (reentrant) and with torch's (non-reentrant), one engine after the
other in this process (same seed, same batches). Writes OUT_DIR/moe_checkpointing.pt: for each, per
step, the learning rate, the loss, the metrics line's figures (grad_norm, aux_loss) and every
router's gradient as the optimizer receives it. Usage: moe_checkpointing_probe.py OUT_DIR STEPS [overrides...]"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmrepo.distributed.launch import init_distributed
from probe_job import start_job

CHECKPOINTING = {
    "none": ["checkpointing=none"],
    "deepspeed": ["checkpointing=full", "checkpointing.impl=deepspeed"],
    "torch": ["checkpointing=full", "checkpointing.impl=torch"],
}


def run(out: Path, steps: int, overrides: list[str]) -> list[dict]:
    _, engine, data = start_job(overrides, out)
    routers = [mlp.moe.deepspeed_moe.gate.wg.weight for mlp in engine.module.moe_layers()]
    grads: list[torch.Tensor] = []
    for router in routers:  # the gradient once accumulated, before clipping and the step
        router.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.detach().clone()))
    records = []
    for step in range(steps):
        grads.clear()
        lr = engine.lr()  # the rate this step uses
        loss = engine.train_step(data.train_step(step))
        # backward reaches the routers last block first
        records.append({"lr": lr, "loss": float(loss), **engine.step_record(), "router_grads": grads[::-1]})
    return records


def main(out: Path, steps: int, overrides: list[str]) -> None:
    init_distributed()
    results = {name: run(out, steps, [*overrides, *extra]) for name, extra in CHECKPOINTING.items()}
    torch.save(results, out / "moe_checkpointing.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
