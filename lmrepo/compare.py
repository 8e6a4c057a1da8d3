"""Compare finished runs: one row per job (from run directories on disk, or from W&B) as a
markdown table, plus loss, throughput and memory plots. Used by scripts/compare.py."""

import json
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# A directory is a run (a job) when it holds any of these; a job that died early may have one only.
RUN_MARKERS = (".hydra/config.yaml", "status.json", "metrics.jsonl", "error.txt")
COLUMNS = [
    "job",
    "final loss",
    "eval loss",
    "grad norm",
    "tokens/s",
    "TFLOP/s",
    "MFU",
    "peak mem GB",
    "steps",
    "wall s",
    "status",
]
# Columns only a mixture-of-experts job fills (shown when any job has them): column -> metrics key.
MOE_COLUMNS = {"aux loss": "aux_loss", "expert load max": "expert_load_max", "dropped frac": "dropped_frac"}
PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png", "memory.png", "lr_vs_step.png")


class CompareError(Exception):
    """A one-line reason the comparison cannot be made (the CLI prints it and exits 2)."""


@dataclass
class Job:
    label: str  # fallback name: where the job came from
    overrides: list[str] | None  # None when unknown (the job died before writing .hydra/)
    metrics: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    name: str = ""  # set by name_jobs: what differs from the other jobs


# ---- reading run directories ----


def find_run_dirs(root: Path) -> list[Path]:
    """Run dirs under `root` (itself included), in job order: 0, 1, ..., 10 (not 0, 1, 10)."""
    if any((root / marker).exists() for marker in RUN_MARKERS):
        return [root]  # don't descend: checkpoints/ and wandb/ inside a run are not jobs
    children = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]

    def natural(p: Path) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]

    return [run for child in sorted(children, key=natural) for run in find_run_dirs(child)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl lines; a torn last line (a killed job) is skipped, not fatal."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def read_status(run_dir: Path) -> dict:
    status = _read_json(run_dir / "status.json")
    if not status and (run_dir / "error.txt").exists():
        status = {"status": "failed", "error": (run_dir / "error.txt").read_text(errors="replace")}
    return status or {"status": "unknown"}


def load_run(run_dir: Path, label: str) -> Job:
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else None
    status = read_status(run_dir)
    # a job that died before training has no .hydra/: its launcher may have recorded the overrides
    overrides = overrides if overrides is not None else status.get("overrides")
    return Job(label, overrides, read_metrics(run_dir / "metrics.jsonl"), status)


def load_dirs(dirs: list[Path]) -> list[Job]:
    jobs = []
    for given in dirs:
        if not given.is_dir():
            raise CompareError(f"{given}: no such directory")
        root = given.resolve()
        runs = find_run_dirs(root)
        if not runs:
            raise CompareError(f"{given}: holds no run (no .hydra/config.yaml, status.json or metrics.jsonl)")
        # labelled relative to the DIR's parent ("sweep/0"), so two sweeps' job 0 stay apart
        jobs += [load_run(run, str(run.relative_to(root.parent))) for run in runs]
    return jobs


# ---- reading W&B ----


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_wandb(path: str) -> list[Job]:
    """Runs of ENTITY/PROJECT[/GROUP] from the W&B public API. W&B keeps the resolved config but
    not the command line, so a job's "overrides" are its flattened config values (name_jobs then
    keeps the ones that differ)."""
    parts = path.strip("/").split("/")
    if len(parts) not in (2, 3):
        raise CompareError(f"--wandb {path}: expected ENTITY/PROJECT or ENTITY/PROJECT/GROUP")
    import wandb

    try:
        api = wandb.Api(timeout=10)  # a short timeout: offline must fail, not hang
        runs = list(api.runs("/".join(parts[:2]), filters={"group": parts[2]} if len(parts) == 3 else {}))
        jobs = []
        for run in runs:
            config = {
                k: v
                for k, v in _flatten(dict(run.config)).items()
                if not k.startswith(("_", "ds_config.", "run.", "logger."))
            }
            history = [{**row, "step": row.get("_step")} for row in run.history(samples=100_000, pandas=False)]
            state = {"finished": "completed"}.get(run.state, run.state)
            jobs.append(
                Job(
                    run.name,
                    [f"{k}={v}" for k, v in config.items()],
                    history,
                    {"status": state, "wall_s": run.summary.get("_runtime")},
                )
            )
    except Exception as err:  # wandb raises many kinds (auth, network, usage): all mean "cannot read"
        raise CompareError(f"--wandb {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if not jobs:
        raise CompareError(f"--wandb {path}: no runs")
    return jobs


# ---- rows ----


def name_jobs(jobs: list[Job]) -> None:
    """A job's name is its overrides that not every job shares (`zero=stage2 offload=cpu`);
    the label when that is empty or unknown, or when two jobs would get the same name."""
    known = [set(job.overrides) for job in jobs if job.overrides is not None]
    common = set.intersection(*known) if len(known) > 1 else set()
    for job in jobs:
        job.name = " ".join(o for o in job.overrides or [] if o not in common) or job.label
    names = [job.name for job in jobs]
    for job in jobs:
        if names.count(job.name) > 1 and job.name != job.label:
            job.name = f"{job.name} ({job.label})"


def _series(metrics: list[dict], key: str) -> list[dict]:
    """The records carrying a value for `key`: training lines (loss) and eval lines (eval_loss)
    are separate in metrics.jsonl but merged into one row per step in W&B history."""
    return [m for m in metrics if m.get(key) is not None]


def summarize(job: Job) -> dict:
    train, evals = _series(job.metrics, "loss"), _series(job.metrics, "eval_loss")
    # the first logged step includes warm-up (allocation, kernel selection): leave it out
    steady = train[1:] or train

    def median(key):
        values = [m[key] for m in steady if m.get(key) is not None]
        return statistics.median(values) if values else None

    mem = [m["mem_gb"] for m in train if m.get("mem_gb") is not None]
    steps = [m["step"] for m in job.metrics if m.get("step") is not None]
    wall = job.status.get("wall_s") or (job.metrics[-1].get("elapsed_s") if job.metrics else None)
    return {
        "job": job.name,
        "final loss": train[-1]["loss"] if train else None,
        "eval loss": evals[-1]["eval_loss"] if evals else None,
        "grad norm": train[-1].get("grad_norm") if train else None,  # the last step's, before clipping
        # a mixture of experts' last step: load-balancing term, busiest expert over the mean, routes dropped
        **{column: train[-1].get(key) if train else None for column, key in MOE_COLUMNS.items()},
        "tokens/s": median("tokens_per_s"),
        "TFLOP/s": median("tflops"),
        "MFU": median("mfu"),
        "bubble": median("bubble"),  # pipelines: the fraction of the schedule no rank computed in
        "peak mem GB": max(mem) if mem else None,
        "steps": max(steps) if steps else None,
        "wall s": wall,
        "status": job.status.get("status", "unknown"),
        "error": job.status.get("error"),
        **downstream(job.metrics),
    }


def downstream(metrics: list[dict]) -> dict:
    """The latest value of each downstream task metric (`eval/<task>/<metric>`: eval.tasks during
    training, scripts/evaluate.py after it)."""
    return {k: v for m in metrics for k, v in m.items() if k.startswith("eval/") and v is not None}


# ---- the table ----

FORMATS = {
    "final loss": "{:.4f}",
    "eval loss": "{:.4f}",
    "grad norm": "{:.4g}",
    "aux loss": "{:.4g}",
    "expert load max": "{:.3f}",
    "dropped frac": "{:.2%}",
    "tokens/s": "{:.0f}",
    "TFLOP/s": "{:.4g}",
    "MFU": "{:.2%}",
    "bubble": "{:.2f}",
    "peak mem GB": "{:.2f}",
    "steps": "{}",
    "wall s": "{:.1f}",
}


def _cell(row: dict, column: str) -> str:
    value = row.get(column)  # a downstream column some jobs lack
    if column == "status" and row["error"]:
        error = " ".join(row["error"].split())  # one line in a table cell
        value = f"{value}: {error[:100]}{'…' if len(error) > 100 else ''}"
    text = "-" if value is None else FORMATS.get(column, "{:.4g}" if column.startswith("eval/") else "{}").format(value)
    return text.replace("|", "\\|")


def table_columns(rows: list[dict]) -> list[str]:
    """COLUMNS, with a column per downstream metric any job has after "eval loss", and the
    pipeline bubble after MFU when any job ran a pipeline that measures it, and the mixture-of-experts
    columns any job fills after "grad norm"."""
    tasks = sorted({k for row in rows for k in row if k.startswith("eval/")})
    moe = [c for c in MOE_COLUMNS if any(row.get(c) is not None for row in rows)]
    bubble = ["bubble"] if any(row.get("bubble") is not None for row in rows) else []
    at, norm, mfu = COLUMNS.index("eval loss") + 1, COLUMNS.index("grad norm") + 1, COLUMNS.index("MFU") + 1
    return COLUMNS[:at] + tasks + COLUMNS[at:norm] + moe + COLUMNS[norm:mfu] + bubble + COLUMNS[mfu:]


def markdown_table(rows: list[dict]) -> str:
    columns = table_columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row, c) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- the plots ----


def _save(fig, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Figures use matplotlib's constrained layout, which makes room for long job names instead of
    warning that tight_layout could not; the legend goes below the axes, not over the lines."""
    ax = fig.axes[0]
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=2 if len(labels) > 4 else 1, fontsize="small")
    fig.savefig(path, dpi=100)


def plot_losses(jobs: list[Job], out: Path, x: str, filename: str, xlabel: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    for job in jobs:
        train, evals = _series(job.metrics, "loss"), _series(job.metrics, "eval_loss")
        train, evals = [m for m in train if m.get(x) is not None], [m for m in evals if m.get(x) is not None]
        if train:
            (line,) = ax.plot([m[x] for m in train], [m["loss"] for m in train], label=job.name)
            color = line.get_color()  # eval loss in the job's colour, dashed
        else:
            color = None
        if evals:
            ax.plot(
                [m[x] for m in evals],
                [m["eval_loss"] for m in evals],
                "--o",
                color=color,
                markersize=3,
                label=f"{job.name} (eval)",
            )
    _save(fig, out / filename, f"loss vs {xlabel}", xlabel, "loss")
    plt.close(fig)


def plot_lr(jobs: list[Job], out: Path, filename: str) -> None:
    """Each job's learning rate per step as a fraction of its peak: what tells schedules (cosine,
    wsd's stable and decay phases) apart when their losses are compared, on one scale whatever
    the optimizer's rate (Muon's jobs log its hidden matrices' rate, on another scale than AdamW's)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for job in jobs:
        train = [m for m in _series(job.metrics, "lr") if m.get("step") is not None]
        peak = max((m["lr"] for m in train), default=0)
        if peak > 0:
            ax.plot([m["step"] for m in train], [m["lr"] / peak for m in train], label=job.name)
    _save(fig, out / filename, "learning rate vs step", "step", "learning rate / its peak")
    plt.close(fig)


def plot_bars(rows: list[dict], out: Path, column: str, filename: str, ylabel: str) -> None:
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row[column] is not None]  # a job that never logged has no bar
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shown) + 2), 5), layout="constrained")
    ax.bar(range(len(shown)), [row[column] for row in shown])
    ax.set_xticks(range(len(shown)), [row["job"] for row in shown], rotation=20, ha="right", fontsize="small")
    _save(fig, out / filename, f"{ylabel} per job", "", ylabel)
    plt.close(fig)


# ---- everything ----


def report(jobs: list[Job], out: Path) -> str:
    """Writes out/compare.md and the plots (PLOTS); returns the table."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    name_jobs(jobs)
    rows = [summarize(job) for job in jobs]
    table = markdown_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(table)
    plot_losses(jobs, out, "step", PLOTS[0], "step")
    plot_losses(jobs, out, "elapsed_s", PLOTS[1], "wall time (s)")
    plot_bars(rows, out, "tokens/s", PLOTS[2], "tokens/s (median)")
    plot_bars(rows, out, "peak mem GB", PLOTS[3], "peak memory (GB)")
    plot_lr(jobs, out, PLOTS[4])
    return table


# ---- a search's trials (Optuna) ----

STUDY_FILE = "optuna.db"  # where conf/hparams_search/ recipes keep their study: the search's sweep dir


def load_studies(dirs: list[Path]) -> list:
    """Every Optuna study kept in DIR/optuna.db, for each DIR given that has one."""
    urls = [f"sqlite:///{(d / STUDY_FILE).resolve()}" for d in dirs if (d / STUDY_FILE).is_file()]
    if not urls:
        return []
    import optuna

    from lmrepo.quiet import OPTUNA_SWEEPER_DEPRECATIONS

    # The sweeper stored Optuna's deprecated distributions: reading them back warns, for nothing to change.
    warnings.filterwarnings("ignore", message=OPTUNA_SWEEPER_DEPRECATIONS, category=FutureWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return [optuna.load_study(study_name=name, storage=url) for url in urls for name in optuna.get_all_study_names(url)]


def _best_trial(study):
    try:
        return study.best_trial
    except ValueError:  # no trial completed
        return None


def _param(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def trials_table(study, plot: str) -> str:
    """One row per trial: its number, state, objective (the value the launcher returned) and
    sampled params; then the best trial and the plot."""
    trials = study.get_trials(deepcopy=False)
    params = sorted({name for trial in trials for name in trial.params})
    columns = ["trial", "state", "objective", *params]
    lines = [
        f"\n### Study {study.study_name} ({study.direction.name.lower()}, {len(trials)} trials)\n",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for trial in trials:
        cells = [
            str(trial.number),
            trial.state.name.lower(),
            _param(trial.value),
            *(_param(trial.params.get(p)) for p in params),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    best = _best_trial(study)
    lines.append(
        "\nbest: "
        + (
            f"trial {best.number}, objective {best.value:.4f}: "
            + " ".join(f"{k}={_param(v)}" for k, v in best.params.items())
            if best
            else "none (no trial completed)"
        )
    )
    return "\n".join(lines) + f"\n\n![trials]({plot})\n"


def plot_trials(study, out: Path, filename: str) -> None:
    """The objective of each completed trial, the best so far, and the failed trials."""
    import itertools

    import matplotlib.pyplot as plt

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.value is not None]
    pick = max if study.direction.name == "MAXIMIZE" else min
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    ax.plot([t.number for t in done], [t.value for t in done], "o", label="trial")
    ax.step(
        [t.number for t in done],
        list(itertools.accumulate([t.value for t in done], pick)),
        where="post",
        label="best so far",
    )
    for i, trial in enumerate(t for t in trials if t.state.name == "FAIL"):
        ax.axvline(trial.number, color="red", alpha=0.3, label=None if i else "failed")
    _save(fig, out / filename, f"study {study.study_name}: objective per trial", "trial", "objective")
    plt.close(fig)


def trials_report(dirs: list[Path], out: Path) -> list[str]:
    """For each study in the DIRs: its table appended to out/compare.md, and trials_<study>.png."""
    blocks = []
    for study in load_studies(dirs):
        plot = f"trials_{study.study_name}.png"
        plot_trials(study, out, plot)
        blocks.append(trials_table(study, plot))
    if blocks:
        with open(out / "compare.md", "a") as f:
            f.write("".join(blocks))
    return blocks
