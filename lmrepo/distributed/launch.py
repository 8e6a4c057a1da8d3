"""Rank environment: what every process needs before Hydra parses and before a process group starts."""

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

from omegaconf import OmegaConf

from lmrepo.utils.errors import ConfigError, TrainingError


def strip_local_rank_arg(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends `--local_rank=N`, which Hydra rejects; move it to LOCAL_RANK."""
    kept, skip_next = [], False
    for i, arg in enumerate(argv):
        if skip_next:
            skip_next = False
        elif arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg == "--local_rank" and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip_next = True
        else:
            kept.append(arg)
    return kept


def launch_time() -> float:
    """One timestamp for all ranks of a launch: the launcher process's start (every local rank
    has the same parent), so every rank's Hydra run dir has the same name. Plain `python`: now."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import psutil

        return psutil.Process(os.getppid()).create_time()
    return time.time()


def register_resolvers() -> None:
    stamp = launch_time()
    if not OmegaConf.has_resolver("lmrepo_launch_time"):
        OmegaConf.register_new_resolver("lmrepo_launch_time", lambda fmt: time.strftime(fmt, time.localtime(stamp)))
    if not OmegaConf.has_resolver("lmrepo_slurm_gpus"):
        OmegaConf.register_new_resolver("lmrepo_slurm_gpus", slurm_gpus)


def slurm_gpus(partition: str | None, ranks: int) -> int | None:
    """GPUs per node for hydra/launcher=slurm: `ranks` where the partition's nodes have GPUs (a
    `gpu` generic resource, as sinfo lists them), none where they have none: Slurm refuses a GPU
    request on a partition without GPUs ("Invalid generic resource (gres) specification"). Without
    sinfo here, `ranks` as asked."""
    command = ["sinfo", "--noheader", "--format=%G", *(["--partition", str(partition)] if partition else [])]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ranks
    return ranks if "gpu" in listed else None


def prepare_argv() -> None:
    sys.argv = strip_local_rank_arg(sys.argv)
    register_resolvers()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_size() -> int:
    """How many ranks share this node, as the launcher said: LOCAL_SIZE (DeepSpeed's launcher) or
    LOCAL_WORLD_SIZE (torchrun; submitit under Slurm); 0 when neither did."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "0")))


def node_count(world: int, planned: int) -> int:
    """The nodes a job of `world` ranks runs on: WORLD_SIZE / the ranks per node the launcher set
    (torchrun --nnodes, DeepSpeed's multi-node runner, Slurm); `planned` (launcher.nodes) where no
    launcher started this world: a sweep's plan, an estimate."""
    local = local_size()
    if local and world == world_size() and world % local == 0:
        return world // local
    return planned


def adopt_slurm_env() -> None:
    """A job started by Slurm (hydra/launcher=slurm, or srun) has SLURM_PROCID / SLURM_NTASKS per
    task but no RANK: submitit derives RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR (the first
    node) from them; the port is slurm_master_port's. A MASTER_ADDR or MASTER_PORT the job sets is kept."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # submitit sets it in its jobs; a plain srun does not
    address = os.environ.get("MASTER_ADDR")  # the job's own, where it sets one
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))  # submitit takes a port that is set

    # Every task keeps all GPUs of its node visible: DeepSpeed picks cuda:LOCAL_RANK itself.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    os.environ["MASTER_ADDR"] = address or node_address(os.environ["MASTER_ADDR"])


# Where a Slurm job's rank 0 listens: below Linux's default range for ports the kernel picks
# itself (32768-60999), which every node is taken to share, since no node asks another.
SLURM_MASTER_PORTS = range(20000, 32768)


def slurm_master_port() -> int:
    """The rendezvous port of this Slurm job's attempt, which every task computes alike from the
    job id and its restarts. submitit's own (a random pick in 20000-60000 seeded by the job id
    alone) mostly lies in that range, where any outgoing connection on the node may hold it
    when rank 0 binds it, and is the same port again after a requeue."""
    job = os.environ.get("SLURM_JOB_ID", "0")
    attempt = f"{job}.{slurm_restarts()}".encode()
    return SLURM_MASTER_PORTS[zlib.crc32(attempt) % len(SLURM_MASTER_PORTS)]


def slurm_restarts() -> int:
    """How many times Slurm restarted this job (SLURM_RESTART_COUNT: requeued at its time limit by
    submitit, pre-empted, or after a node failed); 0 outside Slurm."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def node_address(node: str) -> str:
    """What reaches Slurm node `node`: its name where it resolves (the usual cluster), else the
    NodeAddr Slurm knows it by (`scontrol show node`: a node name that is no host name). A name
    neither resolves nor Slurm knows is one line, not a rendezvous that retries until it times out."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    try:
        shown = subprocess.run(
            ["scontrol", "show", "node", node, "--oneliner"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        shown = ""
    address = re.search(r"\bNodeAddr=(\S+)", shown)
    if address is None:
        raise ConfigError(
            f"this Slurm job's first node, {node}, is no host name here and scontrol gives no NodeAddr for it: "
            "the ranks cannot meet there; set MASTER_ADDR in the job's environment to an address of that node"
        )
    return address.group(1)


# How long a port handed out by free_port stays claimed: long past any rank 0's bind of it
# (imports, then the store), short enough that a crashed launcher's claims expire.
PORT_CLAIM_S = 600


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to port 0, every outgoing connection's
    local port): Linux's default when it cannot be read."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def rendezvous_ports() -> range:
    """Where free_port looks: a stretch outside the kernel's own range, so that no other process
    is given the port as a side effect of connecting somewhere."""
    low, high = ephemeral_ports()
    if low - 1024 >= 4096:
        return range(max(1024, low - 12768), low)  # 20000-32767 with Linux's default range
    if 65535 - high >= 4096:
        return range(high + 1, 65536)
    return range(0)  # the kernel's range covers nearly everything: port 0 (free_port says so)


def claim_port(port: int, claims: Path) -> bool:
    """Takes `port` for this caller unless another process claimed it in the last PORT_CLAIM_S: a
    file created exclusively, so two processes never both get it."""
    path = claims / str(port)
    try:
        if time.time() - path.stat().st_mtime > PORT_CLAIM_S:
            path.unlink(missing_ok=True)  # another caller's, expired
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def nobody_listens_on(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds: TIME_WAIT is no owner
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A TCP port for a rendezvous (MASTER_PORT, a launcher's --master_port) that no other process
    takes before the job's rank 0 binds it, seconds later.

    Port 0's pick comes from the kernel's ephemeral range, and so does the local port of every
    connection any process opens (gloo opens many): between the pick and rank 0's bind another
    process could take it, and a 2-rank test then died with 'Connection reset by peer' now and
    then. Here the port lies outside that range, nothing listens on it now, and a claim file
    (per user, in the temporary directory) keeps every other lmrepo process, launcher or test
    from handing it out again for PORT_CLAIM_S."""
    import random
    import tempfile

    ports = rendezvous_ports()
    claims = Path(tempfile.gettempdir()) / f"lmrepo-ports-{os.getuid()}"
    claims.mkdir(exist_ok=True)
    start = random.randrange(len(ports)) if ports else 0
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if claim_port(port, claims) and nobody_listens_on(port):
            return port
    with socket.socket() as s:  # no stretch outside the kernel's range: its pick, with the old window
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(ranks: int, via: str = "deepspeed") -> list[str]:
    """How a user starts a script on `ranks` ranks of this node, each launch on a free port:
    `deepspeed --num_gpus N` or `torchrun --nproc-per-node N` (this interpreter's), plain
    `python` for 0 ranks (one process, no launcher)."""
    if not ranks:
        return [sys.executable]
    if via == "torchrun":
        return [
            str(Path(sys.executable).with_name("torchrun")),
            "--nproc-per-node",
            str(ranks),
            "--master-port",
            str(free_port()),
        ]
    return [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(free_port()),
        "--log_level=warning",  # not its INFO lines (accelerator, CUDA_VISIBLE_DEVICES, each rank's command)
    ]


def ensure_single_process_env() -> None:
    """A plain `python train.py` has no launcher: without these, deepspeed.init_distributed
    falls back to MPI discovery and dies on the missing mpi4py."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def refuse_a_taken_master_port() -> None:
    """Two `deepspeed train.py` commands on one machine both take the launcher's default port
    29500: the second one's rank 0 cannot open the rendezvous store there, and torch says so
    in a traceback per rank (DistNetworkError, EADDRINUSE). Rank 0 says it in one line first.
    Not under torchrun, whose agent holds the store on that port itself."""
    port = int(os.environ.get("MASTER_PORT", "0"))
    if rank() != 0 or not port or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: TIME_WAIT is no owner
        try:
            s.bind(("", port))
        except OSError:
            how = (
                f"set MASTER_PORT={free_port()} in the job's environment"
                if "SLURM_JOB_ID" in os.environ
                else f"launch with deepspeed --master_port {free_port()} (torchrun: --master-port)"
            )
            raise ConfigError(
                f"MASTER_PORT {port} is in use (another job on this machine?): {how} or stop the other job"
            ) from None


def init_distributed(timeout_s: float = 0, all_reduce_kernel: bool = False) -> None:
    """The process group: gloo on CPU (ccl when oneCCL is installed), NCCL on CUDA, as the
    accelerator says. `timeout_s` bounds every collective, also in the groups DeepSpeed creates
    later without a timeout of their own (they take torch's default, set here); 0 keeps
    DeepSpeed's 10 minutes for the world group and torch's 30 for the others.
    `all_reduce_kernel`: also DeepSpeed's CPU all-reduce kernel and its 66 MiB per rank in
    /dev/shm, which only DeepSpeed-Inference uses (lmrepo.generate; prepare_shm first)."""
    from datetime import timedelta

    from lmrepo.utils import cpuinfo_cache, ops

    ensure_single_process_env()
    ops.pin_builds()  # before DeepSpeed reads where its ops are built

    import deepspeed
    import torch.distributed
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.accelerator import get_accelerator

    from lmrepo.utils.quiet import quiet_prints

    ops.load_ops_as_ranks_do(world_size(), all_reduce_kernel)
    # DeepSpeed's CPU all-reduce (its shm comm op) reads LOCAL_SIZE, which only DeepSpeed's own
    # launcher sets: under torchrun or Slurm it stayed off, and DeepSpeed-Inference's all-reduce
    # then ran on its uninitialised buffer (SIGSEGV on every rank; DeepSpeed 0.19.8).
    if local_size():
        os.environ.setdefault("LOCAL_SIZE", str(local_size()))
    cpuinfo_cache.install()  # before DeepSpeed loads its CPU ops, each of which asks what the CPU is
    if get_accelerator().device_name() == "cpu":
        share_cpu_cores()
    kwargs = {}
    if timeout_s:
        kwargs["timeout"] = c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    try:
        with quiet_prints():
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), **kwargs)
    except torch.distributed.DistError as err:  # the store not reached, or the others never came
        raise TrainingError(
            f"could not meet the other {world_size() - 1} rank(s) at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT): "
            f"{str(err).splitlines()[0][:200]} Is rank 0's node up, and that address reachable from this one?"
        ) from None


def host_group():
    """A new gloo group over every rank, for collectives of host tensors beside the default group
    (a checkpoint written in a background thread, the stop flags beside NCCL). Under torch's fake
    backend, where a layout is built in one process for its shapes, a group of that backend: gloo
    cannot be built over its store, and nothing is sent."""
    import torch.distributed as dist

    return dist.new_group(backend=None if dist.get_backend() == "fake" else "gloo")


def share_cpu_cores() -> None:
    """Each CPU rank takes its share of the machine's cores unless OMP_NUM_THREADS says otherwise
    (torchrun sets it to 1; DeepSpeed's launcher leaves every rank all the cores). Oversubscribed
    ranks slow each other down, many times over: DeepSpeed's CPU all-reduce spins while it waits
    for the other ranks, on the cores they need."""
    import torch

    if world_size() > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (local_size() or world_size())))


SHM_PREFIX = "deepspeed_allreduce_buffer_"
SHM_BYTES = 69_206_024  # DeepSpeed 0.19's allreduce_workspace: 2 x 1 MiB + 2 x 32 MiB + flags, per rank


def prepare_shm() -> None:
    """DeepSpeed's CPU all-reduce maps a 66 MiB buffer per rank in /dev/shm when all the job's
    ranks are on one node (LOCAL_SIZE = WORLD_SIZE; init_distributed sets LOCAL_SIZE under
    torchrun and Slurm too). Before it does: remove the buffers of this user that no live process
    maps (a run killed with -9 leaves its own), and refuse a /dev/shm too small for this node's
    ranks (Docker's default is 64 MiB): DeepSpeed would crash on it."""
    local = local_size()
    shm = Path("/dev/shm")
    if local != world_size() or not shm.is_dir():
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        remove_stale_shm()
    import shutil

    from lmrepo.utils.errors import ConfigError

    free = shutil.disk_usage(shm).free
    mine = sum(1 for _ in shm.glob(f"{SHM_PREFIX}{os.getuid()}_*_{os.environ.get('MASTER_PORT')}_*"))
    needed = SHM_BYTES * (local - mine)
    if free < needed:
        raise ConfigError(
            f"/dev/shm has {free / 2**20:.0f} MiB free; DeepSpeed's CPU all-reduce needs 66 MiB for each "
            f"of this node's {local} ranks: free it, or give the container more (docker run --shm-size=1g)"
        )


def remove_stale_shm() -> None:
    """Removes this user's all-reduce buffers in /dev/shm that no live process maps and that are a
    minute old: what a run killed with -9 left. A buffer another job's rank is creating right now
    is not mapped yet (DeepSpeed writes its 66 MiB, then maps it by name), and removing it would
    leave that job's other ranks waiting for it forever."""
    mapped = mapped_shm_names()
    for stale in Path("/dev/shm").glob(f"{SHM_PREFIX}{os.getuid()}_*"):
        with contextlib.suppress(FileNotFoundError):  # its owner may remove it meanwhile
            if stale.name not in mapped and time.time() - stale.stat().st_mtime > 60:
                stale.unlink()


def mapped_shm_names() -> set[str]:
    """The /dev/shm buffer names some live process of this user has mapped."""
    prefix = f"/dev/shm/{SHM_PREFIX}"
    return {
        Path(path).name
        for maps in Path("/proc").glob("[0-9]*/maps")
        for _, path in mapped_files(maps)
        if path.startswith(prefix)
    }


def mapped_files(maps: Path) -> list[tuple[int, str]]:
    """(inode, path) of each file a /proc/PID/maps lists (address, permissions, offset, device,
    inode, path), not those unlinked since; none where it cannot be read (the process gone, or
    another user's)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    return [(int(fields[4]), fields[5]) for fields in map(str.split, lines) if len(fields) == 6]


def release_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (shm comm op) leaves its per-rank buffer in /dev/shm, named
    after the master address and port, when the process exits: a machine that runs many jobs
    fills its shared memory until the OOM killer steps in. Each rank unlinks its own; the mapping
    stays valid until the process exits. Only the file this process maps: the name alone is not
    its own once its port is free again, and a job that took the port next would wait forever for
    the buffer a peer made under it."""
    path = shm_buffer()
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_ino in mapped_inodes(path):
            path.unlink()


def shm_buffer() -> Path:
    """This rank's buffer, named as DeepSpeed's CPU all-reduce names it: after the user, the master
    address and port, and the rank."""
    env = os.environ
    return Path(
        "/dev/shm", f"{SHM_PREFIX}{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{env.get('RANK')}"
    )


def mapped_inodes(path: Path) -> set[int]:
    """The inodes of the files at `path` this process maps."""
    return {inode for inode, mapped in mapped_files(Path("/proc/self/maps")) if mapped == str(path)}
