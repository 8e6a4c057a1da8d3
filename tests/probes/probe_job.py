"""What the probes launched by the tests (grad_clip_probe.py, muon_probe.py, pipeline_probe.py,
moe_checkpointing_probe.py) start with: the job as train.py starts it, planned and prepared, its
engine built after the seed, and the batches each rank reads."""

from pathlib import Path

from transformers import set_seed

from lmrepo.distributed.launch import world_size
from lmrepo.engines import build_engine
from lmrepo.plan.compose import compose_config
from lmrepo.plan.job import Plan, plan
from lmrepo.run import engine_data, prepare_job


def start_job(overrides: list[str], out: Path) -> tuple[Plan, object, object]:
    """(the plan, the lmrepo engine, its data) of the job the overrides make, in a process whose
    group is already up (lmrepo.distributed.launch.init_distributed)."""
    job = plan(compose_config(overrides, run_dir=out), world_size())
    tokenizer, sources, _ = prepare_job(job, out)
    set_seed(job.config.trainer.seed)
    engine = build_engine(job)
    return job, engine, engine_data(job.config, job.ds_config, engine, sources, tokenizer)
