"""Incremental detokenization of a growing token sequence, for streams.

Decoding the whole generated sequence at every verification costs O(n) per step, O(n^2) over a
long chain of thought, on the cores the model computes on. :class:`IncrementalText` decodes only a
window at the end: the tokens since the last point where the text was complete, with the tokens
before them as context (the prefix/read offsets of vLLM's ``detokenize_incrementally``,
vllm/transformers_utils/detokenizer_utils.py), and looks for stop strings only where a new one
can have appeared. The engine's final text is still
one decode of the whole sequence (:meth:`swiftspec.engine.llm_engine.Engine._text`), by the same stop rule.
"""
from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of an unfinished UTF-8 character


class IncrementalText:
    """The text of a growing token sequence, cut before the first stop string.

    ``add(ids)`` appends tokens and returns the text so far: the decoding of every token up to the
    last one that completed a character (an unfinished UTF-8 sequence at the end is held back
    until its last byte arrives), cut before the first occurrence of any ``stop`` string. For a
    byte-level BPE tokenizer it equals ``tokenizer.decode(all_ids, skip_special_tokens=True)``
    cut at the first stop string, without the trailing replacement characters of an unfinished
    character (tested against that in tests/test_detokenize.py).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop strings (may be empty).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""           # the decoding of ids[:read] (ends on a whole character)
        self.prefix = 0          # ids[prefix:read]: context decoded with the new tokens
        self.read = 0
        self.cut: str | None = None  # the final text, once a stop string has appeared

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """Append ``ids`` (ints) and return the text so far (see the class)."""
        if self.cut is not None:
            return self.cut
        old = len(self.text)
        self.ids += ids
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if window.endswith(_INCOMPLETE):  # wait for the character's last byte; show what is whole
            out = self.text + window.rstrip(_INCOMPLETE)[len(before):]
        else:
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            out = self.text
        if self.stop:
            # text[:old] held no stop string, so one can only begin a stop string's length before
            start = max(0, old - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (out.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.cut = out[:min(hits)]
                return self.cut
        return out
