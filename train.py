"""Train GPT-2 or BERT with DeepSpeed, every technique chosen by name through Hydra.

    python train.py                                         # tiny GPT-2 on Shakespeare (CPU or 1 GPU)
    deepspeed --num_gpus 2 train.py zero=stage2             # 2 ranks (gloo on CPU, NCCL on GPUs)
    deepspeed train.py zero=stage3 offload=nvme             # ZeRO-Infinity on every local GPU
    python train.py model=bert-tiny precision=fp32          # masked-LM BERT
    python train.py -m zero=stage0,stage1,stage2,stage3     # a sweep, one job per stage
"""
import hydra
from omegaconf import DictConfig

from lmrepo.launch import prepare_argv

prepare_argv()  # the launcher's --local_rank must not reach Hydra; one run dir name for all ranks


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lmrepo.run import train  # after Hydra: `--help` and config errors stay fast

    train(cfg)


if __name__ == "__main__":
    main()
