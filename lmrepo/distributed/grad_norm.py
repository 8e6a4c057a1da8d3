"""The global gradient norm of a model whose gradients lie sharded over a device mesh (FSDP2, HSDP,
tensor parallelism, pipeline stages), as one process would compute it: float64, each shard
counted once."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def by_mesh(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters grouped by the mesh their gradients live on and how they lie on it, in the
    model's order (the same on every rank). With tensor parallelism the split linears' gradients
    are sharded on the data x tensor mesh, the rest's on the data mesh alone (or replicated over
    tensor), and torch's norm takes one mesh at a time ("All operands in aten.stack.default must
    have the same mesh"); one placement a group, its norms stack without a redistribution."""
    groups: dict = {}
    for param in params:
        grad = param.grad
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def global_grad_norm(
    groups: list[list[torch.nn.Parameter]],
    expert_groups: list[list[torch.nn.Parameter]] = (),
    ep_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The 2-norm of every gradient of the model, as one process would compute it, in float64: each
    group's norm (by_mesh) made whole over the mesh dimensions its gradients are sharded on
    (mesh_norm), then the groups' norms combined. A tensor every rank of a tp group holds whole
    counts once: each rank adds its own (equal) copy to its own norm.

    float64 because the norm sums the squares of every gradient element (millions: a tiny model's
    embedding alone has 3.2M) and another layout sums them in another order and partition: in
    float32 that alone moves the norm by ~1e-5 relative (measured between FSDP2 over 4 ranks and
    HSDP, equal gradients), in float64 by ~1e-14, which leaves the norm as exact as the gradients
    themselves. It costs one read of the gradients, as the float32 norm does.

    `expert_groups`: the experts' parameters under expert parallelism, grouped as `groups`: each
    rank of `ep_group` holds other experts, so their squares are summed over it too (the ranks
    that hold the same experts are the mesh they are sharded on)."""
    norms = [mesh_norm([p.grad for p in params]) for params in groups]
    if expert_groups:
        experts = torch.stack([mesh_norm([p.grad for p in params]) for params in expert_groups]).square().sum()
        dist.all_reduce(experts, group=ep_group)
        norms.append(experts.sqrt())
    return torch.linalg.vector_norm(torch.stack(norms))


def mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`, plain tensors or DTensors of one mesh and placement: this rank's
    shards' norm, its square summed over the dimensions they are sharded on in one all-reduce
    (over those dimensions flattened), not over those they are replicated on. DTensor's own
    (full_tensor of a norm) reduces one dimension after another, with a warning each step."""
    if not isinstance(grads[0], DTensor):
        return float64_norm(grads)
    mesh, placements = grads[0].device_mesh, grads[0].placements
    square = float64_norm([g.to_local() for g in grads]).square()
    # Shard, or FSDP2's _StridedShard over the data ranks of a tensor-parallel slice (not a Shard in torch 2.13)
    sharded = tuple(name for name, p in zip(mesh.mesh_dim_names, placements, strict=True) if not p.is_replicate())
    if sharded:
        dist.all_reduce(square, group=mesh[sharded]._flatten().get_group())
    return square.sqrt()


def float64_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of plain `tensors`, summed in float64 without a float64 copy of them (torch's
    get_total_norm has no dtype)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)))


def divide_gradients(unit, ranks: int, mesh: DeviceMesh) -> None:
    """An FSDP2 unit's reduced gradients divided by `ranks` (every data-parallel rank), not
    averaged over the ranks of `mesh` it is sharded on (expert parallelism: the ranks that hold
    the same experts; sequence parallelism: data x sequence ranks, whose shares are summed). A sum
    then a division where `mesh` shards over more than one rank: gloo has no pre-multiplied sum
    (NCCL's PREMUL_SUM). Over one rank FSDP2 divides by the factor itself and, told to sum first,
    would divide again."""
    unit.set_gradient_divide_factor(float(ranks))
    if mesh.size(mesh.ndim - 1) > 1:
        unit.set_force_sum_reduction_for_comms(True)
