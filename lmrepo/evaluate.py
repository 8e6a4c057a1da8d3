"""scripts/evaluate.py: lm-eval tasks on a run's checkpoint (any ZeRO stage or a pipeline,
consolidated in memory: nothing is exported) or a Hugging Face model directory.

Everything that can be refused is refused before any process group starts, in one line: bad
arguments, a directory that holds no model, BERT, a tensor-parallel checkpoint, an unknown task,
a hub task whose data cannot be reached. Under the deepspeed launcher every rank holds the whole
model and scores its share of the documents; rank 0 writes the results.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmrepo.distributed import launch
from lmrepo.train import checkpoint
from lmrepo.utils import quiet
from lmrepo.utils.errors import ConfigError, exit_error


@dataclass
class Options:
    run: str = MISSING
    """a run directory, its checkpoints/ or checkpoints/<tag>, or a Hugging Face model directory"""
    tasks: list[str] = MISSING
    """comma-separated: lmrepo's local tasks, task YAML paths, or the harness's names (hub data)"""
    checkpoint: str | None = None
    """a tag under RUN/checkpoints (step_00000300); null = the run's latest"""
    limit: int | None = None
    """documents per task (the first N); null = all"""
    batch_size: int = 8
    """requests per forward pass"""
    bootstrap_iters: int = 1000
    """bootstrap draws for the standard errors the harness bootstraps (perplexity, ...); 0 = none"""
    wandb: bool = True
    """a run that logged to W&B gets the results in its summary (resumed by RUN/wandb_run_id)"""


def parse_args(argv: list[str]) -> Options:
    """key=value arguments, typed by Options; `tasks=a,b` is the list [a,b]."""
    argv = [f"tasks=[{arg[6:]}]" if arg.startswith("tasks=") and not arg[6:].startswith("[") else arg for arg in argv]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Options), OmegaConf.from_dotlist(argv))
        options: Options = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        from lmrepo.config.messages import describe_omegaconf_error

        raise ConfigError(describe_omegaconf_error(err)) from None
    except ValueError as err:  # from_dotlist: an argument without "="
        raise ConfigError(
            f"{err}: arguments are key=value (run=RUN tasks=a,b limit=N batch_size=N checkpoint=TAG)"
        ) from None
    if options.limit is not None and options.limit < 1:
        raise ConfigError(f"limit={options.limit} must be >= 1 (or leave it out: every document)")
    if options.batch_size < 1 or options.bootstrap_iters < 0:
        raise ConfigError("batch_size must be >= 1 and bootstrap_iters >= 0")
    if options.limit is not None and options.limit < launch.world_size():
        raise ConfigError(f"limit={options.limit} is below the {launch.world_size()} ranks: each rank needs a document")
    return options


@dataclass
class Source:
    model: torch.nn.Module
    tokenizer: object
    results: Path  # where the harness's JSON goes
    run_dir: Path | None = None  # a run's directory: metrics.jsonl and W&B get the results too
    step: int | None = None


def locate(options: Options) -> Path:
    """The Hugging Face directory or the checkpoint (checkpoints/<tag>) to evaluate: checked
    before anything is read."""
    path = Path(options.run)
    if (path / "config.json").is_file():
        if options.checkpoint:
            raise ConfigError(
                f"checkpoint={options.checkpoint}: run={path} is a Hugging Face model directory, not a run"
            )
        return path
    if not path.exists():
        raise ConfigError(f"run={options.run} does not exist")
    if options.checkpoint:
        tag_dir = path / "checkpoints" / options.checkpoint
        if not checkpoint.model_states_file(tag_dir):
            tags = sorted(p.name for p in (path / "checkpoints").glob("step_*") if checkpoint.model_states_file(p))
            raise ConfigError(
                f"checkpoint={options.checkpoint}: no such checkpoint in {path / 'checkpoints'} "
                f"(it has: {', '.join(tags) or 'none'})"
            )
        return tag_dir
    try:
        directory, tag = checkpoint.find(str(path), path / "checkpoints")
    except ConfigError:  # find's message is about run.resume: say it for this command
        raise ConfigError(
            f"run={options.run} is neither a Hugging Face model directory (no config.json) nor a run with "
            "a checkpoint: train with trainer.save_every=N, or point run= at a model directory"
        ) from None
    return directory / tag


def causal_only(masked: bool, what: Path) -> None:
    if masked:
        raise ConfigError(
            f"run={what} is a masked language model (BERT): lm-eval scores causal language models (GPT-2, Llama) only"
        )


def load_source(located: Path) -> Source:
    """The model in memory: a Hugging Face directory loaded, a checkpoint consolidated."""
    if (located / "config.json").is_file():
        from lmrepo.generate import load

        model, tokenizer, masked = load(located, torch.float32)
        causal_only(masked, located)
        return Source(model, tokenizer, located / "eval" / "model.json")
    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.export import consolidate

    whole = consolidate(str(located))
    causal_only(whole.config.family == "bert", located)
    run_dir = whole.tag_dir.parent.parent
    return Source(
        whole.model,
        load_tokenizer(whole.config.tokenizer, whole.config.pretrained),
        run_dir / "eval" / f"{whole.tag_dir.name}.json",
        run_dir,
        whole.step,
    )


def evaluate(options: Options) -> tuple[dict | None, Source, float]:
    """(the harness's results on rank 0 or None, the source, seconds of evaluation)."""
    from lmrepo.evaluation import run_tasks
    from lmrepo.evaluation.lm import LmrepoLM
    from lmrepo.evaluation.tasks import TaskSet

    located = locate(options)
    tasks = TaskSet(options.tasks)
    tasks.load()  # unknown names and unreachable data stop here, before the model is read
    source = load_source(located)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if launch.world_size() > 1:
        launch.init_distributed()
    lm = LmrepoLM(source.model.to(device).eval(), source.tokenizer, options.batch_size, device, show_progress=True)
    start = time.perf_counter()
    results = run_tasks(lm, tasks, options.limit, options.bootstrap_iters)
    return results, source, time.perf_counter() - start


def publish(results: dict, source: Source, options: Options) -> list[str]:
    """Rank 0: the JSON, the run's metrics lines and W&B summary; returns what was written."""
    from lmrepo.evaluation import metrics_of, records, write_results

    written = [str(write_results(results, source.results))]
    if source.run_dir is None:
        return written
    from lmrepo.observability.loggers import JsonlSink

    sink = JsonlSink(source.run_dir)
    for record in records(results, source.step):
        sink.log(record)
    sink.finish()
    written.append(str(source.run_dir / "metrics.jsonl"))
    if options.wandb and (source.run_dir / "wandb_run_id").is_file():
        update_wandb_summary(source.run_dir, metrics_of(results))
        written.append(f"the W&B run {(source.run_dir / 'wandb_run_id').read_text().strip()}'s summary")
    return written


def update_wandb_summary(run_dir: Path, metrics: dict) -> None:
    """Resumes the run's W&B run by its id, only to add to its summary (its config and history
    stay as training left them); offline when W&B cannot be reached, as training decides."""
    import wandb
    import yaml

    from lmrepo.observability.loggers.wandb_sink import resolve_mode, run_id

    logger = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["logger"]
    run = wandb.init(
        project=logger.get("project"),
        entity=logger.get("entity"),
        id=run_id(run_dir),
        resume="allow",
        dir=str(run_dir),
        mode=resolve_mode(logger.get("mode", "auto")),
        settings=wandb.Settings(init_timeout=60, console="off", silent=True),
    )
    run.summary.update(metrics)
    run.finish()


def main(argv: list[str]) -> None:
    quiet.install()  # before DeepSpeed's import: its accelerator notice asks nothing of the user
    argv = launch.strip_local_rank_arg(argv)
    try:
        options = parse_args(argv)
        results, source, seconds = evaluate(options)
    except ConfigError as err:
        exit_error(str(err))
    if results is not None:
        from lmrepo.evaluation import table

        print(table(results), end="")
        written = publish(results, source, options)
        print(
            f"lmrepo: evaluated in {seconds:.1f} s on {launch.world_size()} rank(s); wrote {', '.join(written)}",
            flush=True,
        )
    if launch.world_size() > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
