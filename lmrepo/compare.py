"""Compare finished runs: one row per job (from run directories on disk, or from W&B) as a
markdown table, the differences between the jobs that the sweep did not ask for, and plots of
loss, learning rate, throughput and memory. Used by scripts/compare.py and by the sweep
launcher's summary. Every figure is computed by lmrepo.observability.figures, as in the done line and W&B."""

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmrepo.observability.figures import DEFINITIONS, read_metrics, run_figures, throughput_text

__all__ = ["read_metrics"]  # re-exported: the launcher and the benchmarks read metrics.jsonl through here

# A directory is a run (a job) when it holds any of these; a job that died early may have one only.
RUN_MARKERS = (".hydra/config.yaml", "status.json", "metrics.jsonl", "error.txt")
TOKENS = "tokens/s (steady) [range]"
COLUMNS = [
    "job",
    "final loss",
    "eval loss",
    "grad norm",
    TOKENS,
    "TFLOP/s (steady)",
    "MFU (steady)",
    "peak mem GB (rank 0)",
    "steps",
    "wall s",
    "status",
]
BUBBLE = "bubble (median)"
# Columns only a mixture-of-experts job fills (shown when any job has them): column -> metrics key.
MOE_COLUMNS = {"aux loss": "aux_loss", "expert load max": "expert_load_max", "dropped frac": "dropped_frac"}
PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png", "memory.png", "lr_vs_step.png")
# Config keys that say where or how a job was recorded, not what it trained: never a difference.
NOT_TRAINING = ("run.", "logger.", "launcher.objective", "eval.limit")


class CompareError(Exception):
    """A one-line reason the comparison cannot be made (the CLI prints it and exits 2)."""


@dataclass
class Job:
    label: str  # fallback name: where the job came from
    overrides: list[str] | None  # None when unknown (the job died before writing .hydra/)
    metrics: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    name: str = ""  # set by name_jobs: what differs from the other jobs
    # What the job trained with, flattened ("zero.stage": 2), autos resolved, plus the derived batch
    # and the ranks and machine it ran on: what unswept_differences compares. None when unknown.
    settings: dict | None = None


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


def read_status(run_dir: Path) -> dict:
    status = _read_json(run_dir / "status.json")
    if not status and (run_dir / "error.txt").exists():
        status = {"status": "failed", "error": (run_dir / "error.txt").read_text(errors="replace")}
    return status or {"status": "unknown"}


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_settings(run_dir: Path, status: dict) -> dict | None:
    """The job's resolved config (.hydra/config.yaml: precision=auto's choice, the warmup, ...),
    the batch DeepSpeed was given (ds_config.json) and status.json's `setting` (ranks, device)."""
    config_file = run_dir / ".hydra" / "config.yaml"
    if not config_file.exists():
        return None
    settings = {k: v for k, v in _flatten(yaml.safe_load(config_file.read_text()) or {}).items() if v is not None}
    ds = _read_json(run_dir / "ds_config.json")
    for key, name in (
        ("train_batch_size", "global batch"),
        ("train_micro_batch_size_per_gpu", "micro batch"),
        ("gradient_accumulation_steps", "grad accum"),
    ):
        if key in ds:
            settings[name] = ds[key]
    for key, value in (status.get("setting") or {}).items():
        settings[key] = value
    # Each config group's option (`zero` -> stage3): one line says what a group's many keys differ by.
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if hydra_file.exists():
        choices = ((yaml.safe_load(hydra_file.read_text()) or {}).get("hydra", {}).get("runtime") or {}).get("choices")
        settings.update({k: v for k, v in (choices or {}).items() if "/" not in k and v is not None})
    return settings


def load_run(run_dir: Path, label: str) -> Job:
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else None
    status = read_status(run_dir)
    # a job that died before training has no .hydra/: its launcher may have recorded the overrides
    overrides = overrides if overrides is not None else status.get("overrides")
    return Job(
        label, overrides, read_metrics(run_dir / "metrics.jsonl"), status, settings=run_settings(run_dir, status)
    )


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
                    settings=config,
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
    """The job's row: the table's columns (lmrepo.observability.figures computes each), plus the spread of its
    throughput, its error and its setting."""
    figures = run_figures(job.metrics)
    train = _series(job.metrics, "loss")
    wall = job.status.get("wall_s") or (job.metrics[-1].get("elapsed_s") if job.metrics else None)
    return {
        "job": job.name,
        "final loss": figures["loss"],
        "eval loss": figures["eval_loss"],
        "grad norm": figures["grad_norm"],
        # a mixture of experts' last step: load-balancing term, busiest expert over the mean, routes dropped
        **{column: train[-1].get(key) if train else None for column, key in MOE_COLUMNS.items()},
        TOKENS: figures["tokens_per_s"],
        "tokens/s min": figures["tokens_per_s_min"],
        "tokens/s max": figures["tokens_per_s_max"],
        "TFLOP/s (steady)": figures["tflops"],
        "MFU (steady)": figures["mfu"],
        BUBBLE: figures["bubble"],
        "peak mem GB (rank 0)": figures["mem_gb"],
        "steps": figures["step"],
        "wall s": wall,
        "status": job.status.get("status", "unknown"),
        "error": job.status.get("error"),
        "setting": setting(job),
        **downstream(job.metrics),
    }


def downstream(metrics: list[dict]) -> dict:
    """The latest value of each downstream task metric (`eval/<task>/<metric>`: eval.tasks during
    training, scripts/evaluate.py after it)."""
    return {k: v for m in metrics for k, v in m.items() if k.startswith("eval/") and v is not None}


# ---- what differs without being swept ----


def swept_keys(jobs: list[Job]) -> set[str]:
    """The keys of the overrides that not every job shares: what the sweep varies (`zero` for
    zero=stage2, `model.moe.top_k` for model.moe.top_k=2)."""
    known = [set(job.overrides) for job in jobs if job.overrides is not None]
    common = set.intersection(*known) if known else set()
    return {o.split("=", 1)[0].lstrip("+~") for job in jobs for o in job.overrides or [] if o not in common}


# Settings a job's config does not hold as such, and the key that sets each: what the sweep must
# vary for a difference in it to be asked for (the batch DeepSpeed got, the ranks it ran on).
SOURCES = {
    "global batch": "trainer.global_batch_size",
    "micro batch": "trainer.micro_batch_size",
    "grad accum": "trainer.grad_accum",
    "ranks": "launcher.ranks",
}


def _covered(key: str, swept: set[str]) -> bool:
    """Whether a sweep over `swept` explains a difference in `key`: the key itself, or its group
    (`zero` covers zero.stage); the batch DeepSpeed got and the ranks, the key that sets them."""
    key = SOURCES.get(key, key)
    return any(key == s or key.startswith(s + ".") for s in swept)


def unswept_differences(jobs: list[Job], limit: int = 6) -> list[str]:
    """One line per setting in which the jobs differ although the sweep did not vary it: an
    engine's own default ZeRO stage, precision=auto's choice on another device, a derived batch,
    another machine. Jobs whose settings are unknown (refused before training) are left out."""
    known = [job for job in jobs if job.settings is not None]
    if len(known) < 2:
        return []
    swept = swept_keys(jobs)
    keys = sorted({k for job in known for k in job.settings}, key=lambda k: ("." in k, k))  # groups first
    lines, differing = [], set()
    for key in keys:
        if any(key == p.rstrip(".") or key.startswith(p) for p in NOT_TRAINING) or _covered(key, swept):
            continue
        if key.split(".")[0] in differing:
            continue  # its group's option differs: that line says it
        values = {}
        for job in known:
            values.setdefault(_value_text(job.settings.get(key)), []).append(job.name)
        if len(values) < 2:
            continue
        differing.add(key)
        fix = (
            ""
            if key in ("machine", "device")
            else f": set {SOURCES.get(key, key)}= for every job to compare like for like"
        )
        parts = [
            f"{value} ({', '.join(names[:limit])}{', ...' if len(names) > limit else ''})"
            for value, names in values.items()
        ]
        lines.append(f"{key} differs although the sweep did not vary it: {'; '.join(parts)}{fix}")
    return lines


def _value_text(value) -> str:
    return "unset" if value is None else str(value)


def setting(job: Job) -> dict:
    """What a bar chart says about the run: ranks, precision, engine (with its ZeRO stage), machine."""
    s = job.settings or {}
    engine = s.get("engine.name")
    return {
        "ranks": s.get("ranks"),
        "precision": s.get("precision.dtype"),
        "engine": f"{engine} ZeRO-{s['zero.stage']}" if engine and s.get("zero.stage") is not None else engine,
        "machine": s.get("machine"),
    }


def setting_text(values: dict) -> str:
    parts = []
    if values.get("ranks") is not None:
        parts.append(f"{values['ranks']} rank{'s' if values['ranks'] != 1 else ''}")
    parts += [str(values[k]) for k in ("precision", "engine", "machine") if values.get(k)]
    return ", ".join(parts)


# ---- the table ----

FORMATS = {
    "final loss": "{:.4f}",
    "eval loss": "{:.4f}",
    "grad norm": "{:.4g}",
    "aux loss": "{:.4g}",
    "expert load max": "{:.3f}",
    "dropped frac": "{:.2%}",
    "TFLOP/s (steady)": "{:.4g}",
    "MFU (steady)": "{:.2%}",
    BUBBLE: "{:.2f}",
    "peak mem GB (rank 0)": "{:.2f}",
    "steps": "{}",
    "wall s": "{:.1f}",
}


def cell(row: dict, column: str) -> str:
    """A value as the tables write it (the markdown table and the sweep's summary alike)."""
    value = row.get(column)  # a downstream column some jobs lack
    if column == TOKENS:
        text = throughput_text(
            {
                "tokens_per_s": value,
                "tokens_per_s_min": row.get("tokens/s min"),
                "tokens_per_s_max": row.get("tokens/s max"),
            }
        )
    elif column == "status" and row["error"]:
        error = " ".join(row["error"].split())  # one line in a table cell
        text = f"{value}: {error[:100]}{'…' if len(error) > 100 else ''}"
    else:
        fmt = FORMATS.get(column, "{:.4g}" if column.startswith("eval/") else "{}")
        text = "-" if value is None else fmt.format(value)
    return text.replace("|", "\\|")


def table_columns(rows: list[dict]) -> list[str]:
    """COLUMNS, with a column per downstream metric any job has after "eval loss", and the
    pipeline bubble after MFU when any job ran a pipeline that measures it, and the mixture-of-experts
    columns any job fills after "grad norm"."""
    tasks = sorted({k for row in rows for k in row if k.startswith("eval/")})
    moe = [c for c in MOE_COLUMNS if any(row.get(c) is not None for row in rows)]
    bubble = [BUBBLE] if any(row.get(BUBBLE) is not None for row in rows) else []
    at, norm, mfu = COLUMNS.index("eval loss") + 1, COLUMNS.index("grad norm") + 1, COLUMNS.index("MFU (steady)") + 1
    return COLUMNS[:at] + tasks + COLUMNS[at:norm] + moe + COLUMNS[norm:mfu] + bubble + COLUMNS[mfu:]


def markdown_table(rows: list[dict]) -> str:
    columns = table_columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row, c) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def definitions(columns: list[str]) -> str:
    """The meaning of each figure the table shows, in lmrepo.observability.figures' words."""
    lines = [f"- **{c}**: {DEFINITIONS[c]}" for c in columns if c in DEFINITIONS]
    return "How each figure is computed:\n\n" + "\n".join(lines) + "\n"


# ---- the plots ----

# Close runs stay apart in black and white too: each job its own colour, line style and marker.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def style(i: int, jobs: int, points: int) -> dict:
    """Job i's colour, line style and marker; about a dozen markers a curve, each job's at other
    points than the others', so that equal curves still show every job's."""
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    every = max(jobs, points // 12, 1)
    return {
        "color": colours[i % len(colours)],
        "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
        "marker": MARKERS[i % len(MARKERS)],
        "markersize": 5,
        "markevery": (i % every, every),
    }


def _finish(fig, path: Path, title: str) -> None:
    """Figures use matplotlib's constrained layout, and the legend goes outside the axes, to their
    right, where it covers neither a curve nor an axis label."""
    fig.suptitle(title)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.savefig(path, dpi=110)


def plot_losses(jobs: list[Job], out: Path, x: str, filename: str, xlabel: str) -> None:
    """Training loss per job (eval loss as hollow markers in the job's colour). Against the step,
    a second panel shows each job's loss minus the first job's at the same step: runs within a
    line's width of each other apart."""
    import matplotlib.pyplot as plt

    by_step = x == "step"
    rows = 2 if by_step and len(jobs) > 1 else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(10, 6 if rows == 2 else 5),
        sharex=True,
        layout="constrained",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2][:rows]},
    )
    ax = axes[0][0]
    baseline = None
    for i, job in enumerate(jobs):
        train = [m for m in _series(job.metrics, "loss") if m.get(x) is not None]
        evals = [m for m in _series(job.metrics, "eval_loss") if m.get(x) is not None]
        look = style(i, len(jobs), len(train))
        if train:
            ax.plot([m[x] for m in train], [m["loss"] for m in train], label=job.name, **look)
        if evals:
            ax.plot(
                [m[x] for m in evals],
                [m["eval_loss"] for m in evals],
                linestyle="none",
                marker=look["marker"],
                markersize=8,
                markerfacecolor="none",
                color=look["color"],
                label=f"{job.name} (eval)",
            )
        if rows == 2 and train:
            if baseline is None:
                baseline = (job.name, {m["step"]: m["loss"] for m in train})
            shared = [m for m in train if m["step"] in baseline[1]]
            axes[1][0].plot([m["step"] for m in shared], [m["loss"] - baseline[1][m["step"]] for m in shared], **look)
    ax.set(ylabel="loss")
    if rows == 2:
        axes[1][0].axhline(0, color="black", linewidth=0.6)
        axes[1][0].set(ylabel=f"loss - {baseline[0] if baseline else 'first job'}"[:60])
    axes[-1][0].set(xlabel=xlabel)
    _finish(fig, out / filename, f"loss vs {xlabel} (eval loss: hollow markers)")
    plt.close(fig)


def plot_lr(jobs: list[Job], out: Path, filename: str) -> None:
    """Each job's learning rate per step as a fraction of its peak: what tells schedules (cosine,
    wsd's stable and decay phases) apart when their losses are compared, on one scale whatever
    the optimizer's rate (Muon's jobs log its hidden matrices' rate, on another scale than AdamW's)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    for i, job in enumerate(jobs):
        train = [m for m in _series(job.metrics, "lr") if m.get("step") is not None]
        peak = max((m["lr"] for m in train), default=0)
        if peak > 0:
            ax.plot(
                [m["step"] for m in train],
                [m["lr"] / peak for m in train],
                label=job.name,
                **style(i, len(jobs), len(train)),
            )
    ax.set(xlabel="step", ylabel="learning rate / its peak")
    _finish(fig, out / filename, "learning rate vs step")
    plt.close(fig)


def plot_bars(rows: list[dict], out: Path, column: str, filename: str, ylabel: str, spread=None) -> None:
    """One bar per job with its value written on it (and the spread as an error bar); the setting
    the jobs share (ranks, precision, engine, machine) under the title, what differs per job under
    its name."""
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row[column] is not None]  # a job that never logged has no bar
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(shown) + 3), 5.5), layout="constrained")
    values = [row[column] for row in shown]
    yerr = None
    if spread and shown:
        low, high = spread
        yerr = [
            [v - (row[low] if row[low] is not None else v) for v, row in zip(values, shown)],
            [(row[high] if row[high] is not None else v) - v for v, row in zip(values, shown)],
        ]
    ax.bar(range(len(shown)), values, yerr=yerr, capsize=6, color="#4c72b0", ecolor="#333333")
    for i, (value, row) in enumerate(zip(values, shown)):  # each value above its bar and its error bar
        top = value + (yerr[1][i] if yerr else 0)
        text = cell(row, column).split(" ")[0]
        ax.annotate(text, (i, top), xytext=(0, 6), textcoords="offset points", ha="center", fontsize="small")
    settings = [row["setting"] for row in shown]
    shared = {k: settings[0][k] for k in settings[0]} if settings else {}
    shared = {k: v for k, v in shared.items() if all(s.get(k) == v for s in settings)}
    names = []
    for row, s in zip(shown, settings):
        own = setting_text({k: v for k, v in s.items() if k not in shared})
        names.append(row["job"] + (f"\n{own}" if own else ""))
    ax.set_xticks(
        range(len(shown)),
        names,
        rotation=15 if len(shown) > 3 else 0,
        ha="right" if len(shown) > 3 else "center",
        fontsize="small",
    )
    ax.set(ylabel=ylabel)
    ax.margins(y=0.15)
    subtitle = setting_text(shared)
    fig.suptitle(f"{ylabel} per job" + (f"\n{subtitle}" if subtitle else ""), fontsize="medium")
    fig.savefig(out / filename, dpi=110)
    plt.close(fig)


# ---- everything ----


def report(jobs: list[Job], out: Path) -> tuple[str, list[str]]:
    """Writes out/compare.md (the table, what each figure means, the unswept differences and the
    plots) and the plots (PLOTS); returns the table and the difference lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    name_jobs(jobs)
    rows = [summarize(job) for job in jobs]
    table = markdown_table(rows)
    differences = unswept_differences(jobs)
    out.mkdir(parents=True, exist_ok=True)
    plot_losses(jobs, out, "step", PLOTS[0], "step")
    plot_losses(jobs, out, "elapsed_s", PLOTS[1], "seconds since training began")
    plot_bars(rows, out, TOKENS, PLOTS[2], "tokens/s (steady)", spread=("tokens/s min", "tokens/s max"))
    plot_bars(rows, out, "peak mem GB (rank 0)", PLOTS[3], "peak memory GB (rank 0)")
    plot_lr(jobs, out, PLOTS[4])
    text = [table, "\n", definitions(table_columns(rows))]
    if differences:
        text += ["\nNot like for like:\n\n", *(f"- {line}\n" for line in differences)]
    titles = ("loss vs step", "loss vs time", "tokens/s", "peak memory", "learning rate vs step")
    text += ["\n", *(f"![{title}]({plot})\n\n" for title, plot in zip(titles, PLOTS))]
    (out / "compare.md").write_text("".join(text))
    return table, differences


# ---- a search's trials (Optuna) ----

STUDY_FILE = "optuna.db"  # where conf/hparams_search/ recipes keep their study: the search's sweep dir


def load_studies(dirs: list[Path]) -> list:
    """Every Optuna study kept in DIR/optuna.db, for each DIR given that has one."""
    urls = [f"sqlite:///{(d / STUDY_FILE).resolve()}" for d in dirs if (d / STUDY_FILE).is_file()]
    if not urls:
        return []
    import optuna

    from lmrepo.utils.quiet import OPTUNA_SWEEPER_DEPRECATIONS

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
    ax.set(xlabel="trial", ylabel="objective")
    _finish(fig, out / filename, f"study {study.study_name}: objective per trial")
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
