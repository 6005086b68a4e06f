"""GSM-style word problems generated from templates, with exact answers and worked solutions.

Every problem is built from a seeded ``random.Random``, so a seed fixes the whole set. The
worked solution has one fixed format, which makes the target's math answers predictable::

    Step 1: <one sentence>, so <a> <op> <b> = <c>.
    Step 2: ...
    The answer is <n>.

Numbers stay small (two-digit results at most a few hundred) so a small model can learn the
arithmetic; every step is checked when it is built.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

NAMES = (
    "Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira",
    "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera",
    "Will", "Yara", "Zoe",
)
ITEMS = (
    ("apple", "apples"), ("pencil", "pencils"), ("marble", "marbles"), ("sticker", "stickers"),
    ("cookie", "cookies"), ("book", "books"), ("shell", "shells"), ("card", "cards"),
    ("egg", "eggs"), ("flower", "flowers"), ("stamp", "stamps"), ("toy car", "toy cars"),
)
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"),
              ("crate", "crates"), ("pack", "packs"))
GOODS = (("notebook", "notebooks"), ("sandwich", "sandwiches"), ("ticket", "tickets"),
         ("pen", "pens"), ("cup of tea", "cups of tea"), ("plant", "plants"), ("ball", "balls"))

ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")


@dataclass(frozen=True)
class Problem:
    template: str
    question: str
    steps: tuple[str, ...]
    answer: int

    def solution(self) -> str:
        lines = [f"Step {i + 1}: {s}" for i, s in enumerate(self.steps)]
        lines.append(f"The answer is {self.answer}.")
        return "\n".join(lines)


def extract_answer(text: str) -> int | None:
    """The final answer stated in a solution written in the fixed format, if any."""
    found = ANSWER_RE.findall(text)
    return int(found[-1]) if found else None


def _op(a: int, sym: str, b: int) -> int:
    if sym == "+":
        return a + b
    if sym == "-":
        return a - b
    if sym == "*":
        return a * b
    if sym == "/":
        assert a % b == 0, (a, b)
        return a // b
    raise ValueError(sym)


def _eq(a: int, sym: str, b: int) -> tuple[str, int]:
    c = _op(a, sym, b)
    return f"{a} {sym} {b} = {c}", c


def _buy_and_give(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    item, items = r.choice(ITEMS)
    box, boxes = r.choice(CONTAINERS)
    n, k = r.randint(2, 9), r.randint(3, 12)
    start = r.randint(1, 20)
    total_eq, bought = _eq(n, "*", k)
    have_eq, have = _eq(start, "+", bought)
    give = r.randint(1, have - 1)
    left_eq, left = _eq(have, "-", give)
    q = (f"{name} has {start} {items}. {name} buys {n} {boxes} with {k} {items} in each {box}, "
         f"then gives {give} {items} to a friend. How many {items} does {name} have now?")
    steps = (f"{n} {boxes} with {k} {items} each hold {total_eq} {items}.",
             f"Adding the {start} {items} {name} already had gives {have_eq}.",
             f"After giving away {give}, {name} has {left_eq} {items}.")
    return Problem("buy_and_give", q, steps, left)


def _shopping(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    (g1, g1s), (g2, g2s) = r.sample(GOODS, 2)
    n1, p1, n2, p2 = r.randint(2, 6), r.randint(2, 9), r.randint(2, 6), r.randint(2, 9)
    e1, c1 = _eq(n1, "*", p1)
    e2, c2 = _eq(n2, "*", p2)
    e3, total = _eq(c1, "+", c2)
    paid = ((total // 10) + 1 + r.randint(0, 3)) * 10
    e4, change = _eq(paid, "-", total)
    q = (f"{name} buys {n1} {g1s} at ${p1} each and {n2} {g2s} at ${p2} each. {name} pays "
         f"with ${paid}. How much change, in dollars, does {name} get?")
    steps = (f"The {g1s} cost {e1} dollars.", f"The {g2s} cost {e2} dollars.",
             f"Together they cost {e3} dollars.", f"The change is {e4} dollars.")
    return Problem("shopping", q, steps, change)


def _share_equally(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    item, items = r.choice(ITEMS)
    friends = r.randint(2, 8)
    each = r.randint(2, 12)
    extra = r.randint(1, 15)
    total = friends * each + extra
    e1, shared = _eq(total, "-", extra)
    e2, per = _eq(shared, "/", friends)
    q = (f"{name} has {total} {items}. {name} keeps {extra} {items} and shares the rest equally "
         f"among {friends} friends. How many {items} does each friend get?")
    steps = (f"{name} shares {e1} {items}.", f"Each friend gets {e2} {items}.")
    return Problem("share_equally", q, steps, per)


def _weekly_savings(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_week, weeks, start = r.randint(3, 15), r.randint(2, 10), r.randint(0, 30)
    price = r.randint(5, 40)
    e1, saved = _eq(per_week, "*", weeks)
    e2, total = _eq(start, "+", saved)
    if price > total:
        price = total // 2 + 1
    e3, left = _eq(total, "-", price)
    q = (f"{name} has ${start} and saves ${per_week} every week for {weeks} weeks. Then {name} "
         f"spends ${price} on a game. How many dollars does {name} have left?")
    steps = (f"In {weeks} weeks {name} saves {e1} dollars.",
             f"With the starting money that is {e2} dollars.",
             f"After buying the game, {name} has {e3} dollars.")
    return Problem("weekly_savings", q, steps, left)


def _rows_and_columns(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    rows, cols, gone = r.randint(2, 9), r.randint(2, 9), 0
    e1, seats = _eq(rows, "*", cols)
    gone = r.randint(1, seats - 1)
    e2, empty = _eq(seats, "-", gone)
    q = (f"A hall has {rows} rows of chairs with {cols} chairs in each row. {gone} people sit "
         f"down, one per chair. {name} counts the empty chairs. How many chairs are empty?")
    steps = (f"The hall has {e1} chairs.", f"The empty chairs are {e2}.")
    return Problem("rows_and_columns", q, steps, empty)


def _pages_read(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    d1 = r.randint(5, 30)
    mult = r.randint(2, 3)
    d3 = r.randint(1, 20)
    e1, d2 = _eq(d1, "*", mult)
    e2, s12 = _eq(d1, "+", d2)
    e3, total = _eq(s12, "+", d3)
    word = "twice" if mult == 2 else "three times"
    q = (f"{name} reads {d1} pages on Monday, {word} as many pages on Tuesday, and {d3} pages on "
         f"Wednesday. How many pages does {name} read in the three days?")
    steps = (f"On Tuesday {name} reads {e1} pages.", f"Monday and Tuesday make {e2} pages.",
             f"With Wednesday the total is {e3} pages.")
    return Problem("pages_read", q, steps, total)


def _two_people(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    item, items = r.choice(ITEMS)
    na = r.randint(5, 40)
    more = r.randint(2, 20)
    e1, nb = _eq(na, "+", more)
    e2, total = _eq(na, "+", nb)
    q = (f"{a} has {na} {items}. {b} has {more} more {items} than {a}. How many {items} do "
         f"they have together?")
    steps = (f"{b} has {e1} {items}.", f"Together they have {e2} {items}.")
    return Problem("two_people", q, steps, total)


def _trip_distance(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    speed, hours = r.randint(3, 15), r.randint(2, 6)
    back = r.randint(1, 20)
    e1, dist = _eq(speed, "*", hours)
    e2, total = _eq(dist, "+", back)
    q = (f"{name} rides a bike at {speed} miles per hour for {hours} hours, then walks {back} "
         f"more miles. How many miles does {name} travel in all?")
    steps = (f"On the bike {name} goes {e1} miles.", f"With the walk that is {e2} miles.")
    return Problem("trip_distance", q, steps, total)


def _baking(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    trays, per_tray = r.randint(2, 6), r.randint(4, 12)
    eaten = r.randint(1, 5)
    bags = r.randint(2, 5)
    e1, baked = _eq(trays, "*", per_tray)
    rest = baked - eaten
    # Make the remainder divide evenly among the bags.
    rest -= rest % bags
    eaten = baked - rest
    e2, left = _eq(baked, "-", eaten)
    e3, per_bag = _eq(left, "/", bags)
    q = (f"{name} bakes {trays} trays of cookies with {per_tray} cookies on each tray. The family "
         f"eats {eaten} cookies, and {name} puts the rest into {bags} bags with the same number "
         f"in each. How many cookies go in each bag?")
    steps = (f"{name} bakes {e1} cookies.", f"After the family eats some, {e2} cookies are left.",
             f"Each bag gets {e3} cookies.")
    return Problem("baking", q, steps, per_bag)


def _garden(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    beds, plants = r.randint(2, 8), r.randint(3, 10)
    died = r.randint(2, 6)
    added = r.randint(1, 12)
    e1, total = _eq(beds, "*", plants)
    died = min(died, total - 2)
    e2, alive = _eq(total, "-", died)
    e3, final = _eq(alive, "+", added)
    q = (f"{name} plants {beds} garden beds with {plants} tomato plants in each bed. {died} plants "
         f"die, and {name} plants {added} new ones. How many tomato plants are there now?")
    steps = (f"{name} plants {e1} tomato plants.", f"After {died} die, {e2} are left.",
             f"With the new ones there are {e3} plants.")
    return Problem("garden", q, steps, final)


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "buy_and_give": _buy_and_give,
    "shopping": _shopping,
    "share_equally": _share_equally,
    "weekly_savings": _weekly_savings,
    "rows_and_columns": _rows_and_columns,
    "pages_read": _pages_read,
    "two_people": _two_people,
    "trip_distance": _trip_distance,
    "baking": _baking,
    "garden": _garden,
}


def check(problem: Problem) -> None:
    """Recompute every ``a op b = c`` in the solution and the final answer."""
    for a, sym, b, c in re.findall(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)", problem.solution()):
        if _op(int(a), sym, int(b)) != int(c):
            raise AssertionError(f"wrong step {a} {sym} {b} = {c} in {problem.template}")
    if extract_answer(problem.solution()) != problem.answer or problem.answer < 0:
        raise AssertionError(f"bad answer in {problem}")


def generate(n: int, seed: int, exclude: set[str] | None = None) -> list[Problem]:
    """``n`` distinct checked problems, the templates in turn, from one seed."""
    r = random.Random(seed)
    names = sorted(TEMPLATES)
    seen = set(exclude or ())
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 100:
            raise RuntimeError(f"could only make {len(out)} distinct problems out of {n}")
        p = TEMPLATES[names[len(out) % len(names)]](r)
        if p.question in seen:
            continue
        check(p)
        seen.add(p.question)
        out.append(p)
    return out


def build(num_train: int, num_heldout: int, seed: int) -> dict[str, list[dict]]:
    """Train and held-out records; held-out questions never occur in the train split."""
    heldout = generate(num_heldout, seed=seed + 1)
    train = generate(num_train, seed=seed, exclude={p.question for p in heldout})
    out: dict[str, list[dict]] = {}
    for split, problems in (("train", train), ("heldout", heldout)):
        out[split] = [
            {"id": f"math/{split}/{i:06d}", "domain": "math", "source": f"gsm-style/{p.template}",
             "prompt": p.question, "response": p.solution(), "answer": str(p.answer)}
            for i, p in enumerate(problems)
        ]
    return out
