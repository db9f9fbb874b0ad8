"""Hugging Face hub ids (``ORG/NAME``): the files loading reads, downloaded into the Hugging Face cache.

``fetch`` downloads config.json first and lets the caller refuse the model from it (an unsupported
architecture costs one small file, not the weights), then only what ``models.load_model`` reads: the weights
transformers picks (a safetensors index and its shards, model.safetensors, else the pytorch_model*.bin
fallback), the tokenizer, the generation config and, for a vision-language model, its processor configs. The
cache, the token (HF_TOKEN, ``hf auth login``), the endpoint (HF_ENDPOINT) and the progress bars are
huggingface_hub's own, so transformers shares the cache. ``HF_HUB_OFFLINE=1``: nothing is contacted and the id
must already be in the cache.

Every failure (a missing, private or gated repo, a bad revision, no network, a full disk) is one ModelError
naming the fix. Nothing is written outside the Hugging Face cache: the engine folder is made by the driver
after the model has loaded. Imports no torch or transformers.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import importlib
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ModelDownloadError, ModelError, ModelNotFoundError

logger = logging.getLogger(__name__)

CONFIG = "config.json"
#: besides config.json and the weights: the generation defaults and every tokenizer file transformers reads
LOADED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                "merges.txt", "chat_template.json", "chat_template.jinja")
CHAT_TEMPLATES = "additional_chat_templates/"  # named chat templates, *.jinja
#: a vision-language model's image and video processing (frontend/vision.py reads preprocessor_config.json)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
#: the weights transformers loads from a folder, in its order of preference: (index of shards, single file)
WEIGHTS = (("model.safetensors.index.json", "model.safetensors"),
           ("pytorch_model.bin.index.json", "pytorch_model.bin"))
#: a write that found no room: a full disk, a full quota, the process's file-size limit (ulimit -f)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def fetch(name: str, revision: str | None, inspect: Callable[[Path], bool], *, tried: str = "",
          hint: str = "") -> tuple[Path, str]:
    """(the snapshot folder of hub id ``name`` at ``revision``, its commit), downloading what is missing.

    ``revision``: a branch, tag or commit (None: the repo's default branch). ``inspect(folder)`` sees the
    folder once config.json is in it and before any weights are fetched: it raises to refuse the model and
    returns whether the model needs its processor configs (a vision-language model). ``tried`` (what else the
    name was tried as) and ``hint`` (a "did you mean") go into the not-found message.
    """
    from huggingface_hub import constants

    with explained(name, revision, tried=tried, hint=hint):
        if constants.HF_HUB_OFFLINE:
            folder = _cached(name, revision)
            inspect(folder)
            return folder, folder.name
        return _download(name, revision, inspect)


def _cached(name: str, revision: str | None) -> Path:
    """The cached snapshot, without contacting the hub (LocalEntryNotFoundError when there is none)."""
    from huggingface_hub import snapshot_download

    # config.json only: a snapshot holds only what was downloaded, so a whole-repo check would always fail
    return Path(snapshot_download(name, revision=revision, local_files_only=True, allow_patterns=[CONFIG]))


def _download(name: str, revision: str | None, inspect: Callable[[Path], bool]) -> tuple[Path, str]:
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    # A branch or tag resolves to a commit here and is recorded in the cache's refs/ (as transformers does);
    # huggingface_hub falls back to the cached file when the hub cannot be reached.
    config = Path(hf_hub_download(name, CONFIG, revision=revision))
    folder, commit = config.parent, config.parent.name
    processor = inspect(folder)
    try:
        info = HfApi().model_info(name, revision=commit, files_metadata=True)
    except (*network_errors(), HfHubHTTPError) as err:
        if not _weights_in(folder):
            raise
        logger.warning("popcompile: the Hugging Face hub (%s) cannot be reached (%s); using the cached %s "
                       "(commit %s)", constants.ENDPOINT, _status(err), name, commit[:12])
        return folder, commit
    sizes = {sibling.rfilename: (sibling.lfs.size if sibling.lfs else sibling.size) or 0
             for sibling in info.siblings or ()}
    wanted = select_files(name, sizes, processor=processor)
    index = next((index for index, _ in WEIGHTS if index in wanted), None)
    if index is not None:  # the shards it names are the weights
        shards = _shards(Path(hf_hub_download(name, index, revision=commit)))
        absent = sorted(shards - sizes.keys())
        if absent:
            raise ModelError(f"{name} (commit {commit[:12]}): {index} names {', '.join(absent[:3])}, which "
                             "the repo does not have: give another --revision, or tell the model's authors")
        wanted += sorted(shards)
    missing = [path for path in wanted if not (folder / path).is_file()]
    if missing:
        need = sum(sizes.get(path, 0) for path in missing)
        cache = Path(constants.HF_HUB_CACHE)
        check_room(name, need, cache)
        shown = revision or "main"
        at = f"commit {commit[:12]}" if shown == commit else f"{shown}, commit {commit[:12]}"
        logger.warning("popcompile: downloading %s (%s) into %s: %d files, %s", name, at, cache, len(missing),
                       _size(need))
        with _progress_bars():
            snapshot_download(name, revision=commit, allow_patterns=[glob.escape(path) for path in missing])
        missing = [path for path in missing if not (folder / path).is_file()]
        if missing:  # the hub went away after the listing: huggingface_hub returned what was cached
            raise ModelDownloadError(f"the download of {name} stopped before {', '.join(missing[:3])}: "
                                     f"the Hugging Face hub ({constants.ENDPOINT}) stopped answering; retry")
    return folder, commit


def select_files(name: str, sizes: dict[str, int], *, processor: bool = False) -> list[str]:
    """What loading reads of repo ``name`` holding ``sizes`` (path -> bytes): config, tokenizer, generation
    config, (``processor``) the processor configs, and one form of the weights: an index (its shards are added
    once it is read) or a single file; safetensors over pytorch_model*.bin. ModelError if there are none."""
    wanted = [path for path in sizes
              if path == CONFIG or path in LOADED_FILES or (processor and path in PROCESSOR_FILES)
              or (path.startswith(CHAT_TEMPLATES) and path.endswith(".jinja"))]
    for index, single in WEIGHTS:
        for path in (index, single):
            if path in sizes:
                return [*wanted, path]
    names = ", ".join(path for pair in WEIGHTS for path in pair)
    raise ModelError(f"{name} has none of the weights transformers loads ({names}): for a GGUF-only repo, "
                     "download the .gguf file and pass its path")


def _shards(index: Path) -> set[str]:
    try:
        return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelError(f"{index} cannot be read ({type(err).__name__}: {err}): delete it from the Hugging "
                         "Face cache and download again") from None


def _weights_in(folder: Path) -> bool:
    return any((folder / path).is_file() for pair in WEIGHTS for path in pair)


def check_room(name: str, need: int, cache: Path) -> None:
    """ModelDownloadError, before any weights arrive, if the cache's disk has under ``need`` bytes free."""
    where = next((path for path in (cache, *cache.parents) if path.exists()), None)
    if where is None:
        return
    free = shutil.disk_usage(where).free
    if need > free:
        raise ModelDownloadError(f"{name} needs {_size(need)} in the Hugging Face cache {cache} and its disk "
                                 f"has {_size(free)} free: free space there, or point HF_HOME (or "
                                 "HF_HUB_CACHE) at a disk with room")


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


@contextlib.contextmanager
def _progress_bars() -> Iterator[None]:
    """huggingface_hub's bars for the download (a terminal shows them), though the CLI silences the libraries'
    (commands.common.quiet_libraries); HF_HUB_DISABLE_PROGRESS_BARS=1 still turns them off."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if constants.HF_HUB_DISABLE_PROGRESS_BARS or not are_progress_bars_disabled():
        yield
        return
    enable_progress_bars()
    try:
        yield
    finally:
        disable_progress_bars()


def network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's HTTP client raises when the hub cannot be reached. The client is httpx, httpx2
    or requests, by version: its transport errors are looked up on the session huggingface_hub uses."""
    from huggingface_hub.utils import get_session

    client = importlib.import_module(type(get_session()).__module__.partition(".")[0])
    found = (getattr(client, attr, None) for attr in ("TransportError", "ConnectionError", "Timeout"))
    return (ConnectionError, TimeoutError,
            *(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException)))


@contextlib.contextmanager
def explained(name: str, revision: str | None, *, tried: str = "", hint: str = "") -> Iterator[None]:
    """huggingface_hub's errors (and a full disk) raised in the body, as one-line ModelErrors with the fix."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint, cache = constants.ENDPOINT, constants.HF_HUB_CACHE
    also, first = (f"; {tried}", f"{tried}; ") if tried else ("", "")  # tried: "tried: ..."
    network = network_errors()
    try:
        yield
    except GatedRepoError as err:  # before RepositoryNotFoundError, its base class
        raise ModelDownloadError(
            f"{name} is a gated model and this machine has no access ({_status(err)}): accept its licence at "
            f"{endpoint}/{name} while logged in there, then log in here (hf auth login, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError as err:
        raise ModelNotFoundError(
            f"model {name!r} was not found ({_status(err)}{also}): no such repo on the Hugging Face hub "
            f"({endpoint}), or it is private: check the id, or log in with access (hf auth login, or set "
            f"HF_TOKEN){hint}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"revision {revision!r} of {name} does not exist on the Hugging Face hub: give a branch, tag or "
            "commit of the repo to --revision (default: its main branch)") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:  # the message of the cache-only lookup, as before downloads existed
            raise ModelNotFoundError(
                f"model {name!r} was not found ({first}Hugging Face hub id in the local cache only, no "
                f"network: HF_HUB_OFFLINE is set). Fix: unset HF_HUB_OFFLINE to download it, "
                f"download it where there is network (hf download {name}) or pass a local folder / .gguf "
                f"path{hint}") from None
        raise _unreachable(name, endpoint, cache) from None
    except EntryNotFoundError:  # config.json (or an index) is not in the repo
        raise ModelError(
            f"{name} has no {CONFIG} at {revision or 'its main branch'}: popcompile loads transformers "
            "checkpoints; for a GGUF-only repo, download the .gguf file and pass its path") from None
    except HFValidationError as err:
        raise ModelNotFoundError(f"{name!r} is no file, folder or valid Hugging Face hub id ({err}{also})"
                                 f"{hint}") from None
    except HfHubHTTPError as err:  # the hub is down (5xx), rate limits (429), an expired token (401), ...
        raise ModelDownloadError(f"the Hugging Face hub ({endpoint}) refused {name} ({_status(err)}): retry "
                                 "later; a 401 means the token (HF_TOKEN, hf auth login) is not valid"
                                 ) from None
    except network:
        raise _unreachable(name, endpoint, cache) from None
    except OSError as err:
        if err.errno in NO_ROOM:
            free = _size(shutil.disk_usage(cache).free) if Path(cache).exists() else "?"
            raise ModelDownloadError(
                f"no room to download {name} into the Hugging Face cache {cache} ({err.strerror}; {free} "
                "free): free space there, or point HF_HOME (or HF_HUB_CACHE) at a disk with room") from None
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ModelDownloadError(
                f"cannot write the Hugging Face cache {cache} ({err.strerror}: {err.filename}): point "
                "HF_HOME (or HF_HUB_CACHE) at a folder you can write") from None
        raise


def _unreachable(name: str, endpoint: str, cache: str) -> ModelDownloadError:
    return ModelDownloadError(
        f"cannot reach the Hugging Face hub ({endpoint}) to download {name}, and it is not in the cache "
        f"{cache}: check the network (or HF_ENDPOINT), or download it where there is network (hf download "
        f"{name}) and set HF_HUB_OFFLINE=1")


def _status(err: BaseException) -> str:
    response = getattr(err, "response", None)
    code = getattr(response, "status_code", None)
    return f"HTTP {code}" if code is not None else type(err).__name__
