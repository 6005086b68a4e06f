"""Prose workloads: the King James Bible from Debian's ``bible-kjv-text`` (read with ``bible``).

The text is public domain (in the UK the Crown's letters patent still apply to printing it).
Debian packages it as ``bible-kjv-text`` (data) and ``bible-kjv`` (the ``bible`` reader, GPL);
``apt-get install bible-kjv`` brings both.

An example is a window of one chapter: the prompt is the book and chapter name followed by a few
verses, the response is the verses that follow, each line ``<verse> <text>``::

    Genesis 1
    1 In the beginning God created the heaven and the earth.
    2 And the earth was without form, and void; ...
                                  -> response: "3 And God said, Let there be light: ..."

Windows tile each chapter, so every verse of a training chapter is a response once. Whole
chapters go to one split (a stable hash decides).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from collections import OrderedDict

from .common import is_heldout, stable_hash

# The reader's abbreviations, in canonical order, with the full book names.
BOOKS: tuple[tuple[str, str], ...] = (
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"),
    ("Deu", "Deuteronomy"), ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"),
    ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"), ("1Ki", "1 Kings"), ("2Ki", "2 Kings"),
    ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"), ("Ezra", "Ezra"), ("Neh", "Nehemiah"),
    ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"), ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"),
    ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"),
    ("Nahum", "Nahum"), ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"),
    ("Zec", "Zechariah"), ("Mal", "Malachi"), ("Mat", "Matthew"), ("Mark", "Mark"),
    ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"), ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"), ("Gal", "Galatians"),
    ("Eph", "Ephesians"), ("Phi", "Philippians"), ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"), ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"), ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"), ("1Jn", "1 John"),
    ("2Jn", "2 John"), ("3Jn", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
)
VERSE_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")

Chapters = "OrderedDict[tuple[str, int], list[tuple[int, str]]]"


def read_kjv() -> str:
    """The whole text, one verse a line (``Ge1:1 In the beginning ...``)."""
    exe = shutil.which("bible")
    if exe is None:
        raise FileNotFoundError(
            "the `bible` reader is missing: run `apt-get install bible-kjv` (Debian; it brings "
            "bible-kjv-text, the King James text)")
    out = subprocess.run([exe, "-f", "Ge1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, check=True)
    return out.stdout


def parse_kjv(text: str) -> OrderedDict:
    names = dict(BOOKS)
    chapters: OrderedDict = OrderedDict()
    for line in text.splitlines():
        m = VERSE_RE.match(line.strip())
        if not m:
            continue
        abbr, ch, vs, body = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip()
        book = names.get(abbr)
        if book is None:
            raise ValueError(f"unknown book abbreviation {abbr!r} in line {line!r}")
        chapters.setdefault((book, ch), []).append((vs, " ".join(body.split())))
    return chapters


def _lines(verses: list[tuple[int, str]]) -> str:
    return "".join(f"{v} {t}\n" for v, t in verses)


def windows(verses: list[tuple[int, str]], prompt_verses: int, response_verses: int):
    """Tile a chapter into (prompt verses, response verses) pairs."""
    step = prompt_verses + response_verses
    for s in range(0, len(verses) - prompt_verses, step):
        p = verses[s:s + prompt_verses]
        r = verses[s + prompt_verses:s + step]
        if r:
            yield s, p, r


def build(heldout_percent: float, salt: str, num_heldout: int, seed: int,
          prompt_verses: int = 2, response_verses: int = 3,
          text: str | None = None) -> dict[str, list[dict]]:
    chapters = parse_kjv(read_kjv() if text is None else text)
    out: dict[str, list[dict]] = {"train": [], "heldout": []}
    keys = [f"{book} {ch}" for book, ch in chapters]
    held_keys = {k for k in keys if is_heldout(k, heldout_percent, salt)}
    if not held_keys and num_heldout > 0 and len(keys) > 1:
        # A small text may draw no held-out chapter: take the one with the lowest hash.
        held_keys = {min(keys, key=lambda k: stable_hash(f"{salt}:{k}"))}
    held_candidates = []
    for (book, ch), verses in chapters.items():
        key = f"{book} {ch}"
        held = key in held_keys
        for _s, p, r in windows(verses, prompt_verses, response_verses):
            rec = {"id": f"prose/kjv/{book.replace(' ', '')}.{ch}.{p[0][0]}", "domain": "prose",
                   "source": f"kjv/{key}", "prompt": f"{key}\n{_lines(p)}",
                   "response": _lines(r)}
            (held_candidates if held else out["train"]).append(rec)
    rng = random.Random(seed)
    out["heldout"] = sorted(rng.sample(held_candidates, min(num_heldout, len(held_candidates))),
                            key=lambda rec: rec["id"])
    return out
