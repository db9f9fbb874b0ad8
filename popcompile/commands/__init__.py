"""Subcommands of ``popcompile``: one module each, with ``register(sub)`` adding its parser.

``register`` sets ``handler`` on the parsed namespace; handlers import torch/transformers
themselves, so building the parser (``popcompile --help``) stays light.
"""
from __future__ import annotations

#: module names under popcompile.commands, in the order ``--help`` lists them
COMMANDS = ("export", "run", "info", "check", "evaluate", "calibrate", "build_trt", "analyze")
