"""The parallel layout of a job: how its ranks split into pipeline stages, data-parallel replicas
and shards, sequence- and tensor-parallel groups, and expert-parallel groups. One object, made
once when the job is planned (`lmrepo.plan.job`), from which every size, every rank's coordinates and
every group of ranks comes: a torch `DeviceMesh` for the torch engines, the same ranks for
DeepSpeed's groups. Modelled on torchtitan's `ParallelDims`.

Rank order, outermost first (the last dimension varies fastest between consecutive ranks):

    rank = (((pp * dp_replicate + r) * dp_shard + s) * sp + q) * tp + t

- `pp`: pipeline stages, pipe-major as DeepSpeed's PipelineParallelGrid numbers them (stage s holds
  ranks s*dp .. s*dp + dp - 1);
- `dp_replicate` x `dp_shard`: the data-parallel ranks (they read different samples); a 1-D data
  parallel layout has dp_replicate = 1 (ZeRO and FSDP shard over all of them);
- `sp`, `tp`: sequence- and tensor-parallel groups of consecutive ranks, each group reading the
  same samples (DeepSpeed's Ulysses and AutoTP groups);
- `ep`: expert parallelism splits each mixture-of-experts layer's experts over groups of `ep`
  consecutive data-parallel ranks (DeepSpeed-MoE's expert groups; on the torch mesh dp_shard cut
  into edp x ep, expert_mesh); it does not change who reads which samples.
"""

import math
from dataclasses import dataclass

from lmrepo.config.messages import more_ranks
from lmrepo.distributed.launch import node_count
from lmrepo.utils.errors import require

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "sp", "tp")


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        sizes = " x ".join(f"{name} {getattr(self, name)}" for name in DIMENSIONS)
        require(
            math.prod(self.sizes.values()) == self.world,
            f"the parallel layout ({sizes}) does not tile the {self.world} rank(s)",
        )
        require(
            self.dp % self.ep == 0, f"expert_parallel.size={self.ep} does not divide the {self.dp} data-parallel ranks"
        )

    @classmethod
    def of(cls, config, world: int) -> "ParallelLayout":
        """The layout a loaded config asks for on `world` ranks, each rule of the rank layout one
        line naming what to change. world = pipeline stages x data-parallel ranks x sequence-
        parallel size x tensor-parallel size."""
        pp = config.pipeline.stages if config.pipeline.schedule != "none" else 1
        require(
            world % config.pipeline.stages == 0,
            f"pipeline.stages={config.pipeline.stages} does not divide the world size "
            f"{world}: change pipeline.stages, or {more_ranks(math.lcm(world, config.pipeline.stages))}",
        )
        ranks = world // pp
        tp = config.tp.size if str(config.tp.mode) == "auto" else 1
        _groups_divide(ranks, "tp.size", tp, "rank(s) (world = tp.size x data-parallel ranks)", world)
        ranks //= tp
        sp = config.sequence_parallel.size
        _groups_divide(
            ranks,
            "sequence_parallel.size",
            sp,
            "rank(s) (world = sequence_parallel.size x data-parallel ranks)",
            world,
        )
        ranks //= sp
        replicate = config.engine.replicate
        replicate = node_count(world, config.launcher.nodes) if replicate == "nodes" else int(replicate)
        _groups_divide(ranks, "engine.replicate", replicate, "data-parallel rank(s) (HSDP: replicas x shards)", world)
        ep = config.expert_parallel.size
        _groups_divide(
            ranks,
            "expert_parallel.size",
            ep,
            "data-parallel rank(s) (each group of expert_parallel.size ranks holds every expert once)",
            world,
        )
        require(
            (ranks // replicate) % ep == 0,
            f"expert_parallel.size={ep} with engine.replicate={replicate}: each replica's {ranks // replicate} "
            "shard(s) must hold every expert; choose an expert_parallel.size that divides them",
        )
        return cls(world=world, pp=pp, dp_replicate=replicate, dp_shard=ranks // replicate, sp=sp, tp=tp, ep=ep)

    @classmethod
    def single(cls) -> "ParallelLayout":
        return cls(world=1)

    # --- sizes

    @property
    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMENSIONS}

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many ranks read different samples."""
        return self.dp_replicate * self.dp_shard

    # --- one rank's place

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension."""
        found = {}
        for name in reversed(DIMENSIONS):
            rank, found[name] = divmod(rank, getattr(self, name))
        return {name: found[name] for name in DIMENSIONS}

    def dp_rank(self, rank: int) -> int:
        """Which of the dp data-parallel positions this rank reads the samples of."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def stage(self, rank: int) -> int:
        return self.coordinates(rank)["pp"]

    def group(self, rank: int, dimensions: tuple[str, ...]) -> list[int]:
        """The ranks that differ from `rank` only along `dimensions` (its group of them), in order."""
        at = self.coordinates(rank)
        members = []
        for other in range(self.world):
            there = self.coordinates(other)
            if all(there[name] == at[name] for name in DIMENSIONS if name not in dimensions):
                members.append(other)
        return members

    # --- groups

    def mesh(self, device_type: str):
        """The job's torch DeviceMesh, one named dimension per entry of DIMENSIONS (sizes of 1
        included, so every engine names the same dimensions), over the default process group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=DIMENSIONS)

    def data_mesh(self, mesh):
        """The part of `mesh` fully_shard shards over: the data-parallel ranks, or with replicas
        (HSDP) the replicate x shard mesh (each shard replicated across the replicas)."""
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]

    @property
    def shards(self) -> int:
        """How many ranks FSDP2 cuts each parameter into (shard_mesh's last dimension): the data-
        parallel shards, times the sequence-parallel ranks under sequence parallelism."""
        return self.dp_shard * self.sp

    def shard_index(self, rank: int) -> int:
        """Which of the `shards` pieces this rank holds."""
        at = self.coordinates(rank)
        return at["dp_shard"] * self.sp + at["sp"]

    def shard_mesh(self, mesh):
        """What fully_shard shards over: the data mesh, and under sequence parallelism the ranks of
        each sequence-parallel group with it (their slices' gradients are summed over them, as the
        data-parallel ranks' are averaged: lmrepo.engines.fsdp2.parallelize), the two flattened
        into one dimension, "dp_shard_sp"."""
        if self.sp == 1:
            return self.data_mesh(mesh)
        mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        return mesh["dp_replicate", "dp_shard_sp"] if self.dp_replicate > 1 else mesh["dp_shard_sp"]

    def expert_mesh(self, mesh):
        """`mesh` with its dp_shard dimension cut into ("edp", "ep"), ep varying fastest: each group
        of `ep` consecutive data-parallel shards splits the experts between them (DeepSpeed-MoE's
        expert groups, torchtitan's dp_shard x ep), and the ranks along "edp" (and "dp_replicate")
        hold the same experts."""
        return mesh._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), ("edp", "ep"))

    def expert_data_mesh(self, expert_mesh):
        """What fully_shard shards the experts over: the ranks that hold the same experts (with
        replicas, replicate x edp)."""
        return expert_mesh["dp_replicate", "edp"] if self.dp_replicate > 1 else expert_mesh["edp"]

    def ep_rank(self, rank: int) -> int:
        """Which share of the experts this rank holds."""
        return self.dp_rank(rank) % self.ep

    def describe(self) -> str:
        parts = [f"{name} {size}" for name, size in self.sizes.items() if size > 1]
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        return " x ".join(parts) or "1 rank"


def _groups_divide(ranks: int, key: str, size: int, which: str, world: int) -> None:
    """Groups of `size` ranks (tensor, sequence, expert parallel, replicas) must tile the `ranks`
    (of `world`); the way out names the smallest world that they tile."""
    needed = world // ranks * math.lcm(ranks, size)
    require(
        ranks % size == 0, f"{key}={size} does not divide the {ranks} {which}: change {key}, or {more_ranks(needed)}"
    )
