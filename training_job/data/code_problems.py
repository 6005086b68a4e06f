"""Short typed Python problems in the layout of HumanEval prompts, generated from templates.

The code domain's held-out prompts are HumanEval's (a typed ``def`` line, a docstring that opens
with a space and ends with ``>>>`` examples); the code training prompts are standard-library
functions, whose headers and docstrings look different, so the drafter never sees what the
target writes after a prompt of HumanEval's shape. These problems fill that gap without using
any HumanEval problem: each comes from one of a few dozen task families written for this
project (a function name, a typed signature, a one-paragraph description, a reference body), with
a seeded choice of name, wording, typing style and examples; every example's output is computed
by running the family's reference implementation on its input, so the docstrings are true.

The reference bodies are the records' ``response`` (the drafter's continuation data cuts inside
them); the drafter itself trains on what the target writes (training_job/models.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One task: names to pick from, the parameters and return type (``T`` marks a container
    type written as ``List``/``list``), wordings of the description, the reference body, a
    callable equal to it, and a generator of example arguments."""

    names: tuple[str, ...]
    params: tuple[tuple[str, str], ...]  # (name, annotation with {L} for List/list)
    returns: str
    wordings: tuple[str, ...]
    body: str
    fn: Callable
    example: Callable[[random.Random], tuple]


def _ints(r: random.Random, lo: int = -9, hi: int = 20, n: tuple[int, int] = (0, 7)) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(*n))]


def _word(r: random.Random) -> str:
    return r.choice(WORDS)


def _sentence(r: random.Random, n: tuple[int, int] = (1, 5)) -> str:
    return " ".join(_word(r) for _ in range(r.randint(*n)))


WORDS = ("apple", "banana", "cat", "dog", "level", "noon", "python", "Hello", "world", "data",
         "stack", "queue", "racecar", "Tree", "river", "sun", "moon", "abc", "xyz", "a", "spam",
         "eggs", "Code", "test", "kayak", "open", "close", "blue", "green", "red")


def _second_largest(xs):
    u = sorted(set(xs))
    return u[-2] if len(u) > 1 else None


def _merge(a, b):
    return sorted(a + b)


FAMILIES: tuple[Family, ...] = (
    Family(("sum_even", "sum_of_evens", "even_sum"), (("numbers", "{L}[int]"),), "int",
           ("Return the sum of the even numbers in the given list.",
            "Given a list of integers, add up the ones that are even and return the total."),
           "    return sum(n for n in numbers if n % 2 == 0)\n",
           lambda xs: sum(n for n in xs if n % 2 == 0), lambda r: (_ints(r),)),
    Family(("count_vowels", "vowel_count", "num_vowels"), (("text", "str"),), "int",
           ("Count how many vowels (a, e, i, o, u, in either case) the string has.",
            "Return the number of vowels in text. Both lower and upper case count."),
           "    return sum(1 for c in text.lower() if c in 'aeiou')\n",
           lambda s: sum(1 for c in s.lower() if c in "aeiou"), lambda r: (_sentence(r),)),
    Family(("reverse_words", "words_reversed", "flip_words"), (("sentence", "str"),), "str",
           ("Return the words of the sentence in reverse order, separated by single spaces.",
            "Given a sentence, reverse the order of its words."),
           "    return ' '.join(reversed(sentence.split()))\n",
           lambda s: " ".join(reversed(s.split())), lambda r: (_sentence(r),)),
    Family(("max_difference", "largest_gap", "spread"), (("values", "{L}[int]"),), "int",
           ("Return the difference between the largest and the smallest value.\n"
            "    Return 0 for an empty list.",
            "Given a list of integers, find max(values) - min(values); an empty list gives 0."),
           "    if not values:\n        return 0\n    return max(values) - min(values)\n",
           lambda xs: max(xs) - min(xs) if xs else 0, lambda r: (_ints(r),)),
    Family(("count_char", "char_count", "how_many"), (("text", "str"), ("char", "str")), "int",
           ("Count the occurrences of char in text.",
            "Return how many times the character char appears in the string text."),
           "    return sum(1 for c in text if c == char)\n",
           lambda s, c: s.count(c), lambda r: (_sentence(r), r.choice("aeiost "))),
    Family(("factorial", "fact", "product_up_to"), (("n", "int"),), "int",
           ("Return n! for a non-negative integer n.",
            "Compute the factorial of n, the product 1 * 2 * ... * n (1 for n = 0)."),
           "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
           lambda n: __import__("math").factorial(n), lambda r: (r.randint(0, 8),)),
    Family(("digit_sum", "sum_digits", "digits_total"), (("n", "int"),), "int",
           ("Return the sum of the decimal digits of a non-negative integer.",
            "Given a positive integer n, add up its digits."),
           "    return sum(int(d) for d in str(n))\n",
           lambda n: sum(int(d) for d in str(n)), lambda r: (r.randint(0, 99999),)),
    Family(("capitalize_words", "title_words", "upper_first"), (("sentence", "str"),), "str",
           ("Make the first letter of every word upper case.",
            "Return the sentence with each word capitalized."),
           "    return ' '.join(w.capitalize() for w in sentence.split())\n",
           lambda s: " ".join(w.capitalize() for w in s.split()), lambda r: (_sentence(r),)),
    Family(("second_largest", "next_largest", "runner_up"), (("numbers", "{L}[int]"),),
           "Optional[int]",
           ("Return the second largest distinct value in the list, or None if there is none.",
            "Find the second biggest number among the distinct values of numbers.\n"
            "    Return None when the list has fewer than two distinct values."),
           "    values = sorted(set(numbers))\n    if len(values) < 2:\n        return None\n"
           "    return values[-2]\n",
           _second_largest, lambda r: (_ints(r, 0, 9),)),
    Family(("pairwise_sums", "adjacent_sums", "neighbour_sums"), (("numbers", "{L}[int]"),),
           "{L}[int]",
           ("Return the sums of each pair of neighbouring elements.",
            "For a list of integers, return [numbers[0] + numbers[1], numbers[1] + numbers[2], ...]."),
           "    return [a + b for a, b in zip(numbers, numbers[1:])]\n",
           lambda xs: [a + b for a, b in zip(xs, xs[1:])], lambda r: (_ints(r),)),
    Family(("rotate_left", "rotate", "shift_list"), (("items", "{L}[int]"), ("k", "int")),
           "{L}[int]",
           ("Rotate the list to the left by k positions.",
            "Move the first k elements of items to its end and return the new list."),
           "    if not items:\n        return []\n    k %= len(items)\n    return items[k:] + items[:k]\n",
           lambda xs, k: (xs[k % len(xs):] + xs[:k % len(xs)]) if xs else [],
           lambda r: (_ints(r, 0, 9, (1, 6)), r.randint(0, 7))),
    Family(("flatten", "flatten_list", "concat_lists"), (("lists", "{L}[{L}[int]]"),), "{L}[int]",
           ("Flatten a list of lists into one list, keeping the order.",
            "Concatenate the inner lists of lists."),
           "    return [x for inner in lists for x in inner]\n",
           lambda ls: [x for i in ls for x in i],
           lambda r: ([_ints(r, 0, 9, (0, 3)) for _ in range(r.randint(0, 4))],)),
    Family(("mean", "average", "arithmetic_mean"), (("numbers", "{L}[float]"),), "float",
           ("Return the arithmetic mean of a non-empty list of numbers.",
            "Average the values of numbers (the list is never empty)."),
           "    return sum(numbers) / len(numbers)\n",
           lambda xs: sum(xs) / len(xs),
           lambda r: ([float(r.randint(0, 10)) for _ in range(r.randint(1, 5))],)),
    Family(("count_words", "word_count", "num_words"), (("text", "str"),), "int",
           ("Return the number of words in the text, separated by whitespace.",
            "Count the words of the given string."),
           "    return len(text.split())\n",
           lambda s: len(s.split()), lambda r: (_sentence(r, (0, 6)),)),
    Family(("odd_only", "filter_odd", "keep_odd"), (("numbers", "{L}[int]"),), "{L}[int]",
           ("Return the odd numbers of the list, in order.",
            "Filter the given list, keeping only the odd integers."),
           "    return [n for n in numbers if n % 2 == 1]\n",
           lambda xs: [n for n in xs if n % 2 == 1], lambda r: (_ints(r),)),
    Family(("to_binary", "binary", "int_to_binary"), (("n", "int"),), "str",
           ("Return the binary representation of a non-negative integer as a string.",
            "Convert n to base 2 and return the digits as a string, without a prefix."),
           "    return bin(n)[2:]\n",
           lambda n: bin(n)[2:], lambda r: (r.randint(0, 64),)),
    Family(("char_frequency", "letter_counts", "count_characters"), (("text", "str"),), "Dict[str, int]",
           ("Return a dictionary mapping each character of text to the number of times it\n"
            "    occurs.",
            "Count every character of the string and return the counts as a dict."),
           "    counts = {}\n    for c in text:\n        counts[c] = counts.get(c, 0) + 1\n    return counts\n",
           lambda s: {c: s.count(c) for c in dict.fromkeys(s)}, lambda r: (_word(r),)),
    Family(("in_range", "between", "clip_filter"),
           (("numbers", "{L}[int]"), ("low", "int"), ("high", "int")), "{L}[int]",
           ("Return the numbers that lie between low and high, both included.",
            "Keep the elements n of numbers with low <= n <= high."),
           "    return [n for n in numbers if low <= n <= high]\n",
           lambda xs, lo, hi: [n for n in xs if lo <= n <= hi],
           lambda r: (_ints(r), r.randint(-5, 5), r.randint(5, 15))),
    Family(("all_positive", "positive_only", "no_negatives"), (("numbers", "{L}[int]"),), "bool",
           ("Return True if every number in the list is greater than zero.",
            "Check whether all the numbers are positive."),
           "    return all(n > 0 for n in numbers)\n",
           lambda xs: all(n > 0 for n in xs), lambda r: (_ints(r, -2, 9),)),
    Family(("product", "list_product", "multiply_all"), (("numbers", "{L}[int]"),), "int",
           ("Return the product of all the numbers, 1 for an empty list.",
            "Multiply the elements of the list together."),
           "    result = 1\n    for n in numbers:\n        result *= n\n    return result\n",
           lambda xs: __import__("math").prod(xs), lambda r: (_ints(r, -3, 6, (0, 5)),)),
    Family(("merge_sorted", "merge", "combine_sorted"), (("a", "{L}[int]"), ("b", "{L}[int]")),
           "{L}[int]",
           ("Merge two sorted lists into one sorted list.",
            "Given two lists sorted in increasing order, return their elements in one sorted list."),
           "    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
           "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n"
           "        else:\n            result.append(b[j])\n            j += 1\n"
           "    return result + a[i:] + b[j:]\n",
           _merge, lambda r: (sorted(_ints(r, 0, 9, (0, 4))), sorted(_ints(r, 0, 9, (0, 4))))),
    Family(("parse_numbers", "split_ints", "numbers_from_string"), (("text", "str"),), "{L}[int]",
           ("Input is a string of integers separated by spaces. Return them as a list.",
            "Split the space-delimited string into integers."),
           "    return [int(x) for x in text.split()]\n",
           lambda s: [int(x) for x in s.split()],
           lambda r: (" ".join(str(x) for x in _ints(r, 0, 99)),)),
    Family(("count_negatives", "negatives", "num_below_zero_values"), (("numbers", "{L}[int]"),), "int",
           ("Count the negative numbers in the list.",
            "Return how many elements of numbers are smaller than zero."),
           "    return sum(1 for n in numbers if n < 0)\n",
           lambda xs: sum(1 for n in xs if n < 0), lambda r: (_ints(r),)),
    Family(("last_word", "final_word", "tail_word"), (("sentence", "str"),), "str",
           ("Return the last word of the sentence, or an empty string if it has no words.",),
           "    words = sentence.split()\n    return words[-1] if words else ''\n",
           lambda s: s.split()[-1] if s.split() else "", lambda r: (_sentence(r, (0, 4)),)),
    Family(("chunk", "chunks", "batched"), (("items", "{L}[int]"), ("size", "int")),
           "{L}[{L}[int]]",
           ("Split items into consecutive pieces of the given size; the last piece may be\n"
            "    shorter.",
            "Cut the list into chunks of length size, in order."),
           "    return [items[i:i + size] for i in range(0, len(items), size)]\n",
           lambda xs, k: [xs[i:i + k] for i in range(0, len(xs), k)],
           lambda r: (_ints(r, 0, 9), r.randint(1, 3))),
    Family(("cumulative_sum", "prefix_sums", "running_total"), (("numbers", "{L}[int]"),),
           "{L}[int]",
           ("Return the running totals of the list: element i is the sum of the first i + 1\n"
            "    numbers.",
            "Build the list of prefix sums of numbers."),
           "    total = 0\n    result = []\n    for n in numbers:\n        total += n\n"
           "        result.append(total)\n    return result\n",
           lambda xs: [sum(xs[:i + 1]) for i in range(len(xs))], lambda r: (_ints(r),)),
    Family(("index_of_max", "argmax", "position_of_largest"), (("numbers", "{L}[int]"),), "int",
           ("Return the index of the first largest element, or -1 for an empty list.",),
           "    if not numbers:\n        return -1\n    return numbers.index(max(numbers))\n",
           lambda xs: xs.index(max(xs)) if xs else -1, lambda r: (_ints(r),)),
    Family(("squares", "square_all", "squared"), (("numbers", "{L}[int]"),), "{L}[int]",
           ("Return the square of every number, in the same order.",
            "Map each element n of numbers to n * n."),
           "    return [n * n for n in numbers]\n",
           lambda xs: [n * n for n in xs], lambda r: (_ints(r),)),
    Family(("join_with", "glue", "join_strings"), (("strings", "{L}[str]"), ("sep", "str")), "str",
           ("Join the strings with sep between each two of them.",),
           "    return sep.join(strings)\n",
           lambda xs, sep: sep.join(xs),
           lambda r: ([_word(r) for _ in range(r.randint(0, 4))], r.choice(["-", ", ", "", "/"]))),
    Family(("repeat_text", "repeat_string", "times"), (("text", "str"), ("count", "int")), "str",
           ("Return text repeated count times, with nothing between the copies.",),
           "    return text * count\n",
           lambda s, k: s * k, lambda r: (_word(r), r.randint(0, 3))),
    Family(("has_duplicates", "contains_repeat", "any_repeated"), (("numbers", "{L}[int]"),),
           "bool",
           ("Return True if some value occurs more than once in the list.",
            "Check whether numbers contains a repeated element."),
           "    return len(set(numbers)) != len(numbers)\n",
           lambda xs: len(set(xs)) != len(xs), lambda r: (_ints(r, 0, 9, (0, 5)),)),
    Family(("interleave", "alternate", "zip_merge"), (("a", "{L}[int]"), ("b", "{L}[int]")),
           "{L}[int]",
           ("Take elements from a and b in turn; when one list runs out, append the rest of\n"
            "    the other.",),
           "    result = []\n    for i in range(max(len(a), len(b))):\n        if i < len(a):\n"
           "            result.append(a[i])\n        if i < len(b):\n            result.append(b[i])\n"
           "    return result\n",
           lambda a, b: [x for i in range(max(len(a), len(b))) for x in (a[i:i + 1] + b[i:i + 1])],
           lambda r: (_ints(r, 0, 9, (0, 4)), _ints(r, 0, 9, (0, 4)))),
    Family(("count_greater", "above", "num_larger"), (("numbers", "{L}[int]"), ("value", "int")),
           "int",
           ("Return how many numbers are strictly greater than value.",),
           "    return sum(1 for n in numbers if n > value)\n",
           lambda xs, v: sum(1 for n in xs if n > v), lambda r: (_ints(r), r.randint(0, 10))),
    Family(("initials", "acronym", "first_letters"), (("phrase", "str"),), "str",
           ("Return the first letter of every word of the phrase, upper-cased and joined.",),
           "    return ''.join(w[0].upper() for w in phrase.split())\n",
           lambda s: "".join(w[0].upper() for w in s.split()), lambda r: (_sentence(r),)),
)


def _typing_imports(annotations: str) -> str:
    names = [n for n in ("Dict", "List", "Optional") if n + "[" in annotations]
    return f"from typing import {', '.join(names)}\n\n\n" if names else "\n\n"


def render(fam: Family, r: random.Random) -> tuple[str, str, str]:
    """``(name, prompt, reference body)`` of one problem of ``fam``."""
    name = r.choice(fam.names)
    container = "List" if r.random() < 0.7 else "list"
    sig = ", ".join(f"{p}: {a.format(L=container)}" for p, a in fam.params)
    ret = fam.returns.format(L=container)
    if container == "list" and "Dict[" in ret:
        ret = ret.replace("Dict[", "dict[")
    lead = " " if r.random() < 0.7 else ""
    lines = [f"def {name}({sig}) -> {ret}:", f'    """{lead}{r.choice(fam.wordings)}']
    seen = set()
    for _ in range(r.randint(1, 3)):
        args = fam.example(r)
        call = f"{name}({', '.join(repr(a) for a in args)})"
        if call in seen:
            continue
        seen.add(call)
        lines += [f"    >>> {call}", f"    {fam.fn(*args)!r}"]
    lines.append('    """')
    head = "\n".join(lines) + "\n"
    return name, _typing_imports(head) + head, fam.body


def build_problems(n: int, seed: int) -> list[dict]:
    """``n`` distinct problems (training records of the code domain), seeded."""
    r = random.Random(seed)
    out, prompts = [], set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        fam_idx = r.randrange(len(FAMILIES))
        name, prompt, body = render(FAMILIES[fam_idx], r)
        if prompt in prompts:
            continue
        prompts.add(prompt)
        out.append({"id": f"code/problems/{seed}/{len(out)}", "domain": "code",
                    "source": f"training_job/data/code_problems.py#{fam_idx}",
                    "prompt": prompt, "response": body})
    return out
