"""``popcompile eval ENGINE_FOLDER``: score an exported engine itself, with onnxruntime (``OrtSession``).

Two variants, the two modes of the runtime on the engine's own graphs::

    full   decode graph on x_1..x_N                             (session mode "full")
    pop    prefill graph on x_1..x_N, x_N's logits out of it   (session mode "pop": the engine's cut,
           with whatever K/V calibration it was exported with; both recorded in results.json; an engine
           exported with --boundary separate runs x_1..x_{N-1}, then the decode graph on x_N)

The pop variant always prunes: the engine's ``min_prompt_tokens`` (short prompts prefilled in full by
``run``) is set to 0 here, so the scores describe POP itself (results.json records the engine's value).
Prompts are encoded as ``popcompile run`` encodes them (``runtime.loop.encode_prompt``): under the chat
template, ``EngineTokenizer.encode_chat``, which adds no special tokens of its own; raw text with them.
Decoding is greedy whatever the engine's generation_config.json says, so the scores are reproducible.

The ablations (pop-no-boundary, shortgpt, ...), other cuts and ``--sweep`` need the model: an engine
holds one cut. Tasks, data, metrics and the results schema are ``scoring.py``'s (``score_continuations``,
``generation_task``, ``humaneval_scores``); only where the logits and tokens come from differs:

- continuation: the decode graph returns the logits of its last position only ([B, V]), so after the
  prefix (the runtime's prefill, ``loop.Generation.prefill``, in the variant's mode) the continuation
  runs as C-1 one-token decode steps: [B, C, V].
- generation: ``OrtSession.generate`` (greedy), one prompt at a time, as the runtime serves it.
- greedy: the full model's greedy tokens by decode steps in mode full, each variant's logits on them as in
  continuation (greedy.py).
- humaneval: greedy steps through the same prefill and decode steps with humaneval.py's stop rule (the
  code block closed, or a line at column 0), prompt formats, extraction and harness.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ...engine.manifest import MANIFEST, engine_file
from ...errors import ConfigError
from ...runtime.sampling import SamplingConfig
from . import data as eval_data
from .config import EvalConfig
from .greedy import greedy_task
from .humaneval import humaneval_scores
from .report import write_results
from .scoring import BASELINE, VARIANTS, batch_size_for, generation_task, score_continuations, timed

#: variant -> OrtSession mode
ENGINE_VARIANTS = {"full": "full", "pop": "pop"}


def is_engine_folder(path: str | Path) -> bool:
    """Whether ``path`` is an exported engine folder (it holds ``popcompile.json``)."""
    return (Path(path).expanduser() / MANIFEST).is_file()


def engine_variant_names(variant_names: Iterable[str] | None, cut: int | None, prune_ratio: float | None,
                         do_sweep: bool) -> list[str]:
    """The variants to run on an engine (``full`` first); a one-line ConfigError for what needs the model."""
    for flag, given in (("--sweep", do_sweep), ("--cut", cut is not None),
                        ("--prune-ratio", prune_ratio is not None)):
        if given:
            raise ConfigError(f"{flag} needs the model, and an engine folder holds one exported cut: "
                             "give the model's name or path instead")
    names = list(dict.fromkeys([BASELINE, *(ENGINE_VARIANTS if variant_names is None else variant_names)]))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant(s) {', '.join(unknown)}: an engine folder runs "
                          f"{', '.join(ENGINE_VARIANTS)}")
    ablations = [n for n in names if n not in ENGINE_VARIANTS]
    if ablations:
        raise ConfigError(f"variant(s) {', '.join(ablations)} need the model (an engine folder runs only "
                         f"{' and '.join(ENGINE_VARIANTS)}): give the model's name or path for the ablations")
    return names


class EvalTokenizer:
    """An ``EngineTokenizer`` called like the HF tokenizer that data.py and humaneval.py expect."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.tokenizer.encode(text, add_special_tokens=add_special_tokens)}

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, return_dict: bool = False) -> str | list[int]:
        """The rendered text, or (``tokenize=True``) its ids as ``run`` encodes a chat prompt
        (encode_chat)."""
        assert not return_dict, "EvalTokenizer returns ids or text, not a BatchEncoding"
        if tokenize:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class EngineRun:
    """One unpadded sequence batch through the session's public ``prefill`` / ``step`` (the runtime's own
    prefill schedule and backend, its KV buffer)."""

    def __init__(self, session: Any):
        self.session = session

    def start(self, prompt: np.ndarray, mode: str) -> np.ndarray:
        """Prefill ``prompt`` ids [B, N] from an empty cache as ``run`` does in ``mode``, always pruning in
        pop (min_prompt_tokens 0); the logits [B, V] that predict token N+1."""
        if mode not in ENGINE_VARIANTS.values():
            raise ValueError(f"mode must be one of {', '.join(ENGINE_VARIANTS.values())}, got {mode!r}")
        return self.session.prefill(prompt, mode)

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Decode graph on ``ids`` [B, T] after the cached rows; logits [B, V] of the last of them."""
        return self.session.step(ids)

    @property
    def length(self) -> int:
        """Cache rows of the sequence in progress."""
        return self.session.cache_length


def continuation_logits(run: EngineRun, prefix: np.ndarray, continuation: np.ndarray,
                        mode: str) -> np.ndarray:
    """Teacher-forced logits [B, C, V] predicting ``continuation`` [B, C] after ``prefix`` [B, N] was
    prefilled in ``mode``: row 0 from the prefill, rows 1..C-1 from one-token decode steps (the decode
    graph returns the last position's logits only, so a C-token step would give one row)."""
    rows = [run.start(prefix, mode)]
    for j in range(continuation.shape[1] - 1):
        rows.append(run.step(continuation[:, j:j + 1]))
    return np.stack(rows, axis=1)


def greedy(run: EngineRun, ids: list[int], mode: str, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
           stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy new ids of one prompt, ending after eos, after the token for which ``stop(tokens)`` holds,
    at ``max_new_tokens`` or when the engine's max length is reached (``humaneval.generate_until``'s rule)."""
    logits, tokens, eos = run.start(np.array([ids], dtype=np.int64), mode), [], set(eos_token_ids)
    while True:
        tokens.append(int(logits[0].argmax()))
        if (tokens[-1] in eos or (stop is not None and stop(tokens)) or len(tokens) >= max_new_tokens
                or run.length >= run.session.layout.max_seq):
            return tokens
        logits = run.step(np.array([[tokens[-1]]], dtype=np.int64))


def session_generate(session: Any, max_new_tokens: int) -> Callable[[str, list[int]], list[int]]:
    """(variant, prompt ids) -> new ids: greedy ``OrtSession.generate`` in the variant's mode, as served
    (pop always pruned: min_prompt_tokens 0)."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    return lambda name, ids: session.generate([ids], sampling, mode=ENGINE_VARIANTS[name],
                                              min_prompt_tokens=0)[0].token_ids


def _continuation_task(session: Any, tok: EvalTokenizer, names: list[str], limit: int | None, prefix_len: int,
                       cont_len: int, batch_size: int | None, texts=None) -> dict:
    if prefix_len + cont_len - 1 > session.layout.max_seq:
        raise ConfigError(f"--prefix-len {prefix_len} + --cont-len {cont_len} do not fit the engine's "
                          f"max length {session.layout.max_seq}: shorten them or re-export with a larger "
                          "--max-seq")
    docs, skipped = eval_data.continuation_documents(tok, prefix_len, cont_len, limit, texts)
    run = EngineRun(session)
    logits = lambda name, prefix, target: torch.from_numpy(
        continuation_logits(run, prefix.numpy(), target.numpy(), ENGINE_VARIANTS[name]))
    batch_size = batch_size or batch_size_for(_vocab(session), cont_len)
    return {"documents": len(docs), "names": [d.name for d in docs], "skipped_too_short": len(skipped),
            "variants": score_continuations(docs, names, logits, batch_size)}


def greedy_functions(run: EngineRun, greedy_tokens: int) -> tuple[Callable, Callable]:
    """What greedy.greedy_scores takes, from the engine: (the full model's tokens by ``greedy`` in mode full,
    each variant's teacher-forced logits by ``continuation_logits`` in its mode)."""
    eos = run.session.tokenizer.eos_token_ids
    generate_full = lambda ids: greedy(run, ids, ENGINE_VARIANTS[BASELINE], greedy_tokens, eos)
    logits = lambda name, prompt, target: torch.from_numpy(
        continuation_logits(run, prompt.numpy(), target.numpy(), ENGINE_VARIANTS[name]))
    return generate_full, logits


def _vocab(session: Any) -> int:
    """The logits' width for batch sizing: the tokenizer's vocabulary (the graph's may be padded a little)."""
    return session.tokenizer.vocab_size


def _header(folder: str | Path, session: Any, names: list[str], prefix_len: int, cont_len: int,
            limit: int | None, provider: str) -> dict:
    """results.json's fields before the tasks: run.run_eval's, plus the engine, provider and K/V fit."""
    from ...cost import speedup_bound
    from ...runtime.compare import text_config

    manifest = session.manifest
    config = json.loads(engine_file(folder, "config.json", "config.json").read_text())
    calibration = manifest.extra.get("kv_calibration")
    describe = lambda name: {
        "mode": ENGINE_VARIANTS[name], "cut": manifest.num_layers if name == "full" else manifest.cut,
        "boundary": True, "kv_projection": True, "shortgpt": False,
        "kv_refit": name != "full" and bool(calibration)}
    return {
        "model": manifest.model.get("name"), "engine": str(folder), "provider": provider,
        "model_type": manifest.model.get("model_type"), "num_layers": manifest.num_layers,
        "cut": manifest.cut,
        "kv_calibration": calibration, "engine_min_prompt_tokens": manifest.min_prompt_tokens,
        "prefix_len": prefix_len, "cont_len": cont_len,
        "speedup_bound": speedup_bound(text_config(config), prefix_len, manifest.cut),  # a VLM: its text
        "variants": {n: describe(n) for n in names}, "limit": limit, "tasks": {}}


def run_engine_eval(folder: str | Path, out: Path, c: EvalConfig) -> dict:
    """``run.run_eval`` on an engine folder: write ``out/results.json`` and the plots; return the
    results."""
    from ...runtime import open_session

    if "chat" in c.tasks:  # its pop-carried variant replays the full model's replies into a POP cache
        raise ConfigError("the chat task runs through the reference on a model (give its name, e.g. "
                          "smollm2-135m), not on an engine folder: leave chat out of --tasks")
    names = engine_variant_names(c.variants, c.cut, c.prune_ratio, c.sweep)
    provider = c.provider or "cpu"
    session = open_session(Path(folder).expanduser(), "onnxruntime", provider=provider, threads=c.threads)
    tok, run = EvalTokenizer(session.tokenizer), EngineRun(session)
    results = _header(folder, session, names, c.prefix_len, c.cont_len, c.limit, provider)
    results["continuation_text"] = [name for name, _ in c.texts] if c.texts else None  # None: built-in
    t = results["tasks"]
    if "continuation" in c.tasks:
        t["continuation"] = timed(lambda: _continuation_task(session, tok, names, c.limit, c.prefix_len,
                                                              c.cont_len, c.batch_size, c.texts))
    if "generation" in c.tasks:
        generate = session_generate(session, c.gen_tokens)
        t["generation"] = timed(lambda: generation_task(tok, names, generate, c.limit, c.gen_tokens))
    if "greedy" in c.tasks:
        t["greedy"] = timed(lambda: greedy_task(tok, names, *greedy_functions(run, c.greedy_tokens), c.limit,
                                                c.greedy_tokens, session.layout.max_seq))
    if "humaneval" in c.tasks:
        problems = eval_data.humaneval_problems()[:c.limit]
        eos = session.tokenizer.eos_token_ids
        complete = lambda name, ids, stop: greedy(run, ids, ENGINE_VARIANTS[name], c.code_tokens, eos, stop)
        t["humaneval"] = timed(lambda: {
            "problems": len(problems), "max_new_tokens": c.code_tokens, **humaneval_scores(
                complete, tok, problems, names, allow_code_exec=c.allow_code_exec, timeout=c.timeout,
                prompt_format=c.code_prompt)})
    write_results(results, out, c.force)
    return results
