"""Which lm-eval tasks to run, resolved and loaded before any model is built.

lmrepo ships local tasks (lmrepo/eval_tasks/: the harness's task YAMLs over jsonl files built by
scripts/build_eval_tasks.py from the held-out Shakespeare split). The harness resolves a YAML's
`data_files` against the working directory, not the YAML's, so each run renders them into a
temporary directory with absolute paths. Other names are the harness's registry (their data
comes from the Hugging Face hub) and task YAML paths of your own.
"""

import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import yaml

from lmrepo.utils.errors import ConfigError

LOCAL_DIR = Path(__file__).resolve().parents[1] / "eval_tasks"


def local_tasks() -> dict[str, dict]:
    """The shipped task YAMLs by task name, their data_files absolute."""
    tasks = {}
    for path in sorted(LOCAL_DIR.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        files = spec["dataset_kwargs"]["data_files"]
        spec["dataset_kwargs"]["data_files"] = {split: str(LOCAL_DIR / name) for split, name in files.items()}
        tasks[spec["task"]] = spec
    return tasks


def local_names(tasks: dict[str, dict]) -> set[str]:
    """Task names and the tags that group them (`shakespeare`: all of them)."""
    tags = [spec.get("tag") or [] for spec in tasks.values()]
    return set(tasks) | {tag for group in tags for tag in ([group] if isinstance(group, str) else group)}


def offline_unless_hub_reachable(timeout: float = 3.0) -> None:
    """Without the hub, datasets retries each task's files for ~30 s before it fails. After a
    3 s probe, datasets and huggingface_hub go offline instead: their cache still serves the
    tasks downloaded before, and a missing one fails at once. HF_HUB_OFFLINE set by you wins."""
    import datasets.config
    import huggingface_hub.constants

    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return
    endpoint = urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return
    except OSError:
        pass
    os.environ["HF_HUB_OFFLINE"] = "1"  # read at import by what is not imported yet
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True  # read per call by what is


class TaskSet:
    """The tasks of one evaluation, resolved by the harness's TaskManager. Indexing the harness's
    ~14,000 built-in YAMLs costs ~8 s, so that happens only when a name is not a local one."""

    def __init__(self, names: list[str]):
        from lm_eval.tasks import TaskManager

        if not names:
            raise ConfigError("tasks: name at least one task, e.g. tasks=shakespeare_lastword,shakespeare_cloze")
        self.names = list(names)
        shipped = local_tasks()
        self._rendered = tempfile.TemporaryDirectory(prefix="lmrepo-eval-tasks-")  # removed with this object
        for name, spec in shipped.items():
            (Path(self._rendered.name) / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        self.local = local_names(shipped)
        elsewhere = [n for n in self.names if n not in self.local and not n.endswith((".yaml", ".yml"))]
        if elsewhere:
            offline_unless_hub_reachable()
        self.manager = TaskManager(include_path=self._rendered.name, include_defaults=bool(elsewhere))

    def load(self) -> dict:
        """The harness's task dict ({"tasks": ..., "groups": ...}): each task's documents read.
        Bad names and unreachable data are one ConfigError, before any model is built."""
        try:
            loaded = self.manager.load(self.names)
        except KeyError as err:
            raise ConfigError(
                f"tasks: {err.args[0] if err.args else err}: lmrepo's local tasks are "
                f"{', '.join(sorted(self.local))}; the harness's are listed by `lm-eval ls tasks`"
            ) from None
        except (
            Exception
        ) as err:  # datasets' many kinds: ConnectionError (offline), FileNotFoundError, DatasetNotFoundError
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"tasks={','.join(self.names)}: a task's data cannot be loaded ({type(err).__name__}: {first}): "
                "hub tasks need the network the first time (then the Hugging Face cache serves them); "
                f"offline, use a local task: {', '.join(sorted(self.local))}"
            ) from None
        for name, task in loaded["tasks"].items():
            settings = task.config.generation_kwargs or {}
            if task.config.output_type == "generate_until" and settings.get("do_sample"):
                raise ConfigError(f"task {name} samples its generations (do_sample: true): lmrepo generates greedily")
        return loaded
