"""Launched by tests/test_faults.py on 2 CPU ranks: the process group as training starts it
(`train`: lmrepo.distributed.launch.init_distributed) or as generation does (`generate`: prepare_shm,
then init_distributed with DeepSpeed's CPU all-reduce kernel), then one all-reduce of DeepSpeed-
Inference's kind and, for generation, the release of the rank's buffer. Rank 0 prints one JSON
line per rank: whether DeepSpeed loaded the kernel, whether the rank's 66 MiB buffer was in /dev/shm,
the all-reduce's sum, and whether the buffer was there after the release. (One process prints them
all: two ranks printing at once into the same pipe could interleave their lines.)
Usage: all_reduce_kernel_probe.py train|generate"""

import json
import sys

import torch
import torch.distributed as dist

from lmrepo.distributed import launch


def main(mode: str) -> None:
    if mode == "generate":
        launch.prepare_shm()
    launch.init_distributed(all_reduce_kernel=mode == "generate")
    import deepspeed.comm as ds_comm
    import deepspeed.comm.comm as ds_comm_state

    kernel = ds_comm_state.cdb.shm_comm_op is not None
    mapped = launch.shm_buffer().exists()
    total = torch.full((4,), float(dist.get_rank() + 1))
    ds_comm.inference_all_reduce(total)  # in place, by the kernel or by torch.distributed
    if mode == "generate":
        launch.release_shm_buffer()
    line = {"kernel": kernel, "buffer": mapped, "sum": total.tolist(), "buffer_after": launch.shm_buffer().exists()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, line)
    if dist.get_rank() == 0:
        sys.stdout.write("".join(json.dumps({"rank": rank, **found}) + "\n" for rank, found in enumerate(every)))
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
