"""What every subcommand shares: the one-line error, the cut options, quiet libraries, reading files."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

from ..errors import ConfigError, EnvironmentUnavailable, InputError, ModelError


class CliError(ConfigError):
    """A bad invocation: printed as one line, exit code 2 (cli.EXIT_USER_ERROR)."""


def require_extras(command: str) -> None:
    """EnvironmentUnavailable naming the extra to install when ``command`` needs modules this machine lacks
    (commands.EXTRAS: a runtime-only install runs engine folders; compiling needs ``popcompile[compile]``)."""
    from . import EXTRA_MODULES, EXTRAS

    for extra in EXTRAS.get(command, ()):
        missing = [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
        if missing:
            raise EnvironmentUnavailable(
                f"popcompile {command} needs the {extra} extra ({', '.join(missing)} not installed): "
                f"pip install 'popcompile[{extra}]' (this install runs engine folders only)")


MODEL_HELP = ("shipped name (smollm2-135m, gemma3-270m), a .gguf file, a Hugging Face folder, or a hub id "
              "ORG/NAME (its config, weights and tokenizer downloaded into the Hugging Face cache; "
              "HF_HUB_OFFLINE=1: the cache only)")


def add_model_argument(parser, *, also: str = "") -> None:
    """MODEL (``also``: what else the command takes) and --revision, for every command that loads a model."""
    parser.add_argument("model", help=MODEL_HELP + also)
    parser.add_argument("--revision", metavar="REV",
                        help="with a hub id: the branch, tag or commit to download (default: the repo's main "
                             "branch); the manifest records the commit")


def add_cut_options(parser, *, allow_auto: bool = False) -> None:
    """--cut / --prune-ratio. ``allow_auto`` (export): --cut auto, the default there, chooses the cut;
    elsewhere the default is the paper's third."""
    cut = parser.add_mutually_exclusive_group()
    if allow_auto:
        cut.add_argument("--cut", type=_cut_or_auto, metavar="{N,auto}",
                         help="first pruned layer (1..L; L prunes nothing), or auto: the deepest cut whose "
                              "POP keeps the full model's first token on --min-agreement of built-in "
                              "held-out prompts (the quality floor), or with --budget chosen by `analyze`; "
                              "a vision-language model: `analyze` on image+text. Default: auto, the quality "
                              "floor (a vision-language model: the paper's third; a calibration file: its "
                              "own cut)")
        paper = "--prune-ratio 1/3: the paper's cut"
    else:
        cut.add_argument("--cut", type=int, help="first pruned layer (1..L; L prunes nothing)")
        paper = "1/3, the paper's, is the default without --cut"
    cut.add_argument("--prune-ratio", type=_ratio, metavar="{R,A/B}",
                     help=f"fraction of layers to prune from the top, a number or a fraction (cut = L - "
                          f"floor(L*R); {paper})")


#: every precision flag's one vocabulary (export --dtype; --precision of build-trt and of export --target
#: tensorrt): the names the manifest and `popcompile info` print. The short spellings are aliases.
PRECISION_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: --provider: onnxruntime's devices (runtime.ort.PROVIDERS but tensorrt: TensorRT is one switch, `run
#: --runtime tensorrt`; tests/test_adversarial_cli.py keeps the two in step)
PROVIDERS = ("cpu", "cuda")


def add_precision_option(parser, flag: str, choices, *, default: str | None, help: str) -> None:
    """A precision flag in the one vocabulary (float32, float16, bfloat16; fp32/fp16/bf16 accepted)."""
    aliases = ", ".join(short for short, name in PRECISION_ALIASES.items() if name in choices)
    parser.add_argument(flag, type=precision_name, choices=choices, default=default,
                        help=f"{help}; also spelled {aliases}")


def precision_name(text: str) -> str:
    """The one vocabulary's name of a precision spelling (fp16 -> float16); others as given, for argparse's
    choices to refuse."""
    return PRECISION_ALIASES.get(text.lower(), text.lower())


def add_provider_option(parser, help: str) -> None:
    """--provider {cpu,cuda}: onnxruntime's device (default None: cpu)."""
    parser.add_argument("--provider", type=provider_name, choices=PROVIDERS, help=help)


def provider_name(text: str) -> str:
    if text == "tensorrt":
        raise argparse.ArgumentTypeError(
            "TensorRT has one switch, `popcompile run --runtime tensorrt` (the folder's plans from "
            "`popcompile build-trt`); --provider picks onnxruntime's device: cpu or cuda")
    return text


def add_fit_options(parser) -> None:
    """--device and --calibration-budget: where a K/V fit runs and how long it may take (KVFitConfig's
    defaults; kvfit/budget.py)."""
    from ..config import DEFAULT_CALIBRATION_BUDGET_S, KVFitConfig

    parser.add_argument("--device", default=KVFitConfig.device, metavar="{auto,cpu,cuda,cuda:N,mps}",
                        help="where the K/V fit runs: auto (default: a CUDA GPU when torch sees one, else "
                             "the CPU), cpu, cuda, cuda:N or mps (the model is moved there for the fit only)")
    parser.add_argument("--calibration-budget", type=_seconds_or_none, metavar="{SECONDS,none}",
                        default=DEFAULT_CALIBRATION_BUDGET_S,
                        help="seconds the K/V fit may take (default "
                             f"{DEFAULT_CALIBRATION_BUDGET_S:g}; none: no limit). Its time is estimated "
                             "first and printed; POP++ (distill) estimated over it fits POP+ (ridge) "
                             "instead, said on stderr and in the manifest; a fit that runs out stops with "
                             "the best weights so far")


def fit_options(args) -> dict:
    """KVFitConfig's fields from add_fit_options' flags (checked there: ConfigError naming the flag)."""
    return {"device": args.device, "budget_s": args.calibration_budget}


def _seconds_or_none(text: str) -> float | None:
    if text.lower() in ("none", "inf"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--calibration-budget must be seconds or none, got {text!r}") \
            from None


def _ratio(text: str) -> float:
    """``0.25`` or a fraction ``1/3`` (exact: 1/3 of 30 layers is 10)."""
    from fractions import Fraction

    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        pass
    try:
        return float(text)  # nan, inf: a number the config's range check names
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prune-ratio must be a number or a fraction such as 1/3, got "
                                         f"{text!r}") from None


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


def check_range(flag: str, value: float | None, low: float, high: float = math.inf, *,
                below_high: bool = False) -> None:
    """ConfigError unless ``value`` is None or a finite number in [low, high] ([low, high) with
    ``below_high``)."""
    if value is None:
        return
    inside = math.isfinite(value) and low <= value and (value < high if below_high else value <= high)
    if not inside:
        bound = "" if math.isinf(high) else f" and {'<' if below_high else '<='} {high:g}"
        kind = "an integer" if isinstance(value, int) else "a finite number"
        raise ConfigError(f"{flag} must be {kind} >= {low:g}{bound}, got {value}")


def precheck_model(name: str) -> None:
    """ModelError in a second (before torch loads) for a model folder whose config.json is damaged."""
    path = Path(name).expanduser()
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            ok = isinstance(json.loads(config.read_text(encoding="utf-8")), dict)
        except (OSError, ValueError) as err:
            raise ModelError(f"{config} cannot be read ({err}): "
                             "repair or re-download the model folder") from None
        if not ok:
            raise ModelError(f"{config} is not a JSON object: repair or re-download the model folder")


def read_text(path: Path, what: str) -> str:
    """The file's text (UTF-8), or an InputError naming the option (``what``), the file and the reason."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {err.start}): convert it to UTF-8") from None


def jsonl_texts(text: str, field: str = "text") -> list[str]:
    """Texts of a JSON-lines file: each line a JSON string or an object with a string ``field`` (blank lines
    skipped). No torch: `run --prompts` reads these on a runtime-only install."""
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"JSONL line {number} is not JSON: {err.msg}") from None
        value = item.get(field) if isinstance(item, dict) else item
        if not isinstance(value, str):
            raise InputError(f"JSONL line {number}: expected a string or an object with a string "
                             f"{field!r} field")
        texts.append(value)
    return texts


def add_corpus_options(p, verb: str, windows: str = "") -> None:
    """--text / --jsonl / --jsonl-field: the user's own text instead of the built-in corpus (``windows``:
    how the command reads it, said in --text's help)."""
    p.add_argument("--text", type=Path, action="append", default=[],
                   help=f"{verb} on this text file instead of the built-in corpus (repeatable)"
                        + (f"; {windows}" if windows else ""))
    p.add_argument("--jsonl", type=Path, action="append", default=[],
                   help=f"{verb} on this JSON-lines file: one string, or object with --jsonl-field, per line "
                        "(repeatable)")
    p.add_argument("--jsonl-field", default="text",
                   help="field holding the text in --jsonl objects (default text)")


def user_sources(args) -> dict[str, list[str]] | None:
    """{file: texts} of --text and --jsonl, in the order given; None for the built-in corpus."""
    sources: dict[str, list[str]] = {}
    for path in args.text:
        sources[str(path)] = [read_text(path, "--text")]
    for path in args.jsonl:
        try:
            sources[str(path)] = jsonl_texts(read_text(path, "--jsonl"), args.jsonl_field)
        except ValueError as err:
            raise InputError(f"--jsonl {path}: {err}") from None
    return sources or None
