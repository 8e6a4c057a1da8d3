"""Run by tests/test_optimizers.py as `python tests/probes/muon_probe.py OUT_DIR [overrides...]` (one
process): lmrepo's optimizer=muon engine (DeepSpeed's Muon, ZeRO-0) for trainer.max_steps steps,
then the same steps from the same weights and batches with a plain-torch reference written here:
Keller Jordan's Muon (quintic Newton-Schulz in bf16, Nesterov momentum, update scaled by
sqrt(max(1, rows/cols)), decoupled weight decay) on GPT-2's hidden matrices, torch's AdamW on the
rest, the gradient clipped on its global norm first. Writes OUT_DIR/muon_probe.json."""

import json
import sys
from pathlib import Path

import torch
from transformers import set_seed

from lmrepo.distributed.launch import init_distributed, prepare_argv
from lmrepo.models import build_model
from probe_job import start_job


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's Muon (github.com/KellerJordan/Muon, muon.py), as written there."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    update = zeropower_via_newtonschulz5(update, steps=ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def reference_losses(cfg, batches_per_step: list) -> tuple[list[float], dict]:
    set_seed(cfg.trainer.seed)
    net = build_model(cfg.model)
    opt = cfg.optimizer
    # GPT-2's roles written out by name here, independently of lmrepo.optim.muon: the blocks' 2-D
    # weights (Conv1D) take Muon; wte, wpe (and the head tied to wte), norms and biases AdamW.
    named = dict(net.named_parameters())
    hidden = [p for n, p in named.items() if n.startswith("transformer.h.") and p.ndim == 2]
    embeddings = [named["transformer.wte.weight"], named["transformer.wpe.weight"]]
    rest = [p for p in named.values() if p.ndim < 2]
    adamw = torch.optim.AdamW(
        [{"params": embeddings, "weight_decay": opt.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=opt.adam_lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
    )
    momenta = {p: torch.zeros_like(p) for p in hidden}
    losses = []
    for batches in batches_per_step:
        micro_losses = []
        for batch in batches:
            loss = net(**batch).loss
            (loss / len(batches)).backward()
            micro_losses.append(loss.item())
        losses.append(sum(micro_losses) / len(micro_losses))
        grads = [p.grad for p in net.parameters()]
        norm = torch.stack([g.norm(2) for g in grads]).pow(2).sum().pow(0.5)  # as DeepSpeed sums it
        if cfg.trainer.grad_clip > 0:
            coef = cfg.trainer.grad_clip / (norm + 1e-6)  # DeepSpeed's clip_grad_norm_
            if coef < 1:
                for g in grads:
                    g.mul_(coef)
        with torch.no_grad():
            for p in hidden:
                update = muon_update(p.grad, momenta[p], beta=opt.momentum)
                p.mul_(1 - opt.lr * opt.weight_decay)
                p.add_(update.reshape(p.shape), alpha=-opt.lr)
        adamw.step()
        net.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def main(out: Path, overrides: list[str]) -> None:
    init_distributed()
    job, engine, data = start_job(overrides, out)
    cfg = job.config
    steps = [data.train_step(step) for step in range(cfg.trainer.max_steps)]
    ours = [engine.train_step(batches).item() for batches in steps]
    theirs, weights = reference_losses(cfg, steps)
    from deepspeed.runtime.zero.muon import original_muon

    result = {
        "lmrepo": ours,
        "reference": theirs,
        "max_weight_diff": max(
            (p.detach().cpu() - weights[n]).abs().max().item() for n, p in engine.module.named_parameters()
        ),
        "use_muon": {n: bool(p.use_muon) for n, p in engine.module.named_parameters()},
        "compiled": hasattr(original_muon.muon_update, "_torchdynamo_orig_callable"),
    }
    (out / "muon_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    prepare_argv()
    main(Path(sys.argv[1]), sys.argv[2:])
