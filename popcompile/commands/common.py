"""What every subcommand shares: the one-line error, the cut options, quiet libraries, reading files."""
from __future__ import annotations

import argparse
from pathlib import Path


class CliError(Exception):
    """A bad invocation: printed as one line, exit code 2."""


def add_cut_options(parser, *, allow_auto: bool = False) -> None:
    cut = parser.add_mutually_exclusive_group()
    if allow_auto:
        cut.add_argument("--cut", type=_cut_or_auto, metavar="{N,auto}",
                         help="first pruned layer (1..L; L prunes nothing), or auto: chosen by `analyze` "
                              "(stage-aware importance), or with --min-agreement by the eval sweep")
    else:
        cut.add_argument("--cut", type=int, help="first pruned layer (1..L; L prunes nothing)")
    cut.add_argument("--prune-ratio", type=float, help="fraction of layers to prune from the top "
                                                       "(default 1/3: cut = L - floor(L/3))")


def _cut_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cut must be a layer index or 'auto', got {text!r}") from None


def quiet_libraries() -> None:
    """The CLI shows its own progress: silence the libraries' bars and notices (not their errors)."""
    import logging
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from torch/transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def read_text(path: Path, what: str) -> str:
    """The file's text, or a CliError naming the option (``what``) and the reason."""
    try:
        return Path(path).read_text()
    except OSError as err:
        raise CliError(f"cannot read {what} {path}: {err.strerror}") from None
