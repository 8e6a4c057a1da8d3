"""benchmarks/bench.py's worker arms, one function per worker process. Every worker gets the same
spec (model, the DeepSpeed config train.py wrote, the prepared token files, seed, steps) and returns
JSON-able results; bench.py launches them, interleaves them and prints the table. What every
benchmark shares (paths, the machine, Report) is common.py's.

- `BareArms`: the DeepSpeed tutorials' loop (`engine(batch).loss; engine.backward(loss); engine.step()`) over
  the batches train.py reads, materialized before the clock starts, one step at a time: the
  ruler the other loops are paired with, eager and (arm "compiled") after `engine.compile()`.
- `bare_loop`: the bare loop alone (eager; eager against compiled, or against a twin);
  `fit_and_bare`: lmrepo.train.loop.fit with a bare step after each of its steps; `hf_trainer`:
  Hugging Face Trainer on the same model, batches and DeepSpeed config, with a bare step after
  each of its steps.
- `model_state_memory`: on each of 2 ranks, the bytes of the tensors each ZeRO stage keeps for
  parameters, gradients and optimizer states, counted from the engine's own tensors.
"""

import gc
import re
import time
from pathlib import Path

import torch

import common  # noqa: F401  (benchmarks/common.py: the repository on sys.path, DeepSpeed's op builds pinned)
from lmrepo.data.loader import Layout, LMData
from lmrepo.distributed.device import isolate_compile_cache


def step_batches(spec: dict) -> list[list[dict]]:
    """The micro batches of each optimizer step exactly as train.py's loop reads them (one rank)."""
    ds = spec["ds_config"]
    layout = Layout(
        global_batch=ds["train_batch_size"], micro_batch=ds["train_micro_batch_size_per_gpu"], dp_rank=0, dp_size=1
    )
    data = LMData(spec["sources"], spec["block_size"], "gpt2", None, layout, spec["seed"], eval_batches=1)
    return [data.train_step(step * layout.global_batch) for step in range(spec["steps"])]


def model_of(spec: dict):
    """The model train.py builds from the spec's model section (same preset, same seed)."""
    from transformers import set_seed

    from lmrepo.config import ModelConfig, from_dict
    from lmrepo.models import build_model

    set_seed(spec["seed"])
    # build_model names the loss type: unset, transformers warns from inside forward (a graph break).
    return build_model(from_dict(ModelConfig, spec["model"]))


def build(spec: dict):
    """The model train.py builds, with its weight-decay groups, in a bare DeepSpeed engine (DeepSpeed's own object)."""
    from lmrepo.engines.deepspeed_runtime import initialize

    return initialize(model_of(spec), spec["ds_config"])


class BareArms:
    """Engines driven by the DeepSpeed tutorials' bare loop over the same batches, one optimizer step at a time:
    arm "eager", and "compiled" (`engine.compile()`, inductor). Each arm walks the batches on its
    own; `step()` steps the given arms (all by default: the order alternates, so neither always
    runs first) and records each one's wall time and loss."""

    def __init__(self, spec: dict, arms: list[str]):
        self.batches = step_batches(spec)
        self.engines = {}
        for arm in arms:
            self.engines[arm] = build(spec)
            if arm == "compiled":
                isolate_compile_cache()
                self.engines[arm].compile()
        self.times = {arm: [] for arm in arms}
        self.losses = {arm: [] for arm in arms}
        self.calls = 0

    def step(self, arms: list[str] | None = None) -> float:
        """Steps each arm once; returns the seconds it took (to subtract where it ran inside another clock)."""
        begin = time.perf_counter()
        arms = arms or (list(self.engines) if self.calls % 2 == 0 else list(self.engines)[::-1])
        for arm in arms:
            engine, micro_losses = self.engines[arm], []
            start = time.perf_counter()
            for batch in self.batches[len(self.times[arm])]:
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                micro_losses.append(loss.detach())
            self.times[arm].append(time.perf_counter() - start)
            self.losses[arm].append(torch.stack(micro_losses).float().mean().item())  # as train.py logs it
        self.calls += 1
        return time.perf_counter() - begin

    def result(self) -> dict:
        return {"times": self.times, "losses": self.losses}


def bare_loop(spec: dict) -> dict:
    """The tutorials' bare loop alone: step times (s) and losses per arm. Several arms take turns in blocks
    of `spec["block"]` steps: a compiled engine stepped between eager steps slowed those eager
    steps by about 3% here (cause not pinned down), in blocks that cost falls on few steps."""
    from lmrepo.distributed.launch import ensure_single_process_env

    ensure_single_process_env()
    arms = BareArms(spec, spec["arms"])
    block = spec.get("block", 1)
    for first in range(0, spec["steps"], block):
        for arm in spec["arms"] if first // block % 2 == 0 else spec["arms"][::-1]:
            for _ in range(min(block, spec["steps"] - first)):
                arms.step([arm])
    return {"bare": arms.result()}


def fit_and_bare(spec: dict) -> dict:
    """train.py's loop (lmrepo.train.loop.fit with lmrepo's engine, data, throughput and sinks, as
    lmrepo.run.train wires them) with the bare arms stepped right after each of its steps, inside
    the metrics sink: each pair of steps sees the same machine load. fit's step time is the wall
    time between its consecutive metrics lines (everything the loop does) less the bare step
    that ran in between."""
    from transformers import set_seed

    from lmrepo.config import TrainConfig, from_dict
    from lmrepo.distributed.device import detect_device
    from lmrepo.distributed.launch import init_distributed
    from lmrepo.distributed.layout import ParallelLayout
    from lmrepo.engines import build_engine
    from lmrepo.observability.loggers import build_sinks
    from lmrepo.plan.ds_config import batch_of
    from lmrepo.plan.job import Plan
    from lmrepo.run import throughput_of
    from lmrepo.train.hooks import Progress, training_hooks
    from lmrepo.train.loop import TrainState, fit

    config = from_dict(TrainConfig, spec["config"])  # loaded and resolved (lmrepo.plan.job.plan) by the orchestrator
    ds = spec["ds_config"]
    device = detect_device(config.trainer.device)
    init_distributed()
    set_seed(config.trainer.seed)
    engine = build_engine(Plan(config, device, ds, ParallelLayout.single(), [], []))  # one rank
    arms = BareArms(spec, spec["arms"])
    global_batch, micro_batch, _ = batch_of(ds)
    layout = Layout(global_batch, micro_batch, engine.dp_rank, engine.dp_size)
    data = LMData(
        spec["sources"],
        config.data.block_size,
        config.model.family,
        None,
        layout,
        config.trainer.seed,
        config.trainer.eval_batches,
    )
    run_dir = Path(spec["out_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    records, bare_seconds = [], []

    class WithBareStep:
        def __init__(self, sinks):
            self.sinks = sinks

        def log(self, record: dict) -> None:
            self.sinks.log(record)
            if "loss" in record:
                records.append(record)
                bare_seconds.append(arms.step())

        def finish(self) -> None:
            self.sinks.finish()

    sinks = WithBareStep(build_sinks(config.logger, run_dir, spec["config"], ds))
    state, progress = TrainState(), Progress(sinks, config.trainer.max_steps, 0, enabled=True)
    throughput = throughput_of(config, ds, device)
    fit(engine, data, config.trainer, state, training_hooks(progress, engine, data, config.trainer, throughput, state))
    sinks.finish()
    elapsed = [0.0] + [r["elapsed_s"] for r in records]
    times = [b - a - (bare_seconds[k - 1] if k else 0.0) for k, (a, b) in enumerate(zip(elapsed, elapsed[1:]))]
    return {"fit": {"times": times, "losses": [r["loss"] for r in records]}, "bare": arms.result()}


def hf_trainer(spec: dict) -> dict:
    """Hugging Face Trainer with the DeepSpeed config train.py wrote, on the same samples in the
    same order, with the bare arms stepped after each of its steps (a callback). Its step time is
    the wall time between consecutive step ends less the bare step in between."""
    from lmrepo.distributed.launch import ensure_single_process_env

    ensure_single_process_env()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ds = spec["ds_config"]
    samples = [
        {"input_ids": row, "labels": row}
        for micro_batches in step_batches(spec)
        for batch in micro_batches
        for row in batch["input_ids"]
    ]

    class InOrder(torch.utils.data.IterableDataset):  # iterable: the Trainer does not shuffle it
        def __iter__(self):
            return iter(samples)

    # The Trainer refuses a DeepSpeed config whose values differ from its arguments: give it ours.
    adam = ds["optimizer"]["params"]
    cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=spec["out_dir"],
        deepspeed=ds,
        max_steps=spec["steps"],
        per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        learning_rate=adam["lr"],
        adam_beta1=adam["betas"][0],
        adam_beta2=adam["betas"][1],
        adam_epsilon=adam["eps"],
        weight_decay=adam.get("weight_decay", 0.0),
        max_grad_norm=ds.get("gradient_clipping", 0.0),
        warmup_steps=ds["scheduler"]["params"].get("warmup_num_steps", 0),
        bf16=ds.get("bf16", {}).get("enabled", False),
        use_cpu=cpu,  # bf16 off the GPU needs use_cpu
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    model = model_of(spec)
    arms = BareArms(spec, spec["arms"])
    times = []

    class BareStepAfterEach(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)
            arms.step()
            self.start = time.perf_counter()  # the next step's clock starts after the bare step

    trainer = Trainer(model=model, args=args, train_dataset=InOrder(), callbacks=[BareStepAfterEach()])
    output = trainer.train()
    return {
        "hf": {
            "times": times,
            "mean_loss": output.training_loss,
            "engine": type(trainer.model_wrapped).__name__,
            "use_cpu": cpu,
        },
        "bare": arms.result(),
    }


def _reachable(obj, path: str, found: list, seen: set, depth: int = 0) -> None:
    """(path, tensor) for every tensor reachable from `obj` through containers and the attributes
    of DeepSpeed and torch.optim objects (not nn.Modules: the engine's module is walked apart)."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.append((path, obj))
        if getattr(obj, "ds_tensor", None) is not None:  # ZeRO-3: this rank's partition of a parameter
            found.append((f"{path}.ds_tensor", obj.ds_tensor))
        if obj.is_leaf and obj.grad is not None:
            found.append((f"{path}.grad", obj.grad))
        return
    if isinstance(obj, dict):
        for i, (key, value) in enumerate(list(obj.items())):
            if isinstance(key, torch.Tensor):  # torch optimizer state is keyed by the stepped parameter
                _reachable(key, f"{path}<param {i}>", found, seen, depth + 1)
            _reachable(value, f"{path}[{key if isinstance(key, (str, int)) else i}]", found, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, value in enumerate(obj):
            _reachable(value, f"{path}[{i}]", found, seen, depth + 1)
    elif (
        hasattr(obj, "__dict__")
        and not isinstance(obj, torch.nn.Module)
        and type(obj).__module__.startswith(("deepspeed", "torch.optim"))
    ):
        for name, value in vars(obj).items():
            _reachable(value, f"{path}.{name}", found, seen, depth + 1)


def held_bytes(engine) -> dict:
    """Bytes of the storages this rank holds, by what they are: `params` (the module's parameters;
    at ZeRO-3 their partitions and the small ones kept whole), `grads` (parameter gradients and
    the optimizer's gradient buffers), `optimizer` (what the inner optimizer steps and keeps:
    fp32 master copy and Adam moments), `buffers` (anything else the ZeRO optimizer holds, e.g.
    communication buckets: not model states). A storage counts once, whole (a view keeps it
    alive), under the first of those kinds that reaches it."""
    params, stepped, everything = [], [], []
    for name, p in engine.module.named_parameters():
        _reachable(p, f"module.{name}", params, set())
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer inside DeepSpeed's wrapper
    _reachable({"state": inner.state, "param_groups": inner.param_groups}, "inner", stepped, set())
    _reachable(engine.optimizer, "optimizer", everything, set())

    def kind_of(path: str, default: str) -> str:
        # attribute names that hold gradients: p.grad, averaged_gradients, grads_in_partition,
        # grad_partitions_flat_buffer, ..._param_id_to_grad_partition (not the grad-norm scalars)
        if any("grad" in part and "norm" not in part for part in re.split(r"[.\[<]", path)):
            return "grads"
        return default

    totals, owner = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}, {}
    ranked = (
        [(kind_of(p, "params"), t) for p, t in params]
        + [("optimizer", t) for _, t in stepped]
        + [(kind_of(p, "buffers"), t) for p, t in everything]
    )
    order = ["params", "optimizer", "grads", "buffers"]
    for kind, tensor in sorted(ranked, key=lambda kt: order.index(kt[0])):
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owner:
            owner[storage.data_ptr()] = kind
            totals[kind] += storage.nbytes()
    return totals


def model_state_memory(spec: dict) -> list[dict]:
    """For each model and ZeRO stage: build, train one step (Adam states exist after it), run the
    next forward and backward and count what this rank holds before that step's optimizer update
    (the moment gradients and optimizer states coexist). Each step reads spec["tokens"] (micro
    batch, tokens) of random ids, by default the job's micro batch of blocks."""
    import torch.distributed as dist

    from lmrepo.distributed.launch import init_distributed

    init_distributed()
    gc.freeze()  # what the imports made stays out of the collections between engines (0.5 s each here)
    rows = []
    for model_spec in spec["models"]:
        for stage, ds in model_spec["ds_configs"].items():
            run = {**spec, "model": model_spec["model"], "ds_config": ds}
            engine = build(run)
            micro, block = spec.get("tokens") or (ds["train_micro_batch_size_per_gpu"], spec["block_size"])
            ids = torch.randint(
                0,
                model_spec["model"]["vocab_size"],
                (micro, block),
                generator=torch.Generator().manual_seed(spec["seed"] + dist.get_rank()),
            )
            for step in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                if step == 1:
                    held = held_bytes(engine)
                engine.step()
            params = model_spec["params"]
            dtype = next((k for k in ("bf16", "fp16") if ds.get(k, {}).get("enabled")), "fp32")
            rows.append(
                {
                    "model": model_spec["label"],
                    "stage": int(stage),
                    "rank": dist.get_rank(),
                    "world": dist.get_world_size(),
                    "dtype": dtype,
                    "n_params": params,
                    "group_sizes": model_spec["group_sizes"],
                    **held,
                }
            )
            engine.destroy()
            del engine
            gc.collect()
    return rows
