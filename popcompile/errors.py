"""The one error family a user of popcompile sees (no imports: every layer may raise these).

    PopcompileError            something the user can fix; the message names the culprit and the fix
      ConfigError              an option or argument value (CLI flag, config field, API keyword)
      InputError               a prompt, token ids or a data file given to a command
      ModelError               a model that cannot be found, read or is not supported
        ModelNotFoundError     the name or path resolves to nothing
        UnsupportedModelError  it loads, but its architecture is not in arch.py
        ModelDownloadError     a hub id that cannot be downloaded now (gated, no network, disk full)
      EngineError              an engine folder a runtime cannot use (manifest, files, graphs, tokenizer)
      OutputError              a destination that cannot be written without losing something
      EnvironmentUnavailable   this machine lacks what the request needs (a GPU, a package)

The CLI turns these, and only these, into one line and exit code 2, or 3 for ``EnvironmentUnavailable``
(a skip, not a mistake: cli.EXIT_CODES); any other exception is a bug and keeps its traceback.
``ConfigError``, ``InputError``, ``ModelError`` and ``EngineError`` are also ``ValueError`` so that code
written against the earlier ``ValueError`` contract keeps working.
"""
from __future__ import annotations


class PopcompileError(Exception):
    """A problem the user can fix: printed by the CLI as one line, exit code 2 (3: EnvironmentUnavailable)."""


class ConfigError(PopcompileError, ValueError):
    """An option or argument has a value popcompile cannot use."""


class InputError(PopcompileError, ValueError):
    """A prompt, token ids or an input file cannot be used."""


class ModelError(PopcompileError, ValueError):
    """A model cannot be found, read or compiled."""


class ModelNotFoundError(ModelError):
    """The model name or path resolves to nothing that can be loaded."""


class UnsupportedModelError(ModelError):
    """The model exists but its architecture is not one popcompile supports."""


class ModelDownloadError(ModelError):
    """A Hugging Face hub id that cannot be downloaded now: gated, no network, no room in the cache."""


class EngineError(PopcompileError, ValueError):
    """An engine folder that a runtime cannot use; the message says why and what to do."""


class OutputError(PopcompileError):
    """Writing the requested output would fail or destroy something that is not ours."""


class EnvironmentUnavailable(PopcompileError, RuntimeError):
    """This machine lacks what the request needs (an NVIDIA GPU, a package): the CLI's exit code 3."""
