"""Every key of the schema with its type, value and docstring: `python train.py --help` and the
option reference page (docs/reference/options.md, written by scripts/options_reference.py) are
both generated here, so neither can drift from the schema."""

import ast
import enum
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
HELP_WIDTH = 120  # the widest `python train.py --help` gets: a wider terminal reads no better
HELP_MIN_WIDTH = 60  # and the narrowest: below it a key and its type no longer share a line

TECHNIQUE_GROUPS = (
    "engine",
    "model",
    "data",
    "optimizer",
    "schedule",
    "precision",
    "zero",
    "offload",
    "pipeline",
    "tp",
    "checkpointing",
    "logger",
    "experiment",
    "hparams_search",
)


@cache
def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass (its attribute docstring)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def type_name(kind) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union and type(None) in args:
        return f"{type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, typing.List):
        return f"list of {type_name(args[0])}"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "|".join(member.value for member in kind)
    if is_dataclass(kind):
        return "mapping"
    return getattr(kind, "__name__", "any").replace("Any", "any")


def rows(cls, prefix: str = "") -> list[tuple[str, str, str, type]]:
    """(key, type, docstring, owner dataclass) for every leaf of the schema, in schema order."""
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
    for f in fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        items = typing.get_args(inner[0]) if inner and typing.get_origin(inner[0]) in (list, typing.List) else ()
        if is_dataclass(kind):
            out += rows(kind, f"{key}.")
        elif items and is_dataclass(items[0]):
            out.append((key, f"list of {items[0].__name__}", docs.get(f.name, ""), cls))
            out += rows(items[0], f"{key}[].")
        else:
            out.append((key, type_name(kind), docs.get(f.name, ""), cls))
    return out


def value_of(config: DictConfig, key: str) -> str:
    if "[]" in key:
        return ""
    value = OmegaConf.select(config, key, throw_on_missing=False, throw_on_resolution_failure=False)
    node = config
    for part in key.split("."):  # unresolved: ${oc.env:...} shows as written
        node = node._get_node(part) if isinstance(node, DictConfig) else None
    raw = node._value() if node is not None else value
    if isinstance(raw, (DictConfig, ListConfig)):
        raw = OmegaConf.to_container(raw, resolve=False, enum_to_str=True)
    if isinstance(raw, enum.Enum):
        raw = raw.value
    return (
        "null" if raw is None else "???" if raw == "???" else str(raw).replace("True", "true").replace("False", "false")
    )


def group_options() -> dict[str, list[str]]:
    return {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) for group in TECHNIQUE_GROUPS}


@cache  # read on every composition (the --help resolver): conf/train.yaml once a process
def default_choices() -> dict[str, str]:
    defaults = OmegaConf.load(CONF_DIR / "train.yaml").defaults
    return {
        k: str(v)
        for entry in defaults
        if isinstance(entry, DictConfig)
        for k, v in entry.items()
        if not k.startswith("override")
    }


def help_width() -> int:
    """The terminal's columns (COLUMNS, else the terminal on stdout, else 120), within
    [HELP_MIN_WIDTH, HELP_WIDTH]."""
    import shutil

    return max(HELP_MIN_WIDTH, min(HELP_WIDTH, shutil.get_terminal_size((HELP_WIDTH, 24)).columns))


def help_text(config: DictConfig) -> str:
    """`python train.py --help`: the groups and every key, with the values of this composition."""
    from lmrepo.config import TrainConfig

    choices = dict(default_choices())
    if "hydra" in config and OmegaConf.select(config, "hydra.runtime.choices") is not None:
        choices.update({k: str(v) for k, v in config.hydra.runtime.choices.items() if k in TECHNIQUE_GROUPS})
    width = help_width()
    lines = textwrap.wrap(
        "lmrepo: train GPT-2, BERT, Llama and Mixtral-style MoE models with DeepSpeed or PyTorch FSDP2, "
        "every technique chosen by name.",
        width,
    )
    lines.append("")
    usage = [
        ("python train.py [group=option ...] [key=value ...]", "one job (CPU or one GPU)"),
        ("torchrun --nproc-per-node N train.py ...", "N ranks (or deepspeed --num_gpus N train.py ...)"),
        ("python train.py -m zero=stage0,stage3 ...", "a sweep: one job per combination"),
    ]
    column = max(len(command) for command, _ in usage) + 4
    for command, what in usage:  # the meaning beside the command where it fits, else under it
        if column + len(what) <= width:
            lines.append(f"  {command:<{column - 2}}{what}")
        else:
            lines += [f"  {command}", *textwrap.wrap(what, width, initial_indent=" " * 6, subsequent_indent=" " * 6)]
    lines += [
        "",
        "== Groups: group=option (* = chosen) ==",
    ]
    for group, options in group_options().items():
        chosen = choices.get(group)
        named = ", ".join(o + ("*" if o == chosen else "") for o in options)
        lines += textwrap.wrap(
            f"{group:<15} {named}",
            width,
            initial_indent="  ",
            subsequent_indent=" " * 18,
            break_on_hyphens=False,
            break_long_words=False,
        )
    lines += ["", "== Keys: key=value (type; value here; meaning) =="]
    table = [(key, kind, value_of(config, key), doc) for key, kind, doc, _ in rows(TrainConfig)]
    # keys padded to one column, as wide as the longest key where the terminal leaves 40 columns
    # for the rest; a longer key then has its type after two spaces, or on the next line
    key_width = min(max(len(key) for key, *_ in table), width - 44)
    for key, kind, value, doc in table:
        # one key a line; a meaning that would run past the terminal's width goes on below, indented
        lines += textwrap.wrap(
            f"{key:<{key_width}}  {kind}; {value or '-'}; {doc}",
            width,
            initial_indent="  ",
            subsequent_indent=" " * 8,
            break_on_hyphens=False,
            break_long_words=True,  # only a word wider than the terminal: an example value
        )
    lines += ["", "Hydra's own flags: python train.py --hydra-help"]
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the template with string.Template


def markdown(config: DictConfig) -> str:
    """docs/reference/options.md: the groups and their options, then one table per section of the
    schema (model, data, ...), a row per key with the default `python train.py` uses."""
    from lmrepo.config import TrainConfig

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    choices = dict(default_choices())
    out = [
        "# Option reference",
        "",
        "Every group and every key of the typed schema (`lmrepo/config/`), with the default `python train.py` uses.",
        "Generated by `python scripts/options_reference.py --write`; `tests/test_reference.py` fails when this",
        "page and the schema differ. `python train.py --help` prints the same keys with the values of your own",
        "composition.",
        "",
        "## Groups",
        "",
        "Choose an option with `group=option`; the default is in bold.",
        "",
        "| group | options |",
        "| --- | --- |",
    ]
    for group, options in group_options().items():
        names = [f"**`{o}`**" if o == choices.get(group) else f"`{o}`" for o in options]
        out.append(f"| `{group}` | {', '.join(names)} |")
    section = None
    for key, kind, doc, _ in rows(TrainConfig):
        top = key.split(".")[0] if "." in key else "top-level"
        if top != section:
            section = top
            out += ["", f"## {section}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        value = value_of(config, key)
        out.append(f"| `{key}` | {cell(kind)} | {'`' + cell(value) + '`' if value else ''} | {cell(doc)} |")
    return "\n".join(out) + "\n"


def recipe_description(text: str) -> str:
    """A recipe's first comment paragraph: its lines after `# @package`, up to the first example
    command (a line indented past the `#`) or blank comment line."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#   ") or not line[1:].strip():
            if lines:
                break
            continue
        if not line.startswith("# @package"):
            lines.append(line[1:].strip())
    return " ".join(lines)


def recipes_table() -> str:
    """docs/sweeps.md's table of conf/experiment/: each recipe's description (its YAML's first
    comments), the grid it sweeps and what every job of it runs with."""
    out = ["| recipe | what it is | jobs | each job |", "| --- | --- | --- | --- |"]
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        recipe = OmegaConf.load(path)
        params = OmegaConf.select(recipe, "hydra.sweeper.params") or {}
        grid = [f"`{key}={values}`" for key, values in params.items()]
        count = 1
        for values in params.values():
            count *= len(str(values).split(","))
        jobs = f"{count}: {' x '.join(grid)}" if grid else "1"
        each = [f"`{k.removeprefix('override /')}={v}`" for d in recipe.get("defaults", []) for k, v in d.items()]
        for key, unit in (
            ("launcher.ranks", "ranks"),
            ("trainer.max_steps", "steps"),
            ("trainer.grad_accum", "micro-batches a step"),
        ):
            if (value := OmegaConf.select(recipe, key)) is not None:
                each.append(f"{value} {unit}")
        out.append(f"| `{path.stem}` | {recipe_description(path.read_text())} | {jobs} | {', '.join(each)} |")
    return "\n".join(out) + "\n"


def figures_table() -> str:
    """docs/sweeps.md's table of what each figure of a comparison means (lmrepo.observability.figures)."""
    from lmrepo.observability.figures import DEFINITIONS

    rows = [f"| {column} | {meaning} |" for column, meaning in DEFINITIONS.items()]
    return "\n".join(["| column | what it is |", "| --- | --- |", *rows]) + "\n"


# docs/sweeps.md's generated tables, each between its markers: (name, what it is generated from, generator).
GENERATED = (
    ("recipes", "conf/experiment/", recipes_table),
    ("figures", "lmrepo/observability/figures.py", figures_table),
)


def with_generated_tables(page: str) -> str:
    """`page` (docs/sweeps.md) with each generated table between its markers."""
    for name, source, table in GENERATED:
        begin = f"<!-- {name}: generated from {source} by python scripts/options_reference.py --write -->\n"
        end = f"<!-- /{name} -->\n"
        start, stop = page.index(begin) + len(begin), page.index(end)
        page = page[:start] + table() + page[stop:]
    return page


def register_help_resolver() -> None:
    if not OmegaConf.has_resolver("lmrepo_help"):
        OmegaConf.register_new_resolver("lmrepo_help", lambda *, _root_: help_text(_root_) if asks_for_help() else "")


def asks_for_help() -> bool:
    """`--help` or `-h` on this process's command line. Hydra resolves the help template in every
    composition, and the text (the schema's docstrings, parsed from lmrepo's source) cost every
    train.py process ~0.1 CPU-s of its start; only --help prints it."""
    return any(arg in ("--help", "-h") for arg in sys.argv[1:])


OPTIONS_PAGE = CONF_DIR.parent / "docs" / "reference" / "options.md"
SWEEPS_PAGE = CONF_DIR.parent / "docs" / "sweeps.md"
