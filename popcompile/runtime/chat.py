"""Multi-turn chat on one session: the KV rows of earlier turns stay in the buffer, a turn prefills only
what is new.

    turn 1   [system, user1] -> template ids p1            prefill p1 (POP), decode reply r1
    cache    p1 + r1[:-1]                                  (the last reply token never ran: nothing
                                                            came after it)
    turn 2   [.., assistant r1, user2] -> template ids p2  keep the longest common prefix of p2 and the
                                                           cache, prefill the rest of p2 after it (POP
                                                           but its last token)

The rows kept are exactly what the earlier turns wrote: the prompts' deep K/V are POP's approximation
(as a fresh POP prefill of the whole history would make them), the replies' are the full model's. Where
the template renders the reply differently from the generated ids (an end-of-turn token, another
tokenisation), the cache is cut back to the tokens both agree on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, InputError
from .kvstore import KVStore
from .tokenizer import EngineTokenizer


@dataclass
class History:
    """The token ids whose rows ``buffer`` holds, in order (len(ids) == buffer.length); ``images``: the keys
    of a vision-language chat's images, in order (multimodal.PreparedImage.key)."""

    buffer: KVStore
    ids: list[int]
    images: list[str] = field(default_factory=list)

    def keep_for(self, ids: list[int], buffer: KVStore, limit: int | None = None) -> int:
        """Cut the buffer back to the longest common prefix of its ids and ``ids`` (at least one token of
        ``ids`` is left to prefill: its logits start the reply), at most ``limit`` rows; return the rows
        kept."""
        if buffer is not self.buffer:
            return 0
        kept = min(common_prefix(self.ids, ids), len(ids) if limit is None else limit)
        buffer.truncate(kept)
        return kept


def common_prefix(cached: list[int], ids: list[int]) -> int:
    """Rows of ``cached`` that a prompt ``ids`` starts with, leaving at least its last token to prefill."""
    kept = 0
    for a, b in zip(cached, ids[:-1]):
        if a != b:
            break
        kept += 1
    return kept


def chat_prompt_ids(tokenizer: EngineTokenizer, messages: object, max_seq: int) -> list[int]:
    """``messages`` ({"role", "content"} dicts, the conversation so far) -> the template's ids with the
    generation prompt; ConfigError without a chat template, InputError for anything but such a list or
    a conversation that does not fit the engine."""
    if not tokenizer.has_chat_template:
        raise ConfigError("this engine's tokenizer has no chat template, so it cannot hold a chat: generate "
                          "from plain text with session.generate (or `popcompile run --no-chat`)")
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError("messages must be a non-empty list of {'role': str, 'content': str} dicts (a "
                         "vision-language engine's content may be a list of text and image parts), the "
                         "conversation so far, ending with the user's turn")
    ids = tokenizer.encode_chat(list(messages), add_generation_prompt=True)
    if len(ids) >= max_seq:
        raise InputError(f"the conversation is {len(ids)} tokens, more than the engine's max length "
                         f"{max_seq}: start a new one with fewer messages, or re-export with a larger "
                         "--max-seq")
    return ids
