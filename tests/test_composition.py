"""Every pair of techniques, together: refused by a row of the rules table (lmrepo/plan/rules.py)
with its reason, or run on 2 CPU ranks and compared with the run it claims to equal
(tests/composition.py says which, and how). All the pairs run in one launch
(tests/probes/composition_probe.py: the ranks start once, then build, step and drop one configuration
after another); each pair is its own test here.

Tolerances, from the arithmetic of a few AdamW steps of a tiny model:
- fp32, another reduction order (sharded, pipelined, tensor-parallel sums): the losses agree to
  ~1e-6 relative (measured up to 3.3e-6 over 5 steps, shared/DESIGN.md); held to 2e-5. The first
  step's gradient norm sums the squares of the model's gradient elements in another order and
  partition, in float32 in DeepSpeed's engines: with GPT-2's 50,257-token vocabulary (3.3M
  elements; a CPU's float32 norm of the embedding alone is off by up to 6e-5) ZeRO-3 against
  ZeRO-0 measured 3.1e-5 apart; held to 1e-4. Later norms drift by up to 4e-4 (that sum's error,
  and Adam's amplification of rounding), held to 2e-3. The base model now has GPT-2's bytes for a
  vocabulary (125k elements): every fp32 pair without Muon measured within 2.4e-7 (losses) and
  5.6e-7 (norms), and the tolerances were kept. engine=fsdp2 sums in float64: its layouts agree far closer
  (tests/test_fsdp2.py's LAYOUT_FP32). A gradient off by any factor the bugs of this
  kind make (x2 per rank, a lost side loss, a norm over one shard: 21%) is far outside.
- bf16: one rounding of a bf16 value is 2^-8 = 0.4% relative; losses and the first norm of two
  bf16 runs (or of bf16 against fp32) differ by a few of those: held to 2e-2 (losses) and 3e-2
  (first norm). A norm 21% low still fails.
"""

import json
import subprocess

import pytest

import composition
from harness import REPO, launcher
from lmrepo.plan import rules
from lmrepo.plan.compose import compose_config
from lmrepo.plan.job import plan
from lmrepo.plan.rules import AXES
from lmrepo.utils.errors import ConfigError

FP32 = {"loss": 2e-5, "first_norm": 1e-4, "norm": 2e-3}
BF16 = {"loss": 2e-2, "first_norm": 3e-2, "norm": None}
# The losses after a Muon update, in a pair with Muon that claims equality. DeepSpeed's
# Newton-Schulz iteration runs in bf16: two runs whose gradients differ by fp32 rounding round some
# of its values differently, and their updates then differ by up to 2^-8 (0.4%). The loss moves by
# up to that fraction of what Muon's update moves it: ~0.05 of the 5.5 a step here (half of the
# step's ~0.1), 4e-5 relative a step, 1e-4 over the two updates (measured: 2.9e-5 under ZeRO-3 and
# offload, 4.6e-6 compiled, 1.6e-6 sequence-parallel). A gradient off by a factor moves the AdamW half
# (embeddings, norms) by percents, and Muon's first step, before any update, is held to FP32.
MUON_UPDATED_LOSS = 1e-4
PAIRS = composition.pairs()
ALLOWED = composition.probed_pairs()  # the allowed pairs but those run ELSEWHERE


def refusal(words: list[str]) -> ConfigError | None:
    """The refusal of this job on 2 ranks (its message, and the rules table's row that made it), or
    None when it is allowed."""
    from lmrepo.distributed.device import detect_device

    try:
        plan(compose_config(words), 2, detect_device("cpu"))
    except ConfigError as err:
        return err
    return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return composition.short_documents(tmp_path_factory.mktemp("paragraphs") / "paragraphs.jsonl")


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus) -> dict:
    """One launch on 2 ranks runs every allowed pair and every reference, on the short documents."""
    out = tmp_path_factory.mktemp("composition")
    cases = composition.matrix_cases(ALLOWED, corpus)
    cases_file = out / "cases.json"
    cases_file.write_text(json.dumps(cases))
    proc = subprocess.run(
        [
            *launcher(2),
            str(REPO / "tests" / "probes" / "composition_probe.py"),
            str(out / "results.json"),
            str(out / "cases.json"),
        ],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    found = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    if proc.returncode != 0:
        found["__launch__"] = {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return found


def compiled_by(words: list[str]) -> str:
    """What the probe finds compiled a case (composition.py chooses the backend), or none:
    aot_eager_decomp_partition shows as aot_eager (AOTAutograd without inductor's kernels: dynamo's
    counters tell no more)."""
    if "trainer.compile=true" not in words:
        return "none"
    backend = next((w.split("=", 1)[1] for w in words if w.startswith("trainer.compile_backend=")), "inductor")
    return "aot_eager" if backend == "aot_eager_decomp_partition" else backend


def close(ours: float, theirs: float, rel: float) -> bool:
    return abs(ours - theirs) <= rel * abs(theirs)


REFUSED = [pair for pair in PAIRS if frozenset(pair) in rules.pair_rules()]


@pytest.mark.parametrize("a, b", REFUSED, ids=[f"{a}+{b}" for a, b in REFUSED])
def test_refused_pair(a, b):
    """Refused by the pair's own row (not an earlier one, nor a check outside the table): the line a
    user reads is that row's, with its reason in docs/reference/composition.md."""
    rule = rules.pair_rules()[frozenset((a, b))]
    refused = refusal(composition.overrides(a, b))
    assert refused is not None and getattr(refused, "rule", None) is rule, (a, b, str(refused))


def test_a_pair_tested_elsewhere_runs_there():
    """A pair the matrix marks tested in another file (it needs more ranks) is one of that file's
    layouts, both techniques on as the matrix turns them on."""
    import test_fsdp2

    layouts = {
        frozenset(("torch_pipeline", "autotp")): test_fsdp2.PP_TP_4,
        frozenset(("torch_pipeline", "sequence_parallel")): test_fsdp2.PP_SP_DS_4,
    }
    assert set(layouts) == set(composition.ELSEWHERE)
    for pair, layout in layouts.items():
        assert set(composition.pair_overrides(*sorted(pair))) <= set(layout), (pair, layout)
        assert plan_config(list(layout)).pipeline.schedule != "none" and all(
            AXES[a].on(plan_config(list(layout))) for a in pair
        )


UNDER_FSDP2 = sorted(tuple(sorted(pair)) for pair in composition.UNDER_FSDP2)


@pytest.mark.parametrize("a, b", UNDER_FSDP2, ids=[f"{a}+{b}" for a, b in UNDER_FSDP2])
def test_a_pair_fsdp2_runs_is_refused_on_deepspeed_naming_fsdp2(a, b):
    """A pair the matrix runs under engine=fsdp2 only is one line on DeepSpeed's engine (a row of
    the rules table, with its reason), and the line names engine=fsdp2."""
    refused = refusal(composition.overrides(a, b))
    assert refused is not None and getattr(refused, "rule", None) in rules.RULES, (a, b)
    assert "engine=fsdp2" in str(refused), str(refused)


@pytest.mark.distributed
@pytest.mark.parametrize("a, b", ALLOWED, ids=[f"{a}+{b}" for a, b in ALLOWED])
def test_pair(a, b, results, corpus):
    words = composition.pair_overrides(a, b)
    assert "__launch__" not in results or composition.case_name([*words, *corpus]) in results, results.get("__launch__")
    ours = results[composition.case_name([*words, *corpus])]
    ref_words, kind = composition.reference(a, b)
    theirs = results[composition.case_name([*ref_words, *corpus])]
    for run, run_words, name in ((ours, words, "pair"), (theirs, ref_words, "reference")):
        assert "losses" in run, f"{name} {' '.join(run_words)}: {run}"
        assert run["compiled_by"] == compiled_by(run_words), (name, run_words, run["compiled_by"])
    if {a, b} == {"compile", "activation_checkpointing"}:
        # the checkpointed blocks traced into the model's one graph (DeepSpeed's checkpoint, which turns
        # torch.compile off inside it, broke it into 5: the embeddings, the head, no block)
        assert ours["graphs"] == 1, ours
    tolerance = BF16 if "bf16" in (a, b) or kind == "bf16" else FP32
    steps = 1 if kind == "step1" else len(ours["losses"])
    for step in range(steps):
        rel = tolerance["loss"]
        if "muon" in (a, b) and step > 0:
            rel = max(rel, MUON_UPDATED_LOSS)
        assert close(ours["losses"][step], theirs["losses"][step], rel), (step, ours, theirs)
    first, reference_first = ours["grad_norms"][0], theirs["grad_norms"][0]
    if first is not None and reference_first is not None:  # Muon under ZeRO logs no gradient norm
        assert close(first, reference_first, tolerance["first_norm"]), (ours, theirs)
        if tolerance["norm"] and kind != "step1":
            for step in range(1, steps):
                assert close(ours["grad_norms"][step], theirs["grad_norms"][step], tolerance["norm"]), (
                    step,
                    ours,
                    theirs,
                )


def plan_config(words: list[str]):
    """The loaded config of a refused job (the row's message is made from it)."""
    from lmrepo.config import load

    return load(compose_config(words))


def test_every_axis_turns_its_technique_on():
    for name, axis in AXES.items():
        config = plan_config(composition.overrides(name))
        assert axis.on(config), name
        assert not axis.on(plan_config(composition.BASE)), name


def test_the_matrix_page_is_current():
    """docs/reference/composition.md is what scripts/composition_matrix.py makes of the rules table
    and tests/composition.py now: regenerate it with `python scripts/composition_matrix.py --write`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("composition_matrix", REPO / "scripts" / "composition_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    assert matrix.PAGE.read_text() == matrix.page(), "run: python scripts/composition_matrix.py --write"
    assert matrix.counts()["untested"] == 0
