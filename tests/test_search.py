"""Hyperparameter search through the lmrepo launcher: a real Optuna study (hparams_search=lr_optuna,
hydra-optuna-sweeper) of 1-rank TINY trials in an sqlite storage, resumed by running the same
command again; each trial's value is the objective its job logged; scripts/compare.py's trials
table and plot; a direction that contradicts launcher.objective_mode is refused."""

import subprocess

import optuna
import pytest
import yaml

from harness import FORKED_PYTHON, REPO, TINY, read_metrics


def search(root, *overrides, timeout=900):
    return subprocess.run(
        [
            *FORKED_PYTHON,
            str(REPO / "train.py"),
            "hparams_search=lr_optuna",
            "launcher.ranks=1",
            *TINY,
            f"hydra.sweep.dir={root / 'study'}",
            *overrides,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """2 trials, then the same command with 1 more: one study of 3 trials (TINY fixes the warmup,
    so the learning rate alone is searched)."""
    root = tmp_path_factory.mktemp("search")
    first = search(root, "hydra.sweeper.n_trials=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    resumed = search(root, "hydra.sweeper.n_trials=1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    storage = f"sqlite:///{root / 'study' / 'optuna.db'}"
    return root / "study", optuna.load_study(study_name="lr_optuna", storage=storage)


def run_dirs(study_dir):
    """The trials' run directories, session by session (<date>_<time>/<job>)."""
    return [
        job for session in sorted(d for d in study_dir.iterdir() if d.is_dir()) for job in sorted(session.iterdir())
    ]


def test_each_trial_gets_its_jobs_objective(study):
    study_dir, study = study
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    by_lr = {t.params["optimizer.lr"]: t.value for t in trials}
    for run_dir in run_dirs(study_dir):
        lr = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"]
        evals = [m["eval_loss"] for m in read_metrics(run_dir) if "eval_loss" in m]
        assert by_lr[lr] == evals[-1]  # launcher.objective=eval_loss: the last evaluation, as a float
    assert len(set(by_lr)) == 3, "each trial sampled its own learning rate"


def test_running_the_study_again_continues_it(study):
    study_dir, study = study
    sessions = sorted(d for d in study_dir.iterdir() if d.is_dir())
    assert [len(list(s.iterdir())) for s in sessions] == [2, 1]  # the second session's job beside the first's
    assert [t.number for t in study.get_trials()] == [0, 1, 2]
    results = yaml.safe_load((study_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == study.best_value  # over both sessions


def test_compare_tables_and_plots_the_trials(study, tmp_path):
    study_dir, study = study
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "compare.py"), str(study_dir), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    markdown = (tmp_path / "compare.md").read_text()
    trials = markdown[markdown.index("### Study lr_optuna (minimize, 3 trials)") :]
    rows = [line.strip("|").split(" | ") for line in trials.splitlines() if line.startswith("| ")][1:]
    assert [(r[0].strip(), r[1], r[2]) for r in rows] == [
        (str(t.number), "complete", f"{t.value:.4g}") for t in study.get_trials()
    ]
    best = study.best_trial
    assert (
        f"best: trial {best.number}, objective {best.value:.4f}: optimizer.lr={best.params['optimizer.lr']:.4g}"
        in trials
    )
    assert (tmp_path / "trials_lr_optuna.png").read_bytes().startswith(b"\x89PNG")
    assert "and 6 plots" in proc.stdout  # five of the runs, one of the trials
    assert len([line for line in markdown.splitlines() if line.startswith("| ")]) == 1 + 3 + 1 + 3  # runs, trials


def test_a_direction_against_the_objective_mode_is_refused(tmp_path):
    proc = search(tmp_path, "launcher.objective_mode=max")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "lmrepo: error: hydra.sweeper.direction=minimize but "
        "launcher.objective_mode=max: set hydra.sweeper.direction=maximize "
        "(or the other objective_mode)"
    )
    assert not (tmp_path / "study" / "optuna.db").exists()


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (REPO / "conf" / "hparams_search").glob("*.yaml")))
def test_every_hparams_search_recipe_composes(recipe, tmp_path):
    """A recipe's sweeper, its direction against launcher.objective_mode, and a job with each
    searched key at its lowest value passing train.py's validation."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness import GPU, validate
    from lmrepo.plan.compose import compose_config

    compose_config()  # registers the schema and resolvers
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="train", overrides=[f"hparams_search={recipe}", f"run.dir={tmp_path}"], return_hydra_config=True
        )
    if recipe == "none":
        assert cfg.hydra.sweeper._target_.endswith("LmrepoSweeper")
        return
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.launcher.ranks == 2
    assert cfg.hydra.sweeper.direction == {"min": "minimize", "max": "maximize"}[cfg.launcher.objective_mode]
    assert cfg.hydra.sweeper.n_jobs == cfg.hydra.launcher.max_parallel  # trials asked at once: as many as run
    parser = OverridesParser.create()
    lowest = []
    for key, space in cfg.hydra.sweeper.params.items():
        value = parser.parse_override(f"{key}={space}").value()
        start = value.list[0] if hasattr(value, "list") else value.start
        lowest.append(f"{key}={start}")
    validate(compose_config([f"hparams_search={recipe}", *lowest]), cfg.launcher.ranks, GPU)
