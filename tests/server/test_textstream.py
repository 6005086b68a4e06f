"""TextStream: streamed pieces join to the whole text; stop strings never leak, even in part."""

from __future__ import annotations

import pytest

from sglang_adaflash.server.textstream import TextStream


class ByteTokenizer:
    """One token per byte, decoded as UTF-8 with replacement, like a byte-level BPE without merges."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: bytes, stops=None, step: int = 1):
    ts = TextStream(ByteTokenizer(), stops)
    ids, pieces = [], []
    for i in range(0, len(text), step):
        ids.extend(text[i:i + step])
        pieces.append(ts.update(ids))
        if ts.stopped:
            break
    pieces.append(ts.finish())
    return ts, pieces


@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_join_to_the_decoded_whole_and_split_characters_wait(step):
    text = "naïve café → 数学 ok".encode()
    ts, pieces = _stream(text, step=step)
    assert "".join(pieces) == text.decode() == ts.text
    assert all("\ufffd" not in p for p in pieces)  # never half a character on the wire


def test_invalid_bytes_in_the_middle_are_kept_as_the_whole_decode_has_them():
    text = b"ab\xffcd\xe2\x82"  # a stray byte, then a character cut off by the end
    ts, pieces = _stream(text)
    assert "".join(pieces) == text.decode("utf-8", errors="replace")


@pytest.mark.parametrize("step", [1, 4])
def test_a_stop_string_ends_the_text_before_it_and_never_leaks(step):
    ts, pieces = _stream(b"hello world, STOP here", stops=["STOP", "zzz"], step=step)
    assert ts.stopped and "".join(pieces) == "hello world, "
    assert not any("S" in p for p in pieces)


def test_a_stop_string_at_the_start_gives_empty_text():
    ts, pieces = _stream(b"END and more", stops=["END"])
    assert ts.stopped and "".join(pieces) == ""


def test_held_back_text_that_is_no_stop_is_released_at_the_end():
    ts, pieces = _stream(b"abc ST", stops=["STOP"])
    assert not ts.stopped and "".join(pieces) == "abc ST"
    assert pieces[-1] == " ST"  # len("STOP") - 1 characters wait for finish()
