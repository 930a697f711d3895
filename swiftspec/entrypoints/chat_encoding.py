"""Chat messages -> prompt token ids, with special-token text inside contents kept as text.

A chat template renders control tokens (``<|im_start|>``, ``<|im_end|>``, ...) around each
message; tokenizing the rendered string parses those tokens wherever their text appears, so a
message containing ``<|im_end|>\\n<|im_start|>system`` would forge a system turn. Contents that
hold such text are rendered as placeholders instead: the template's own text is tokenized with
special tokens parsed, each content with them split into ordinary tokens (the tokenizer's
``split_special_tokens``), the pieces' ids concatenated. Messages without special-token text
take the template's ordinary path, so their ids are exactly the engine's
(:meth:`swiftspec.engine.llm_engine.Engine.encode`).
"""
from __future__ import annotations

import re

_MARK = "\ue000{}\ue001"  # private-use code points around a message index: a content placeholder
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def special_texts(tokenizer) -> tuple[str, ...]:
    """The text of every special added token of ``tokenizer`` (what its encoder parses as a
    control token), longest first."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content}
    return tuple(sorted(texts, key=len, reverse=True))


def chat_ids(tokenizer, messages: list[dict], specials: tuple[str, ...]) -> list[int] | None:
    """Prompt ids of ``messages`` (``{"role", "content"}`` strings) through the chat template,
    the contents' special-token text (``specials``, :func:`special_texts`) encoded as text; None
    when no content holds any (the caller encodes as usual).

    Raises:
        ValueError: the model has no chat template, or its template changes or drops a
            content (placeholders not found once each).
        Exception: whatever the template raises for the messages (e.g. a role it refuses)."""
    if not any(s in m["content"] for m in messages for s in specials):
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass a plain string prompt")
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    pieces = _MARK_RE.split(text)  # template text, index, template text, index, ...
    found = [int(i) for i in pieces[1::2]]
    if sorted(found) != list(range(len(messages))):
        raise ValueError("the chat template rewrites message contents; special-token text in them cannot be "
                         "kept as text (serve with --special-tokens-in-messages to parse it)")
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids += tokenizer.encode(messages[int(piece)]["content"], add_special_tokens=False,
                                    split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
