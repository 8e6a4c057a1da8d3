"""`model.pretrained` as a Hugging Face Hub repository id (`openai-community/gpt2`), not only a
directory: its files come from huggingface_hub's cache, fetched into it once when the Hub can be
reached. transformers' `from_pretrained` takes the id itself (the weights are fetched there, by
each rank, under the cache's file locks); the config check reads config.json here, before torch is
imported. Offline (HF_HUB_OFFLINE=1, or no network) the cache alone answers, and an id it lacks is
one line."""

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from lmrepo.utils.errors import ConfigError


def is_hub_id(pretrained: str) -> bool:
    """Not a path on this machine, and shaped like a repository id (`name` or `owner/name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(pretrained).expanduser().exists() or pretrained.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(pretrained)
    except HFValidationError:
        return False
    return True


@contextmanager
def quiet_retries():
    """huggingface_hub logs a warning per retry of an unreachable Hub (five, over ~20 s, for each
    file): the line before the wait says what happens, the error after it says why it failed."""
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_log.setLevel(level)


def hub_file(repo_id: str, filename: str, optional: bool = False) -> Path | None:
    """The file of the repository's main revision from the cache, fetched first if the cache lacks
    it; None when the repository has no such file. A repository that does not exist, a gated one,
    or a file the cache lacks while the Hub cannot be reached: ConfigError, unless the file is
    `optional` (None then: a repository fetched whole has every file it holds in the cache)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cached = try_to_load_from_cache(repo_id, filename)
    if isinstance(cached, str):
        return Path(cached)
    if cached is not None:  # the cache records that the repository has no such file
        return None
    offline = constants.HF_HUB_OFFLINE
    if not offline and os.environ.get("RANK", "0") == "0":
        print(f"lmrepo: fetching {filename} of {repo_id} from the Hugging Face Hub", flush=True)
    try:
        with quiet_retries():
            return Path(hf_hub_download(repo_id, filename))
    except LocalEntryNotFoundError:
        if optional:
            return None
        raise ConfigError(
            f"model.pretrained={repo_id} is not a directory here, and its {filename} is not in the Hugging Face "
            f"cache while {'HF_HUB_OFFLINE is set' if offline else 'the Hub cannot be reached'}: fetch it where "
            f"there is a network (hf download {repo_id}) or point model.pretrained at a model directory"
        ) from None
    except EntryNotFoundError:  # after its subclass LocalEntryNotFoundError
        return None
    except GatedRepoError:
        raise ConfigError(
            f"model.pretrained={repo_id} is a gated repository: accept its terms on huggingface.co and log in "
            "(hf auth login, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model.pretrained={repo_id} is neither a directory here nor a Hugging Face Hub repository "
            "(a private one needs HF_TOKEN): check the name"
        ) from None


def hub_tokenizer(repo_id: str) -> bool:
    """Whether the repository carries a tokenizer of its own (as a model directory would)."""
    return any(
        hub_file(repo_id, name, optional=True) is not None for name in ("tokenizer_config.json", "tokenizer.json")
    )
