"""How evenly a mixture of experts spreads its tokens over a few hundred steps, side by side in one
run: no balancing, the load-balancing loss (Switch/GShard, model.moe.balance=aux_loss) and
DeepSeek-V3's auxiliary-loss-free router bias (model.moe.balance=aux_free) at two update rates
(DeepSeek-V3's 0.001, and 0.01), on the bundled corpus.

    python benchmarks/bench_moe_balance.py            # 4 arms x 600 steps (~3 min on 2 cores)
    python benchmarks/bench_moe_balance.py --quick    # smoke run: 30 steps
    python benchmarks/bench_moe_balance.py --save     # also write benchmarks/results/ (.md, .json, .png)

Each arm is one `python train.py` process: mixtral-tiny's experts (8 per block, top-2, every block)
on blocks of 64 channels, 4 layers, GPT-2's bytes for tokens (the LM head small, so the routers'
steps are the time), fp32, the same data and seed. The figure is the metrics line's
`expert_load_max`: in the least balanced layer, the busiest expert's routes over the mean (1 =
balanced; 2 = one expert takes twice its share, and with expert parallelism its rank works twice
as long). The table gives its mean over the first and the last 50 steps, and the last evaluation
loss (the balancing must not cost the model).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from common import REPO, RESULTS, Report, add_save_flag, read_metrics, run_measured  # benchmarks/common.py

SHARED = [
    "model=mixtral-tiny",
    "model.n_embd=64",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.n_inner=128",
    "model.tokenizer=bytes",
    "model.vocab_size=257",
    "data.block_size=64",
    "trainer.micro_batch_size=8",
    "trainer.log_every=1",
    "logger=jsonl",
    "precision=fp32",
    "optimizer.lr=3e-3",
]
ARMS = {
    "no balancing": ["model.moe.balance=aux_loss", "model.moe.aux_loss_coef=0"],
    "aux loss 0.01": ["model.moe.balance=aux_loss", "model.moe.aux_loss_coef=0.01"],
    "aux-free bias 0.001": ["model.moe.balance=aux_free", "model.moe.bias_update_rate=0.001"],
    "aux-free bias 0.01": ["model.moe.balance=aux_free", "model.moe.bias_update_rate=0.01"],
}
WINDOW = 50  # steps per mean in the table


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def draw(curves: dict[str, list[float]], path: Path) -> None:
    """expert_load_max per step, each arm's raw steps faint and a moving mean of 20 over them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    for (arm, loads), colour in zip(curves.items(), ("#888888", "#1f77b4", "#d62728", "#ff7f0e")):
        steps = range(1, len(loads) + 1)
        ax.plot(steps, loads, color=colour, alpha=0.2, linewidth=0.6)
        smooth = [mean(loads[max(0, i - 19) : i + 1]) for i in range(len(loads))]
        ax.plot(steps, smooth, color=colour, label=arm, linewidth=1.6)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean (least balanced layer)")
    ax.set_title("Expert load, mixtral-tiny's router on the bundled corpus (moving mean of 20 steps)", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 steps")
    parser.add_argument("--steps", type=int, default=600)
    add_save_flag(parser)
    args = parser.parse_args()
    steps = 30 if args.quick else args.steps
    window = min(WINDOW, steps // 3)
    report = Report(__file__)
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_moe_balance-") as workdir:
        for arm, overrides in ARMS.items():
            print(f"bench_moe_balance: {arm}, {steps} steps", file=sys.stderr, flush=True)
            run_dir = Path(workdir) / arm.replace(" ", "_")
            run_dir.mkdir()
            words = [*SHARED, *overrides, f"trainer.max_steps={steps}", f"trainer.eval_every={steps}"]
            command = [sys.executable, str(REPO / "train.py"), *words, f"hydra.run.dir={run_dir}"]
            wall, _ = run_measured(command, run_dir)
            lines = read_metrics(run_dir / "metrics.jsonl")
            loads = [m["expert_load_max"] for m in lines if "loss" in m]
            evals = [m["eval_loss"] for m in lines if "eval_loss" in m]
            figures[arm] = {"overrides": words, "expert_load_max": loads, "eval_loss": evals[-1], "wall_s": wall}
    plain = mean(figures["no balancing"]["expert_load_max"][-window:])
    report.print(f"## Expert load over {steps} steps, mixtral-tiny's router (8 experts, top-2, 4 layers), 1 process")
    report.print("")
    report.print(
        f"| arm | load max, steps 1-{window} | load max, last {window} | / no balancing (last {window}) | eval loss |"
    )
    report.print("| --- | --- | --- | --- | --- |")
    for arm, f in figures.items():
        first, last = mean(f["expert_load_max"][:window]), mean(f["expert_load_max"][-window:])
        f.update(first_window=first, last_window=last, ratio_to_none=last / plain)
        report.print(f"| {arm} | {first:.3f} | {last:.3f} | {last / plain:.2f} | {f['eval_loss']:.4f} |")
    p = report.provenance
    folder = RESULTS if args.save else Path(tempfile.gettempdir())
    picture = folder / f"{report.benchmark}_{p['machine']}_{p['date'][:7]}.png"
    picture.parent.mkdir(exist_ok=True)
    draw({arm: f["expert_load_max"] for arm, f in figures.items()}, picture)
    report.print(
        f"\nThe curves: {picture.name}. Load max is the metrics line's `expert_load_max` (1 = every expert of "
        "every layer takes its share)."
    )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
