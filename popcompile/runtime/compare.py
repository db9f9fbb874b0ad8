"""POP next to the full model on one prompt: what ``popcompile run --compare`` prints.

Both runs use the same session, prompt and sampling. POP is forced (``min_prompt_tokens=0``) so the
user sees what pruning does for *their* prompt even below the engine's threshold; the result says
whether the threshold would have chosen POP. TTFTs are medians over ``repeats`` interleaved runs
(full, pop, full, pop, ...); the texts come from the first run of each. Plain numpy: no torch.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..cost import speedup_bound
from ..engine.manifest import engine_file
from ..errors import ConfigError, EngineError
from ..threshold import DEFAULT_MIN_SPEEDUP, choose_min_prompt_tokens, speedup_bar, uses_pop
from .loop import GenerationResult


@dataclass(frozen=True)
class Comparison:
    full: GenerationResult
    pop: GenerationResult
    full_ttft_s: float          # median over the repeats
    pop_ttft_s: float
    repeats: int
    flop_bound: float | None    # full / POP prefill FLOPs of this prompt length at the engine's cut
    min_prompt_tokens: int      # the engine's threshold: below it `run` prefills in full

    @property
    def prompt_tokens(self) -> int:
        return len(self.full.prompt_token_ids)

    @property
    def speedup(self) -> float:
        return self.full_ttft_s / self.pop_ttft_s

    @property
    def matched_prefix(self) -> int:
        """Generated tokens equal in both runs before the first difference."""
        count = 0
        for a, b in zip(self.full.token_ids, self.pop.token_ids):
            if a != b:
                break
            count += 1
        return count

    @property
    def same_text(self) -> bool:
        return self.full.token_ids == self.pop.token_ids

    @property
    def pop_by_default(self) -> bool:
        """Would a plain ``run`` of this prompt use POP's prefill?"""
        return uses_pop(self.prompt_tokens, self.min_prompt_tokens)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "full": self.full.to_dict(), "pop": self.pop.to_dict(),
                "full_ttft_s": self.full_ttft_s, "pop_ttft_s": self.pop_ttft_s, "repeats": self.repeats,
                "speedup": self.speedup, "flop_bound": self.flop_bound, "same_text": self.same_text,
                "matched_prefix": self.matched_prefix, "min_prompt_tokens": self.min_prompt_tokens,
                "pop_by_default": self.pop_by_default}

    def summary(self) -> str:
        bound = f"{self.flop_bound:.2f}x" if self.flop_bound else "n/a"
        share = f" = {self.speedup / self.flop_bound:.0%} of the bound" if self.flop_bound else ""
        agree = ("identical" if self.same_text else
                 f"first {self.matched_prefix} of {len(self.full.token_ids)} tokens identical")
        default = ("POP" if self.pop_by_default else
                   f"full (prompt below the engine's {self.min_prompt_tokens}-token threshold)")
        return (f"prompt {self.prompt_tokens} tokens | TTFT full {self.full_ttft_s * 1000:.0f} ms, "
                f"POP {self.pop_ttft_s * 1000:.0f} ms: {self.speedup:.2f}x (FLOP bound {bound}{share}; "
                f"median of {self.repeats}) | texts {agree} | plain `run` uses: {default}")


def compare(session, prompt, sampling, *, chat: bool | None = None, repeats: int = 1,
            images: list | None = None) -> Comparison:
    """Run ``prompt`` in full and with POP (forced) ``repeats`` times each, interleaved."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"--repeat must be an integer >= 1, got {repeats!r}")
    runs: dict[str, list[GenerationResult]] = {"full": [], "pop": []}
    for _ in range(repeats):
        for mode in runs:
            result = session.generate(prompt, sampling, mode=mode, chat=chat, min_prompt_tokens=0,
                                      images=images)[0]
            runs[mode].append(result)
    full, pop = runs["full"][0], runs["pop"][0]
    return Comparison(
        full=full, pop=pop, repeats=repeats,
        full_ttft_s=statistics.median(r.ttft_s for r in runs["full"]),
        pop_ttft_s=statistics.median(r.ttft_s for r in runs["pop"]),
        # the text decoder's bound; with images the vision tower runs in full in both and it does not hold
        flop_bound=None if _has_images(session, full.prompt_token_ids) else engine_flop_bound(
            session.folder, len(full.prompt_token_ids), session.manifest.cut),
        min_prompt_tokens=session.min_prompt_tokens)


def text_config(config: dict) -> dict:
    """The text decoder's part of an engine's config.json: a vision-language model's ``text_config`` (where
    transformers' ``get_text_config()`` reads), a text model's whole config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def engine_flop_bound(folder: Path, n_tokens: int, cut: int) -> float | None:
    """full/POP prefill FLOPs of the text decoder from the engine's config.json; None when it is absent or
    unreadable."""
    path = engine_file(folder, "config.json", "config.json")  # refused when it leads out of the folder
    try:
        config = json.loads(path.read_text())
        return speedup_bound(text_config(config), n_tokens, cut)
    except (OSError, ValueError, TypeError, AttributeError):  # no HF config: no bound to print
        return None


#: prompt lengths ``measure_speedups`` tries, shortest first (export --min-prompt-tokens auto)
PROBE_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
#: what a vision-language engine's threshold was measured on (its record's ``prompts``)
TEXT_PROBES = ("text only: the text decoder's prefill (an image adds the vision tower's time to full and POP "
               "alike)")


def measure_speedups(session, lengths=PROBE_LENGTHS, *, repeats: int = 3, seed: int = 0,
                     stop_after: int = 2, min_speedup: float = DEFAULT_MIN_SPEEDUP) -> list[dict]:
    """TTFT full/POP of random-id prompts, shortest first: ``[{"tokens", "speedup", "flop_bound"}]``.

    The prompts are text (a vision-language engine's too: its image tokens are never drawn), so what is
    measured is the text decoder's prefill, the part POP prunes; an image adds the vision tower's time to
    full and POP alike. Each length runs ``repeats`` interleaved pairs (after one untimed pair) and keeps
    the median ratio. Stops once ``stop_after`` consecutive lengths reached ``min_speedup`` (longer prompts
    only gain more: the per-call overhead POP cannot remove shrinks relative to the work it does).
    """
    import numpy as np

    from .sampling import SamplingConfig

    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(_vocab(session)), _image_tokens(session))  # [V'] ids a prompt may draw
    one_token = SamplingConfig(max_new_tokens=1)
    table, passed = [], 0
    for length in (n for n in lengths if n < session.layout.max_seq):
        ids = [allowed[rng.integers(0, len(allowed), size=length)].tolist()]
        ratios = []
        for rep in range(repeats + 1):
            ttft = {mode: session.generate(ids, one_token, mode=mode, min_prompt_tokens=0)[0].ttft_s
                    for mode in ("full", "pop")}
            if rep:  # the first pair warms this length's allocations up
                ratios.append(ttft["full"] / ttft["pop"])
        speedup = float(np.median(ratios))
        table.append({"tokens": length, "speedup": round(speedup, 4),
                      "flop_bound": engine_flop_bound(session.folder, length, session.manifest.cut)})
        passed = passed + 1 if speedup >= speedup_bar(min_speedup, table[-1]["flop_bound"]) else 0
        if passed >= stop_after:
            break
    return table


def measured_min_prompt_tokens(session, runtime: str,
                               min_speedup: float = DEFAULT_MIN_SPEEDUP) -> tuple[int, dict]:
    """``export --min-prompt-tokens auto``: the threshold threshold.py's rule picks from this session's
    measured speedups, and the record kept in the manifest's ``extra["min_prompt_tokens"]``.

    No measured length reaching ``min_speedup`` gives ``max_seq`` (POP never pays here: every prompt
    prefills in full) with a note saying so; a buffer shorter than the shortest probe gives 0. A
    vision-language engine's record says its probes were text (``measure_speedups``)."""
    table = measure_speedups(session, min_speedup=min_speedup)
    record = {"method": "measured", "runtime": runtime, "min_speedup": min_speedup, "table": table}
    if _image_tokens(session):
        record["prompts"] = TEXT_PROBES
    if not table:
        note = f"max_seq {session.layout.max_seq} is below the shortest probe: POP everywhere"
        return 0, {**record, "note": note}
    try:
        bounds = {row["tokens"]: row["flop_bound"] for row in table}
        speedups = {row["tokens"]: row["speedup"] for row in table}
        return choose_min_prompt_tokens(speedups, min_speedup, bounds), record
    except ConfigError:
        note = (f"POP reached its bar ({min_speedup}x, or half the FLOP bound's gain) at no measured length "
                f"(up to {table[-1]['tokens']} tokens): "
                "every prompt prefills in full; give --min-prompt-tokens N to choose otherwise")
        return session.layout.max_seq, {**record, "note": note}


def _vocab(session) -> int:
    path = engine_file(session.folder, "config.json", "config.json")
    try:
        return int(text_config(json.loads(path.read_text()))["vocab_size"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise EngineError(f"{path} is missing or has no vocab_size: re-export the engine") from None


def _has_images(session, ids: list[int]) -> bool:
    """Whether the prompt ``ids`` holds an image (a vision-language engine's image placeholders)."""
    tokens = _image_tokens(session)
    return bool(tokens) and tokens[0] in ids


def _image_tokens(session) -> list[int]:
    """A vision-language engine's image tokens (placeholder, start, end): a text prompt holds none."""
    images = getattr(session, "images", None)
    if images is None:
        return []
    s = images.section
    return [s.image_token_id, s.vision_start_token_id, s.vision_end_token_id]
