"""Launched by tests/test_composition.py on 2 ranks (conftest.launcher): many training
configurations, one after another, in one set of rank processes (the process group made once;
each configuration gets a fresh plan, model, engine and optimizer). Per configuration, the mean
loss over ranks and the gradient norm of each step, or the line that refused or broke it; rank 0
writes them as JSON.

What one configuration leaves in the process is undone before the next: the process groups it
made (its device mesh's, DeepSpeed's, the save group), DeepSpeed's global groups (AutoTP's mesh,
the expert groups), transformers' attention functions (sequence parallelism wraps SDPA),
torch.compile's caches, the autograd graph its modules keep of their last forward (drop_graphs).

A case's words may hold the probe's own: `probe.save_at=K` saves a checkpoint after step K, as
train.py does, in a run directory of the case's own (tests/composition.py's case_dir), training on
after it; `probe.resume=TAG_DIR` loads one (any layout's, as run.resume would) and trains from its
step on: the losses and norms are then those of the steps after it.

Usage: composition_probe.py OUT_JSON CASES_JSON (a list of override lists)."""

import contextlib
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import set_seed

from lmrepo.config import to_dict
from lmrepo.data.prepare import prepare_sources
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.distributed.launch import init_distributed, world_size
from lmrepo.engines import build_engine
from lmrepo.observability.saved_activations import SavedActivations
from lmrepo.plan.compose import compose_config
from lmrepo.plan.job import plan
from lmrepo.run import engine_data
from lmrepo.train import checkpoint
from lmrepo.train.loop import TrainState
from lmrepo.utils.errors import ConfigError

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: the matrix's cases, composition.py
from composition import case_dir  # noqa: E402

DEEPSPEED_GROUPS = {  # deepspeed.utils.groups' module state, as import leaves it
    "_EXPERT_PARALLEL_GROUP": dict,
    "_EXPERT_PARALLEL_GROUP_RANKS": dict,
    "_EXPERT_DATA_PARALLEL_GROUP": dict,
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict,
    "_ALL_TO_ALL_GROUP": dict,
    "_WORLD_GROUP": lambda: None,
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP": lambda: None,
    "mpu": lambda: None,
    "mesh_device": lambda: None,
    "_TENSOR_MODEL_PARALLEL_GROUP": lambda: None,
    "_MODEL_PARALLEL_GROUP": lambda: None,
    "_DATA_PARALLEL_GROUP": lambda: None,
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": lambda: None,
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": lambda: None,
}


def attention_functions() -> tuple[dict, dict]:
    """transformers' attention functions: the library-wide mapping and the instance's overrides."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return dict(type(ALL_ATTENTION_FUNCTIONS)._global_mapping), dict(ALL_ATTENTION_FUNCTIONS._local_mapping)


def reset_process_state(attention: tuple[dict, dict]) -> None:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fresh in DEEPSPEED_GROUPS.items():
        if hasattr(groups, name):
            setattr(groups, name, fresh())
    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None
    for mapping, saved in zip(
        (type(ALL_ATTENTION_FUNCTIONS)._global_mapping, ALL_ATTENTION_FUNCTIONS._local_mapping), attention
    ):
        mapping.clear()
        mapping.update(saved)
    torch._dynamo.reset()
    destroy_subgroups()
    gc.collect()  # the case's objects, and the groups destroyed above with them
    # What survives is the process's for good (caches, and what a case's autograd graphs keep from
    # C++, where the collector cannot reach): out of every later collection, which otherwise walked
    # it again after each case, ever more of it (0.04 s a collection at the first case, 0.13 s at
    # the hundredth; 18 s a rank over the composition launch, 2.5 s so)
    gc.freeze()


def destroy_subgroups() -> None:
    """Every process group but the world's, which the next case's device mesh and DeepSpeed make
    afresh. A gloo group keeps two worker threads and a TCP loop that wakes every 10 ms: by the
    matrix's last cases each rank held ~480 such threads, and perf put a third of a rank's CPU in
    those loops' wake-ups. Groups a case's leftovers still reference (a DeepSpeed engine until
    `release`, ZeRO-3's even after it, the autograd graph of an FSDP2 pipeline or mixture of
    experts) keep their threads until those go."""
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    # DTensor's sharding caches (Python's and the C++ fast path's) key on device meshes by value: a
    # result cached by an earlier case would hand this case's equal mesh back with that case's
    # groups, destroyed below, and keep them alive.
    debug._clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    # The redistribution caches hold device meshes too (as DTensorSpecs, planners and topologies)
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def release(engine) -> None:
    """DeepSpeed's own end of an engine (`destroy`: its optimizer's gradient hooks and ZeRO-3's module
    hooks removed). Those hooks hold the engine from inside autograd, where Python's collector does
    not look: without this every DeepSpeed case's engine, model and process groups outlived it (a
    TCP loop per group that wakes every 10 ms; 150 idle groups cost a rank 14% of a core). A ZeRO-3
    engine still outlives its case, held by its partitioned parameters' state (one group)."""
    ds = getattr(engine, "ds", None)
    if ds is not None:
        ds.destroy()


def case_modules(engine) -> list:
    """The case's model as modules: FSDP2's module, a torch pipeline's chunks, DeepSpeed's module."""
    for owner, name in ((engine, "module"), (engine, "chunks"), (getattr(engine, "ds", None), "module")):
        found = getattr(owner, name, None)
        if found is not None:
            return [found] if isinstance(found, torch.nn.Module) else list(found)
    return []


def drop_graphs(engine) -> None:
    """What the model's modules keep of their last forward's autograd graph: a mixture of experts'
    load-balancing losses (lmrepo's MoE block's aux_loss and its pipeline forwards, DeepSpeed's
    MOELayer's l_aux), detached after the case's last step. That graph holds the model from inside
    autograd, where Python's collector does not look: every MoE case's model outlived it, and with
    it the 4-7 process groups of each rank that its collectives used (a gloo group's loop thread
    wakes every 10 ms). In the 4-rank launch of tests/test_fsdp2.py each rank ended with ~110 such
    loops, ~70 of them the MoE cases'; perf put 12% of the launch's CPU in those threads. The
    torch pipelines' and sequence parallelism's cases still leave 1-7 groups each: what holds those
    is not found yet."""
    for root in case_modules(engine):
        for module in root.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(module, name, value.detach())
                elif isinstance(value, list) and any(
                    isinstance(t, torch.Tensor) and t.grad_fn is not None
                    for item in value
                    for t in (item if isinstance(item, tuple) else (item,))
                ):
                    value.clear()


def compiled_by() -> str:
    """What compiled this configuration's model, from dynamo's counters: inductor (which alone
    uses AOTAutograd's cache), aot_eager (AOTAutograd without it), eager (graphs captured, no
    AOTAutograd) or none."""
    from torch._dynamo.utils import counters

    if counters["inductor"] or any(key.startswith("autograd_cache") for key in counters["aot_autograd"]):
        return "inductor"
    if counters["aot_autograd"]["total"]:
        return "aot_eager"
    return "eager" if graphs_captured() else "none"


def graphs_captured() -> int:
    """How many graphs dynamo captured for this configuration: each break in the model's forward
    (a region torch.compile was told to skip, an op it cannot trace) starts another."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def parameters_held(engine) -> list[float] | None:
    """Each rank's parameter elements under engine=fsdp2 (its FSDP2 shards, of its tensor-parallel
    slices, of its pipeline stage's layers), gathered from every rank; None for DeepSpeed's engines."""
    from torch.distributed.tensor import DTensor

    from lmrepo.engines.fsdp2 import FSDP2Engine
    from lmrepo.engines.torch_pipeline import TorchPipelineEngine

    if isinstance(engine, FSDP2Engine):
        modules = engine.module
    elif isinstance(engine, TorchPipelineEngine) and engine.sharding is not None:
        modules = engine.chunks
    else:
        return None
    mine = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in modules.parameters())
    return gathered(mine)


def gathered(mine) -> list:
    """Every rank's value, in rank order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def probe_options(words: list[str]) -> tuple[list[str], int, Path | None]:
    """(the configuration's overrides, probe.save_at (0: none), probe.resume or None)."""
    options = dict(w.removeprefix("probe.").split("=", 1) for w in words if w.startswith("probe."))
    resume = options.get("resume")
    return [w for w in words if not w.startswith("probe.")], int(options.get("save_at", 0)), resume and Path(resume)


def composed(overrides: list[str], run_dir: Path):
    """Hydra's composition of these overrides, made by rank 0 and handed to every rank: the same
    config on each, composed once (Hydra's compose took a fifth of a 4-rank launch's CPU when every
    rank composed it). Its failure, if any, is raised on every rank."""
    from omegaconf import OmegaConf

    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [OmegaConf.to_container(compose_config(overrides, run_dir=run_dir), resolve=False)]
        except Exception as err:  # noqa: BLE001 (the case's verdict, on every rank; as text: it need not pickle)
            box = [(type(err).__name__, str(err))]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], tuple):
        kind, message = box[0]
        raise ConfigError(message) if kind == "ConfigError" else RuntimeError(f"{kind}: {message}")
    return OmegaConf.create(box[0])


def run(words: list[str], out: Path, tokenizer, sources) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    overrides, save_at, resume = probe_options(words)
    job = plan(composed(overrides, out / "unused"), world_size())
    config = job.config
    set_seed(config.trainer.seed)
    engine = build_engine(job)
    state = TrainState()
    if resume is not None:
        found = checkpoint.inspect(
            resume.parent, resume.name, config.model, len(tokenizer), config.pipeline, config.engine.name
        )
        state = checkpoint.load(engine, found)
    data = engine_data(config, job.ds_config, engine, sources, tokenizer)
    checkpoint_dir = case_dir(out, words) / "checkpoints"
    losses, norms, step_seconds = [], [], []
    # What autograd keeps for backward during each step, above what it held before it, counted on
    # each rank of engine=fsdp2's layouts (not under compile: its graphs save their own way)
    saved = SavedActivations() if config.engine.name == "fsdp2" and not config.trainer.compile else None
    while state.step < config.trainer.max_steps:
        started = time.perf_counter()
        with saved.step() if saved else contextlib.nullcontext():
            loss = engine.train_step(data.train_step(state.consumed)).float().reshape(1)
        state.step, state.consumed = state.step + 1, state.consumed + data.layout.global_batch
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
        record = engine.step_record()
        norms.append(record.get("grad_norm"))
        step_seconds.append(round(time.perf_counter() - started, 2))
        if state.step == save_at:
            tag = checkpoint.save(engine, checkpoint_dir, state, to_dict(config), len(tokenizer))
            checkpoint.finish(engine, checkpoint_dir, tag)
            checkpoint.promote(checkpoint_dir, tag, keep_last=0)
    held = parameters_held(engine)
    # What the last step kept at its most (the first may run more: a torch pipeline's shapes are
    # inferred by a forward of its own), and what stays held between steps (nothing, where no graph
    # outlives its step)
    activations = gathered({"step": saved.last_step, "between": saved.live}) if saved else None
    drop_graphs(engine)
    release(engine)
    del engine, data
    return {
        "losses": losses,
        "grad_norms": norms,
        "compiled_by": compiled_by(),
        "graphs": graphs_captured(),
        "step_seconds": step_seconds,  # the first holds its compile
        "parameters_held": held,
        "activations_peak": activations,
        # a mixture of experts' metrics of the last step (the metrics line's)
        "moe": {key: record[key] for key in ("aux_loss", "expert_tokens") if key in record},
    }


def main(out_file: Path, cases_file: Path) -> None:
    cases = json.loads(cases_file.read_text())
    out = out_file.parent
    init_distributed()
    first = compose_config(probe_options(cases[0])[0], run_dir=out / "unused")
    tokenizer = load_tokenizer(first.model.tokenizer, None)
    sources = prepare_sources(plan(first, world_size()).config.data, tokenizer)
    attention = attention_functions()
    gc.freeze()  # what the imports and the data made stays out of the collection after each case
    results = {}
    for words in cases:
        name, started = " ".join(words), time.perf_counter()
        try:
            results[name] = run(words, out, tokenizer, sources)
        except ConfigError as err:
            results[name] = {"refused": str(err)}
        except Exception as err:  # noqa: BLE001 (one broken configuration must not hide the others' results)
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        reset_process_state(attention)
        results[name]["seconds"] = round(time.perf_counter() - started, 2)  # what the matrix costs, by case
        dist.barrier()
        if dist.get_rank() == 0:
            out_file.write_text(json.dumps(results, indent=1))  # as it goes: a hang still leaves the rest
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
