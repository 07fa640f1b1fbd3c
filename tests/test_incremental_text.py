"""IncrementalText (model/tokenizer.py): the text of a growing list of ids, each id decoded
once (tokenizers' DecodeStream), equal at every length to decoding all of them at once (an
incomplete UTF-8 character held back), with special tokens skipped or kept, with
markers put back as ToolSpec.decode_marked puts them; and the same where DecodeStream is
missing (the whole run decoded again)."""

from __future__ import annotations

import random

import pytest

from kvsession.model import tokenizer as tokenizer_module
from kvsession.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(llama_dir):
    return Tokenizer(llama_dir)


def feeds(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """`ids` cut into pieces of 0-3 ids, as a stream's reports come."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randrange(0, 4)
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "decode again"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_the_text_at_every_length_is_the_whole_decode(tok, monkeypatch, stream, skip_special):
    if not stream:
        monkeypatch.setattr(tokenizer_module, "_DecodeStream", None)
    rng = random.Random(0)
    special = sorted(tok.eos_token_ids)
    for _ in range(60):
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 80))]
        text, given, fed = tok.incremental_text(skip_special), "", []
        for piece in feeds(rng, ids):
            given += text.extend(piece)
            fed += piece
            whole = tok.decode(fed, skip_special)
            assert text.text == given and whole.startswith(given)
            assert whole[len(given):] in ("", "\ufffd" * len(whole[len(given):]))


def test_markers_are_put_back_between_runs_as_decode_marked_does(tok):
    rng = random.Random(1)
    marker = next(iter(tok.eos_token_ids))
    markers = {marker: "[TOOL_CALLS]"}

    def decode_marked(ids):  # ToolSpec.decode_marked's rule
        parts, run = [], []
        for t in ids:
            if t in markers:
                parts += [tok.decode(run), markers[t]]
                run = []
            else:
                run.append(t)
        return "".join(parts) + tok.decode(run)

    for _ in range(30):
        ids = [marker if rng.random() < 0.1 else rng.randrange(300, tok.vocab_size)
               for _ in range(rng.randrange(1, 60))]
        text = tok.incremental_text(markers=markers)
        for piece in feeds(rng, ids):
            text.extend(piece)
        assert decode_marked(ids).startswith(text.text)
        assert decode_marked(ids).rstrip("\ufffd") == text.text.rstrip("\ufffd")
