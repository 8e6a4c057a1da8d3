"""Downstream evaluation with EleutherAI's lm-evaluation-harness (lm-eval) on lmrepo's model
where it lives: the live engine during training (Downstream, eval.* keys), or a checkpoint
consolidated in memory by scripts/evaluate.py (lmrepo.evaluate).

Results take three forms: the harness's own result JSON (RUN/eval/<tag>.json), one metrics line
per task ({"step": S, "eval/<task>/<metric>": value, ...}) and, for a W&B run, its summary.
lm_eval is imported only here, so a run without eval.tasks never pays its ~2 s import.
"""

import functools
import json
import logging
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

# The harness bootstraps stderrs in a multiprocessing pool by default; inside a training rank
# (threads, a process group) a fork is a risk for a second's gain: compute them in-process.
os.environ.setdefault("DISABLE_MULTIPROC", "1")


@contextmanager
def preserved_rng():
    """simple_evaluate seeds python, numpy and torch; training's own random streams (dropout,
    masking) must continue as if it had not run."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@functools.cache
def environment_report() -> dict:
    """What the harness adds to every result about this machine (torch's collect_env: `pip list`,
    `lscpu`, the compilers' and drivers' versions; ~1 s of subprocesses on 2 cores), gathered once
    a process: a training run that evaluates every N steps paid it at each evaluation, inside the
    `downstream_s` it reports."""
    from lm_eval.loggers.utils import add_env_info

    report = {}
    add_env_info(report)
    return report


def add_environment_once(results: dict) -> None:
    results.update(environment_report())


def run_tasks(lm, tasks, limit: int | None, bootstrap_iters: int) -> dict | None:
    """simple_evaluate on every rank; the harness's result dict on rank 0, None elsewhere."""
    import lm_eval
    import lm_eval.api.task
    import lm_eval.evaluator
    from tqdm import tqdm

    lm_eval.evaluator.add_env_info = add_environment_once

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines narrate every step
    # and it draws a bar per task on every rank while it builds the requests (milliseconds for
    # local tasks): in a training run they would cut through the training bar
    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)
    loaded = tasks.load()
    with preserved_rng():
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(loaded["tasks"].values()),
            task_manager=tasks.manager,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )


def metrics_of(results: dict) -> dict[str, float]:
    """{"eval/<task>/<metric>": value}: the harness's "<metric>,<filter>" keys, the filter named
    only when it is not the default one; standard errors stay in the JSON."""
    flat = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if (
                filter_name
                and "_stderr" not in metric
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                name = metric if filter_name == "none" else f"{metric}/{filter_name}"
                flat[f"eval/{task}/{name}"] = float(value)
    return flat


def records(results: dict, step: int) -> list[dict]:
    """One metrics line per task."""
    by_task: dict[str, dict] = {}
    for key, value in metrics_of(results).items():
        by_task.setdefault(key.split("/")[1], {"step": step})[key] = value
    return list(by_task.values())


def write_results(results: dict, path: Path) -> Path:
    """The harness's result dict as its own CLI writes it."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return path


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


class Downstream:
    """eval.tasks on the live engine, every eval.every steps and at the end, on every rank.
    Documents are dealt over the data-parallel ranks; tensor-parallel peers score the same ones."""

    def __init__(self, settings, tasks, engine, tokenizer, run_dir: Path):
        """`settings`: the eval slice (lmrepo.config.evaluation.EvalConfig)."""
        from lmrepo.evaluation.lm import LmrepoLM

        self.settings, self.tasks, self.run_dir = settings, tasks, run_dir
        self.module = engine.module
        ds = getattr(engine, "ds", None)  # DeepSpeed's engine; FSDP2's has none
        if ds is not None:
            group = ds.mpu.get_data_parallel_group() if ds.autotp_size() > 1 else None
        else:
            group = getattr(engine, "data_group", None)  # FSDP2 with tp=auto: its data-parallel ranks
        self.lm = LmrepoLM(self.module, tokenizer, settings.batch_size, engine.device, group)

    def due(self, step: int, max_steps: int) -> bool:
        return step == max_steps or bool(self.settings.every and step % self.settings.every == 0)

    def __call__(self, step: int, beat=None) -> list[dict]:
        """The metrics lines on rank 0 (also written to RUN/eval/step_<N>.json); [] elsewhere.
        `beat(step)` after every forward tells training's watchdog that this rank is not stuck."""
        import torch.distributed as dist

        from lmrepo.train.checkpoint import tag_for

        training = self.module.training
        self.module.eval()
        self.lm.progress = (lambda: beat(step)) if beat is not None else None
        start = time.perf_counter()
        try:
            # stderrs (bootstrapped) are for the final numbers: scripts/evaluate.py
            results = run_tasks(self.lm, self.tasks, self.settings.limit, bootstrap_iters=0)
        finally:
            self.module.train(training)
        # The harness answers where its rank (the data-parallel one) and LOCAL_RANK are 0: with
        # tensor parallelism over several nodes, another node's first rank too. One writer.
        if results is None or dist.get_rank() != 0:
            return []
        write_results(results, self.run_dir / "eval" / f"{tag_for(step)}.json")
        return [*records(results, step), {"step": step, "downstream_s": time.perf_counter() - start}]
