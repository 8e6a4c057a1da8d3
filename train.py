"""Train GPT-2, BERT or Llama with DeepSpeed, every technique chosen by name through Hydra.

python train.py                                         # tiny GPT-2 on Shakespeare (CPU or 1 GPU)
python train.py trainer.max_steps=10                    # a smoke test
deepspeed --num_gpus 2 train.py zero=stage2             # 2 ranks (gloo on CPU, NCCL on GPUs)
deepspeed train.py zero=stage3 offload=nvme             # ZeRO-Infinity on every local GPU
python train.py model=bert-tiny precision=fp32          # masked-LM BERT
python train.py -m zero=stage0,stage1,stage2,stage3     # a sweep, one job per stage
python train.py --help                                  # every key of every group
"""

import gc
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lmrepo.config import register
from lmrepo.config.hydra_mode import skip_needless_mode_probe
from lmrepo.config.messages import one_line_config_errors, one_line_disk_errors
from lmrepo.distributed.launch import adopt_slurm_env, prepare_argv, world_size
from lmrepo.plan.rules import load_checked
from lmrepo.train.rundir import refuse
from lmrepo.train.stop import StopRequest
from lmrepo.utils import quiet
from lmrepo.utils.errors import ConfigError

prepare_argv()  # the launcher's --local_rank must not reach Hydra; one run dir name for all ranks
register()  # the typed schema conf/train.yaml composes over
skip_needless_mode_probe()  # Hydra composes the config once more only to read hydra.mode
quiet.install()  # library notices that ask nothing of the user; hydra.verbose=true keeps them


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # First: a SIGTERM (a sweep's timeout, a scheduler) from here on, in a start-up that can take
    # minutes, is answered with a checkpoint after the first step, as one that comes during training.
    checkpoint_requests = StopRequest()
    if HydraConfig.get().verbose:
        quiet.uninstall()
    with one_line_disk_errors():  # writing the run directory: one line, from inside Hydra's job
        try:
            load_checked(cfg)  # a wrong value or combination stops here, before torch and DeepSpeed are imported
        except ConfigError as err:
            refuse(str(err), Path(cfg.run.dir))
        # Importing torch and transformers makes ~600k objects that live as long as the process, and
        # the cyclic collector runs ~1,000 times over them meanwhile: a fifth of a rank's start
        # (benchmarks/bench_startup.py). Off for the import, then those objects are frozen out of
        # every later collection (with the few MB of cycles the import left: collecting them costs
        # more than keeping them). Here, not at the top: a -m sweep's parent never reaches main().
        gc.disable()
        from lmrepo.plan.job import plan

        try:
            adopt_slurm_env()  # RANK and WORLD_SIZE under srun, before the plan counts the ranks
            job = plan(cfg, world_size())  # against the device and the ranks, before transformers is imported
        except ConfigError as err:
            refuse(str(err), Path(cfg.run.dir))
        from lmrepo.run import train

        gc.freeze()
        gc.enable()

        train(cfg, job, checkpoint_requests)


if __name__ == "__main__":
    with one_line_config_errors():
        main()
