"""IncrementalText (swiftspec/engine/detokenize.py): the streamed text equals the whole sequence decoded
at once, cut at the earliest stop string, on a byte-level tokenizer whose tokens split UTF-8
characters, fed in chunks of every size."""
from __future__ import annotations

import random

import pytest

from swiftspec.engine.detokenize import IncrementalText


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<|im_end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.clean_up_tokenization_spaces = False
    return fast


def _whole(tok, ids, stop):
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)] if hits else text).rstrip("\ufffd")


@pytest.mark.parametrize("stop", [(), ("END",), ("é!", "xy"), ("cd", "bcd")])
def test_streamed_text_equals_the_whole_decoded_text(byte_tokenizer, stop):
    rng = random.Random(0)
    pieces = ["a", "b", "c", "d", "é", "日本", "🙂", " ", "x", "y", "END", "!", "\n"]
    for trial in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        ids = byte_tokenizer.encode(text, add_special_tokens=False)
        if trial % 5 == 0:  # a special token inside: skipped in the text
            ids.insert(len(ids) // 2, byte_tokenizer.eos_token_id)
        inc, pos, seen = IncrementalText(byte_tokenizer, stop), 0, ""
        while pos < len(ids):
            n = rng.randint(1, 4)
            out = inc.add(ids[pos:pos + n])
            pos += n
            want = _whole(byte_tokenizer, ids[:pos], stop)
            # the whole text so far (an unfinished character held back); without stop strings it
            # never takes text back (with them the engine holds back a possible stop's start)
            assert out == want and (bool(stop) or out.startswith(seen)), (text, pos)
            seen = out
        assert seen == _whole(byte_tokenizer, ids, stop), text


def test_multibyte_character_is_held_until_complete(byte_tokenizer):
    ids = byte_tokenizer.encode("a🙂", add_special_tokens=False)
    assert len(ids) == 5  # 'a' + 4 bytes
    inc = IncrementalText(byte_tokenizer)
    assert [inc.add([i]) for i in ids] == ["a", "a", "a", "a", "a🙂"]
