"""A DeepSpeed JSON the user brings (`deepspeed_config=FILE`), laid over the dict lmrepo builds.

The contract is Hugging Face's DeepSpeed integration, the one most of these files were written
for: what the file sets wins; "auto" means "lmrepo decides" (its precision, optimizer and
schedule settings, gradient clipping, batch, and the ZeRO-3 sizes from the model's hidden size);
after the merge no "auto" is left. Legacy and alias names are first written as DeepSpeed's
canonical keys (a deprecation is one warning line), and the merged dict is checked by DeepSpeed's
own config model before anything starts, so a typo is one line naming the JSON key, not a
pydantic traceback inside deepspeed.initialize.
"""

import copy
import json
from collections.abc import KeysView
from pathlib import Path

from lmrepo.config import TrainConfig
from lmrepo.plan.ds_config import batch_of, resolve_batch, wsd_params
from lmrepo.utils.errors import ConfigError, require

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Optimizers DeepSpeed runs only with CUDA kernels or a NCCL/MPI backend (1-bit compression).
GPU_ONLY_OPTIMIZERS = {"lamb", "onebitadam", "zerooneadam", "onebitlamb"}


class UserConfig:
    """One user JSON: its path (for messages) and its dict, normalised and with its autos resolved."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        require(p.is_file(), f"deepspeed_config={path} does not exist")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"deepspeed_config={path} is not valid JSON ({err})") from None
        require(isinstance(data, dict), f"deepspeed_config={path} must hold a JSON object")
        self.data, self.warnings = normalise(data)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"deepspeed_config={self.path}: {key}: {message}")

    def sets(self, dotted: str) -> bool:
        """Whether the file itself sets this key (or a section holding it)."""
        node = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return node != "auto"


# --- names: legacy and alias keys as DeepSpeed's canonical ones --------------------------------


def zero_renames() -> dict[str, tuple[str, bool]]:
    """zero_optimization key -> (the name lmrepo and DeepSpeed's docs write, deprecated?), from
    DeepSpeed's own pydantic model: short field names whose alias is the documented stage3_* key,
    and deprecated fields with the parameter that replaces them."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    renames = {}
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        extra = field.json_schema_extra or {}
        if field.alias and field.alias != name:
            renames[name] = (field.alias, False)
        elif extra.get("deprecated") and extra.get("set_new_param", True) and "new_param_fn" not in extra:
            new = extra["new_param"]
            new_field = DeepSpeedZeroConfig.model_fields.get(new)
            renames[name] = ((new_field.alias if new_field and new_field.alias else new), True)
    return renames


def normalise(user: dict) -> tuple[dict, list[str]]:
    """Canonical names, and keys starting with "_" (JSON's comment idiom) dropped. Returns the
    dict and a warning line per deprecated name."""
    user, warnings = {k: v for k, v in user.items() if not k.startswith("_")}, []
    if "bfloat16" in user:  # DeepSpeed's old name, read only when "bf16" is absent
        legacy = user.pop("bfloat16")
        if "bf16" not in user:
            user["bf16"] = legacy
            warnings.append("bfloat16 is DeepSpeed's deprecated name of bf16: read as bf16")
    zero = user.get("zero_optimization")
    if isinstance(zero, dict):
        zero = dict(zero)
        for old, (new, deprecated) in zero_renames().items():
            if old in zero:
                if new in zero:
                    raise ConfigError(f"zero_optimization sets both {old} and {new}, two names of one key: keep {new}")
                zero[new] = zero.pop(old)
                if deprecated:
                    warnings.append(f"zero_optimization.{old} is deprecated: read as zero_optimization.{new}")
        user["zero_optimization"] = zero
    return user, warnings


# --- "auto": lmrepo's value ------------------------------------------------------------------


def enabled(value) -> bool:
    """DeepSpeed reads `enabled` as a bool; JSONs also write 1 and 0."""
    return value is True or (isinstance(value, int) and not isinstance(value, bool) and value == 1)


def schedule_values(config: TrainConfig) -> dict:
    """Every scheduler parameter "auto" can stand for, as lmrepo's own schedules set them:
    warmup from 0 to optimizer.lr over schedule.warmup_steps, then the decay to trainer.max_steps."""
    lr, warmup, steps = config.optimizer.lr, config.schedule.warmup_steps, config.trainer.max_steps
    floor = lr * config.schedule.min_lr_ratio
    return {
        **wsd_params(config.schedule, steps),  # lmrepo's WarmupStableDecayLR (schedule.decay_fraction, ...)
        "warmup_min_lr": 0.0 if warmup else lr,
        "warmup_max_lr": lr,
        "warmup_num_steps": max(1, warmup),
        "warmup_type": "linear",
        "total_num_steps": steps,
        "warmup_min_ratio": 0.0 if warmup else 1.0,
        "cos_min_ratio": config.schedule.min_lr_ratio,
        # OneCycle: up to the peak over the warmup, down to the floor over the rest of the run
        "cycle_min_lr": floor,
        "cycle_max_lr": lr,
        "cycle_first_step_size": max(1, warmup),
        "cycle_second_step_size": max(1, steps - max(1, warmup)),
        "decay_lr_rate": 0.0,
    }


def auto_value(path: str, ours: dict, config: TrainConfig):
    """lmrepo's value for an "auto" at `path` (dotted), or KeyError when it has none."""
    hidden = config.model.shape()["n_embd"]
    special = {  # Hugging Face's formulas for the ZeRO-3 sizes
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        # accelerate's meaning: save_16bit_model writes whole weights (lmrepo's ZeRO-3 default)
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
        "fp16.enabled": config.precision.dtype == "fp16",
        "bf16.enabled": config.precision.dtype == "bf16",
        "gradient_clipping": config.trainer.grad_clip,
    }
    if path in special:
        return special[path]
    section, _, key = path.partition(".params.")
    if section == "scheduler" and key in schedule_values(config):
        return schedule_values(config)[key]
    node = ours
    for part in path.split("."):
        node = node[part]  # KeyError: lmrepo has no such value
    return node


def resolve_autos(user: UserConfig, ours: dict, config: TrainConfig) -> dict:
    """The user's dict with every "auto" replaced by lmrepo's value; the batch keys' autos are
    left to the batch reconciliation (they keep lmrepo's batch)."""

    def walk(node, prefix: str):
        if isinstance(node, dict):
            return {
                k: walk(v, f"{prefix}{k}.")
                for k, v in node.items()
                if not (prefix == "" and k in BATCH_KEYS and v == "auto")
            }
        if isinstance(node, list):
            return [walk(v, prefix) for v in node]
        if node != "auto":
            return node
        path = prefix.rstrip(".")
        try:
            return auto_value(path, ours, config)
        except (KeyError, TypeError):
            raise user.error(path, '"auto" has no lmrepo value here: set a value') from None

    return walk(user.data, "")


# --- the merge ---------------------------------------------------------------------------------


def merge(ours: dict, user: dict, prefix: str = "") -> tuple[dict, list[str]]:
    """What the user's (auto-free) dict sets wins. Returns the merged dict and the dotted keys it changed."""
    merged, changed = dict(ours), []
    for key, value in user.items():
        path = f"{prefix}{key}"
        # Another optimizer or scheduler type takes none of our params: the user's section replaces ours.
        replaces = isinstance(value, dict) and "type" in value and value["type"] != ours.get(key, {}).get("type")
        if isinstance(value, dict) and isinstance(ours.get(key), dict) and not replaces:
            merged[key], sub = merge(ours[key], value, prefix=f"{path}.")
            changed += sub
        elif ours.get(key) != value:
            merged[key] = value
            changed.append(path)
    return merged, changed


def exclusive_precision(merged: dict, user: dict) -> None:
    """A JSON that enables fp16 (or bf16) chooses the precision: lmrepo's is switched off."""
    for chosen, other in (("fp16", "bf16"), ("bf16", "fp16")):
        if enabled(user.get(chosen, {}).get("enabled")) and merged.get(other, {}).get("enabled"):
            merged[other] = {**merged[other], "enabled": False}


def reconcile_batch(user: UserConfig, merged: dict, resolved: dict, dp_size: int) -> None:
    """A JSON that sets only some of the batch keys (many set only the micro batch) decides
    the batch: lmrepo's fill in only what it leaves open, as DeepSpeed derives them."""
    given = {k: resolved[k] for k in BATCH_KEYS if k in resolved}
    if not given:
        return
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise user.error(key, f'{value!r} must be a whole number >= 1 (or "auto")')
    if len(given) == 1:
        # One key alone: keep lmrepo's micro batch and derive the rest from it.
        if "train_batch_size" not in given:
            given.setdefault("gradient_accumulation_steps", merged["gradient_accumulation_steps"])
        given.setdefault("train_micro_batch_size_per_gpu", merged["train_micro_batch_size_per_gpu"])
    try:
        triple = resolve_batch(given.get(BATCH_KEYS[0]), given.get(BATCH_KEYS[1]), given.get(BATCH_KEYS[2]), dp_size)
    except ConfigError:
        shown = " x ".join(f"{k}={given[k]}" for k in BATCH_KEYS[1:] if k in given)
        raise ConfigError(
            f"deepspeed_config={user.path}: batch keys {', '.join(f'{k}={v}' for k, v in given.items())} "
            f"do not fit {dp_size} data-parallel rank(s) (train_batch_size = {shown or 'micro x accum'} x "
            f'ranks): change them in the JSON, or set them to "auto"'
        ) from None
    merged.update(zip(BATCH_KEYS, triple))


def lay_over(ours: dict, user: UserConfig, config: TrainConfig, dp_size: int) -> tuple[dict, list[str]]:
    """The final DeepSpeed dict and the keys the user's JSON changed."""
    resolved = resolve_autos(user, ours, config)
    theirs_tp = resolved.get("tensor_parallel")
    if theirs_tp is not None and theirs_tp != ours.get("tensor_parallel", {"autotp_size": 1}):
        size = theirs_tp.get("autotp_size") if isinstance(theirs_tp, dict) else theirs_tp
        raise user.error(
            "tensor_parallel",
            f"set tensor parallelism with tp=auto tp.size={size} instead: lmrepo builds "
            "the tensor-parallel groups and checks the model and the rank count for it",
        )
    merged, changed = merge(ours, {k: v for k, v in resolved.items() if k not in BATCH_KEYS})
    exclusive_precision(merged, resolved)
    reconcile_batch(user, merged, resolved, dp_size)
    changed += [k for k in BATCH_KEYS if k in resolved and merged[k] != ours[k]]
    check_with_deepspeed(merged, user)
    return merged, changed


# --- DeepSpeed's own verdict ---------------------------------------------------------------------


class _ReadKeys(dict):
    """A dict that remembers which of its keys DeepSpeed's config reader looked at."""

    def __init__(self, data: dict, read: set):
        super().__init__(data)
        self.read = read

    def __copy__(self):
        return _ReadKeys(dict(self), self.read)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return _ReadKeysView(self)


class _ReadKeysView(KeysView):
    """DeepSpeed asks `KEY in param_dict.keys()`: a membership test reads that one key; a
    reader that walks all the keys has read them all."""

    def __contains__(self, key):
        return key in self._mapping

    def __iter__(self):
        self._mapping.read.update(dict.keys(self._mapping))
        return iter(dict.keys(self._mapping))


def check_with_deepspeed(merged: dict, user: UserConfig) -> None:
    """DeepSpeedConfig (DeepSpeed's parser and its pydantic sections) on the merged dict, before
    any process group: its errors, and top-level keys it never reads (which DeepSpeed ignores
    without a word: a misspelt section would silently do nothing), become one line."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    global_batch, micro, accum = batch_of(merged)
    # No process group: DeepSpeedConfig checks the batch against a world of 1; lmrepo checked it
    # against the real data-parallel size already.
    probe, read = copy.deepcopy(merged), set()
    probe["train_batch_size"] = micro * accum
    try:
        DeepSpeedConfig(_ReadKeys(probe, read))
    except ValidationError as err:
        first = err.errors()[0]
        section = _section_of(first, merged)
        where = ".".join(str(part) for part in (section, *first["loc"]) if part is not None)
        raise user.error(where or "?", first["msg"]) from None
    except Exception as err:  # DeepSpeed's asserts and ValueErrors: its own message names the key
        raise ConfigError(
            f"deepspeed_config={user.path}: DeepSpeed refuses it: "
            f"{' '.join(str(err).split())[:300] or type(err).__name__}"
        ) from None
    unread = sorted(k for k in merged if k not in read and user.sets(k))
    if unread:
        raise user.error(
            unread[0], "not a key DeepSpeed reads (it would be ignored without a word): fix its spelling or remove it"
        )
    optimizer = str(merged.get("optimizer", {}).get("type", "")).lower()
    if optimizer in GPU_ONLY_OPTIMIZERS:
        from deepspeed.accelerator import get_accelerator

        require(
            get_accelerator().device_name() == "cuda",
            f"deepspeed_config={user.path}: optimizer.type={merged['optimizer']['type']} runs only on GPUs "
            "(CUDA kernels, or 1-bit compression over NCCL/MPI): use Adam or AdamW on this machine",
        )


def _section_of(error: dict, merged: dict) -> str | None:
    """pydantic names the field inside its section; find the section whose dict holds it."""
    first = error["loc"][0] if error["loc"] else None
    if first in merged:
        return None
    for name, value in merged.items():
        if isinstance(value, dict) and first in value:
            return name
    return None


# --- secrets -----------------------------------------------------------------------------------

SECRET_WORDS = ("api_key", "apikey", "password", "passwd", "secret", "token", "credential")


def is_secret(key: str) -> bool:
    """Keys that hold credentials (a monitor's `api_key`, an `auth_token`), not `max_new_tokens`-like counts."""
    key = key.lower()
    return any(word in key for word in SECRET_WORDS) and not key.endswith(("tokens", "token_count", "_tokenizer"))


def redact(value):
    """A copy of a DeepSpeed dict with credentials masked: for ds_config.json, logs and W&B. The
    engine gets the real values."""
    if isinstance(value, dict):
        return {k: ("***" if is_secret(k) and v not in (None, "", False) else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
