"""``popcompile eval ENGINE_FOLDER``: score an exported engine itself, with onnxruntime (``PopSession``).

Two variants, the two modes of the runtime on the engine's own graphs::

    full   decode graph on x_1..x_N                         (session mode "full")
    pop    prefill graph on x_1..x_{N-1}, decode graph on x_N  (session mode "pop": the engine's cut,
           with whatever K/V calibration it was exported with; both recorded in results.json)

The ablations (pop-no-boundary, shortgpt, ...), other cuts and ``--sweep`` need the model: an engine
holds one cut. Tasks, data, metrics and the results schema are ``evaluate.py``'s (``score_continuations``,
``generation_task``, ``humaneval_scores``); only where the logits and tokens come from differs:

- continuation: the decode graph returns the logits of its last position only ([B, V]), so after the
  prefix (in the variant's mode) the continuation runs as C-1 one-token decode steps: [B, C, V].
- generation: ``PopSession.generate`` (greedy), one prompt at a time, as the runtime serves it.
- humaneval: greedy steps through the same graphs with humaneval.py's stop rule (the code block closed,
  or a line at column 0), prompt formats, extraction and harness.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from . import eval_data
from .evaluate import (BASELINE, VARIANTS, _timed, _write, batch_size_for, generation_task,
                       score_continuations)
from .eval_config import EvalConfig
from .exporters.manifest import MANIFEST
from .humaneval import humaneval_scores
from .runtime.generate import SamplingConfig
from .runtime.kvbuffer import KVBuffer

#: variant -> PopSession mode
ENGINE_VARIANTS = {"full": "full", "pop": "pop"}


def is_engine_folder(path: str | Path) -> bool:
    """Whether ``path`` is an exported engine folder (it holds ``popcompile.json``)."""
    return (Path(path).expanduser() / MANIFEST).is_file()


def engine_variant_names(variant_names: Iterable[str] | None, cut: int | None, prune_ratio: float | None,
                         do_sweep: bool) -> list[str]:
    """The variants to run on an engine (``full`` first); a one-line ValueError for what needs the model."""
    for flag, given in (("--sweep", do_sweep), ("--cut", cut is not None), ("--prune-ratio", prune_ratio is not None)):
        if given:
            raise ValueError(f"{flag} needs the model, and an engine folder holds one exported cut: "
                             "give the model's name or path instead")
    names = list(dict.fromkeys([BASELINE, *(ENGINE_VARIANTS if variant_names is None else variant_names)]))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}: an engine folder runs {', '.join(ENGINE_VARIANTS)}")
    ablations = [n for n in names if n not in ENGINE_VARIANTS]
    if ablations:
        raise ValueError(f"variant(s) {', '.join(ablations)} need the model (an engine folder runs only "
                         f"{' and '.join(ENGINE_VARIANTS)}): give the model's name or path for the ablations")
    return names


class EvalTokenizer:
    """An ``EngineTokenizer`` called like the HF tokenizer that eval_data.py and humaneval.py expect."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.tokenizer.encode(text, add_special_tokens=add_special_tokens)}

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        if tokenize:
            raise ValueError("EvalTokenizer.apply_chat_template renders text only (tokenize=False)")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class EngineRun:
    """One sequence batch through the session's graphs and backend (IO binding), step by step, with a
    KV buffer of its own (allocated again only for a larger batch)."""

    def __init__(self, session: Any):
        self.session, self.buffer = session, None

    def start(self, prompt: np.ndarray, mode: str) -> np.ndarray:
        """Prefill ``prompt`` ids [B, N] from an empty cache as ``mode`` does; the logits [B, V] that
        predict token N+1. pop: prefill graph on x_1..x_N when the engine's boundary is folded (it returns
        x_N's logits), else on x_1..x_{N-1} and the decode graph on x_N; full: decode graph on x_1..x_N."""
        if mode not in ENGINE_VARIANTS.values():
            raise ValueError(f"mode must be one of {', '.join(ENGINE_VARIANTS.values())}, got {mode!r}")
        if self.buffer is None or self.buffer.batch < prompt.shape[0]:
            self.buffer = KVBuffer(self.session.layout, prompt.shape[0])
        self.buffer.reset()
        if mode == "pop" and self.session.manifest.boundary == "folded" and prompt.shape[1] > 1:
            return self._run("prefill", prompt)
        split = prompt.shape[1] - 1 if mode == "pop" else 0
        if split > 0:
            self._run("prefill", prompt[:, :split])
        return self._run("decode", prompt[:, split:])

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Decode graph on ``ids`` [B, T] after the cached rows; logits [B, V] of the last of them."""
        return self._run("decode", ids)

    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray | None:
        batch, steps = ids.shape
        past, mask = self.buffer.length, np.ones((batch, steps), np.int64)
        feeds = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64),
                 "position_ids": np.tile(np.arange(past, past + steps, dtype=np.int64), (batch, 1)),
                 "attention_mask": self.buffer.attention_mask(batch, mask)}
        logits, present = self.session.backend.run(graph, feeds, self.buffer)
        self.buffer.write(present, mask)
        return logits


def continuation_logits(run: EngineRun, prefix: np.ndarray, continuation: np.ndarray, mode: str) -> np.ndarray:
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
                or run.buffer.length >= run.session.layout.max_seq):
            return tokens
        logits = run.step(np.array([[tokens[-1]]], dtype=np.int64))


def session_generate(session: Any, max_new_tokens: int) -> Callable[[str, list[int]], list[int]]:
    """(variant, prompt ids) -> new ids: greedy ``PopSession.generate`` in the variant's mode, as served."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    return lambda name, ids: session.generate([ids], sampling, mode=ENGINE_VARIANTS[name])[0].token_ids


def _continuation_task(session: Any, tok: EvalTokenizer, names: list[str], limit: int | None, prefix_len: int,
                       cont_len: int, batch_size: int | None) -> dict:
    if prefix_len + cont_len - 1 > session.layout.max_seq:
        raise ValueError(f"--prefix-len {prefix_len} + --cont-len {cont_len} do not fit the engine's max length "
                         f"{session.layout.max_seq}: shorten them or re-export with a larger --max-seq")
    docs, skipped = eval_data.continuation_documents(tok, prefix_len, cont_len, limit)
    run = EngineRun(session)
    logits = lambda name, prefix, target: torch.from_numpy(
        continuation_logits(run, prefix.numpy(), target.numpy(), ENGINE_VARIANTS[name]))
    batch_size = batch_size or batch_size_for(_vocab(session), cont_len)
    return {"documents": len(docs), "names": [d.name for d in docs], "skipped_too_short": len(skipped),
            "variants": score_continuations(docs, names, logits, batch_size)}


def _vocab(session: Any) -> int:
    size = session.sessions["decode"].get_outputs()[0].shape[1]
    return size if isinstance(size, int) else session.tokenizer.vocab_size


def _header(folder: str | Path, session: Any, names: list[str], prefix_len: int, cont_len: int,
            limit: int | None, provider: str) -> dict:
    """results.json's fields before the tasks: evaluate.run_eval's, plus the engine, provider and K/V fit."""
    from .cost import speedup_bound

    manifest = session.manifest
    config = json.loads((Path(folder) / "config.json").read_text())
    calibration = manifest.extra.get("kv_calibration")
    describe = lambda name: {
        "mode": ENGINE_VARIANTS[name], "cut": manifest.num_layers if name == "full" else manifest.cut,
        "boundary": True, "kv_projection": True, "shortgpt": False,
        "kv_refit": name != "full" and bool(calibration)}
    return {
        "model": manifest.model.get("name"), "engine": str(folder), "provider": provider,
        "model_type": manifest.model.get("model_type"), "num_layers": manifest.num_layers, "cut": manifest.cut,
        "kv_calibration": calibration, "prefix_len": prefix_len, "cont_len": cont_len,
        "speedup_bound": speedup_bound(config, prefix_len, manifest.cut),
        "variants": {n: describe(n) for n in names}, "limit": limit, "tasks": {}}


def run_engine_eval(folder: str | Path, out: Path, c: EvalConfig) -> dict:
    """``evaluate.run_eval`` on an engine folder: write ``out/results.json`` and the plots; return the results."""
    from .runtime.ort import PopSession

    names = engine_variant_names(c.variants, c.cut, c.prune_ratio, c.sweep)
    provider = c.provider or "cpu"
    session = PopSession(Path(folder).expanduser(), provider=provider, threads=c.threads)
    tok, run = EvalTokenizer(session.tokenizer), EngineRun(session)
    results = _header(folder, session, names, c.prefix_len, c.cont_len, c.limit, provider)
    t = results["tasks"]
    if "continuation" in c.tasks:
        t["continuation"] = _timed(lambda: _continuation_task(session, tok, names, c.limit, c.prefix_len,
                                                              c.cont_len, c.batch_size))
    if "generation" in c.tasks:
        generate = session_generate(session, c.gen_tokens)
        t["generation"] = _timed(lambda: generation_task(tok, names, generate, c.limit, c.gen_tokens))
    if "humaneval" in c.tasks:
        problems = eval_data.humaneval_problems()[:c.limit]
        eos = session.tokenizer.eos_token_ids
        complete = lambda name, ids, stop: greedy(run, ids, ENGINE_VARIANTS[name], c.code_tokens, eos, stop)
        t["humaneval"] = _timed(lambda: {"problems": len(problems), "max_new_tokens": c.code_tokens, **humaneval_scores(
            complete, tok, problems, names, allow_code_exec=c.allow_code_exec, timeout=c.timeout,
            prompt_format=c.code_prompt)})
    _write(results, out)
    return results
