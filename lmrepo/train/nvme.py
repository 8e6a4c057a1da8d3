"""ZeRO-Infinity's swap space is the run's own: a subdirectory of offload.nvme_path per run
(DeepSpeed deletes and reuses `<path>/zero_stage_3/*/rank<N>`, so two runs sharing a path would
overwrite each other's swapped states), removed when the run's processes end."""

import atexit
import secrets
import shutil
from pathlib import Path

import torch.distributed as dist

SECTIONS = ("offload_optimizer", "offload_param")


def use_per_run_swap(ds_config: dict, run_name: str) -> Path | None:
    """Points the DeepSpeed dict's NVMe paths at `<nvme_path>/lmrepo-<run>-<random>` (one name,
    drawn by rank 0, for every rank) and removes this rank's swap files there at exit."""
    zero = ds_config.get("zero_optimization", {})
    sections = [zero[s] for s in SECTIONS if zero.get(s, {}).get("device") == "nvme"]
    if not sections:
        return None
    name = [f"lmrepo-{run_name}-{secrets.token_hex(3)}"]
    dist.broadcast_object_list(name, src=0)
    for section in sections:
        section["nvme_path"] = str(Path(section["nvme_path"]) / name[0])
    swap = Path(sections[0]["nvme_path"])
    swap.mkdir(parents=True, exist_ok=True)
    atexit.register(remove_rank_swap, [Path(s["nvme_path"]) for s in sections], dist.get_rank())
    return swap


def remove_rank_swap(swaps: list[Path], rank: int) -> None:
    """This rank's swap directories, then whatever of the run's swap tree is left empty."""
    for swap in swaps:
        for own in swap.glob(f"**/rank{rank}"):
            shutil.rmtree(own, ignore_errors=True)
        for directory in sorted((d for d in swap.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            try:
                directory.rmdir()
            except OSError:
                pass
        try:
            swap.rmdir()
        except OSError:
            pass  # another rank's files are still there: that rank removes them and the directory
