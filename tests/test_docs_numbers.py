"""The numbers README.md, eval/RESULTS.md and kernels/DESIGN.md quote are the ones in the result files they cite.

What is checked. A doc is cut into sentences (a paragraph or list item split at ". " and "; " outside
parentheses) and table rows. A sentence cites the result files it links (markdown links into
``eval/results/`` or ``kernels/measurements/``); a table row cites the files it links, or, when it links
none, the files linked by the paragraph just before the table. Code, inline code, headings, HTML comments
and the links' own text are not read.

A headline number is a number in a citing sentence or row that has a decimal point (``6.99``, ``0.027``,
``1,518.6``) or is followed by a unit of time, throughput, memory, ratio or share (``ms``, ``µs``, ``s``,
``minutes``, ``GB/s``, ``tokens/s``, ``MiB``, ``GiB``, ``x``, ``%``; in ``2,367-3,220 GB/s`` or
``33.2 / 98.8 ms`` the unit covers the whole range or list). Everything else is a setting or a size,
not a measurement, and is not checked: ``100K``, ``8B``, ``2-bit``, ``64 tokens``, ``batch 8``, dates,
layer counts, and version numbers (a decimal after torch, CUDA, Triton, transformers or lm-eval).

A headline number must occur in one of the files its sentence cites, as written or as the doc rounds
it: ``6.99`` matches 6.987, ``2,367`` matches 2367, ``712`` matches 711.5 (within half a unit of the
doc's last digit); a markdown file's numbers are its text's, a JSON file's its values and the numbers in
its strings. A number also matches the file's value in another unit of the same quantity: a share in %
the fraction (``45%`` matches 0.45), seconds the milliseconds (``17.4 s`` matches 17360.2), ms the
seconds or µs, µs the ms, MiB and GiB the bytes. A number the doc derives from two of the file's
(a ratio, a difference, a sum) is not in the file, so the doc quotes the file's numbers instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "eval/RESULTS.md", "kernels/DESIGN.md")
RESULT_DIRS = ("eval/results/", "kernels/measurements/")

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = r"(?:ms|µs|us|ns|s|minutes|min|GB/s|TB/s|tokens/s|MiB|GiB|x|%)(?![\w/])"
# a number not glued to a word or another number before it (K4, Qwen3, v1.2), with the numbers joined
# to it by a range dash or a slash, and the unit after the last of them
HEADLINE = re.compile(rf"(?<![\w.,/-])(?:{NUMBER})(?:\s*(?:-|–|/)\s*(?:{NUMBER}))*(?:\s*({UNIT}))?")
GLUED_AFTER = re.compile(r"[A-Za-z_]")  # 100K, 8B, 2-bit ... (a letter right after the number)
VERSION = re.compile(r"(?:torch|CUDA|Triton|transformers|lm-eval)\s*$")
# the same quantity in the file's unit: a share as a fraction, seconds as ms, MiB/GiB as bytes
CONVERSIONS = {"%": (100.0,), "s": (1e-3,), "ms": (1e3, 1e-3), "µs": (1e3,), "MiB": (2.0**-20,), "GiB": (2.0**-30,)}
FILE_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def result_path(doc: Path, target: str) -> str | None:
    """The repository path of a link's target when it is a result file, else None."""
    path = (doc.parent / target.split("#")[0]).resolve()
    try:
        name = path.relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return name if name.startswith(RESULT_DIRS) and path.is_file() else None


def split_sentences(text: str) -> list[str]:
    """``text`` cut at ". " and "; " outside parentheses (decimal points have no space after them)."""
    sentences, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth <= 0 and char in ".;!?" and (i + 1 == len(text) or text[i + 1].isspace()):
            sentences.append(text[start : i + 1])
            start = i + 1
    return [s.strip() for s in [*sentences, text[start:]] if s.strip()]


def citing_units(doc: str, text: str | None = None) -> list[tuple[str, int, str, list[str]]]:
    """(doc, line, text, cited result files) for every sentence and table row of ``doc`` that cites one;
    ``text`` replaces the doc's own."""
    path = ROOT / doc
    text = path.read_text(encoding="utf-8") if text is None else text
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)

    def links(part: str) -> list[str]:
        return [name for _, target in LINK.findall(part) if (name := result_path(path, target))]

    units: list[tuple[str, int, str, list[str]]] = []
    block: list[tuple[int, str]] = []  # (line number, text) of the paragraph's lines
    in_code, before_table = False, []

    def flush():
        nonlocal before_table
        if block:
            paragraph = " ".join(line for _, line in block)
            starts = [sum(len(line) + 1 for _, line in block[:i]) for i in range(len(block))]
            cursor = 0
            for sentence in split_sentences(paragraph):
                cursor = paragraph.index(sentence, cursor)
                number = block[sum(start <= cursor for start in starts) - 1][0]
                units.append((doc, number, sentence, links(sentence)))
            before_table = links(paragraph)
            block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            in_code = not in_code
        elif in_code:
            continue
        elif stripped.startswith("|"):
            flush()
            units.append((doc, number, stripped, links(stripped) or before_table))
        elif not stripped or stripped.startswith("#"):
            flush()
            if stripped:
                before_table = []
        else:
            if re.match(r"(?:[-*]|\d+\.)\s", stripped):
                flush()
            block.append((number, stripped))
    flush()
    return [unit for unit in units if unit[3]]


def headline_numbers(sentence: str) -> list[str]:
    """The headline numbers of ``sentence`` (module docstring), as written."""
    prose = re.sub(r"`[^`]*`", " ", sentence)
    prose = LINK.sub(" ", prose)
    found = []
    for match in HEADLINE.finditer(prose):
        after = prose[match.end() :]
        if not match.group(1) and GLUED_AFTER.match(after):
            continue  # 100K, 8B, 4B's
        if VERSION.search(prose[: match.start()]):
            continue
        numbers = re.findall(NUMBER, match.group(0))
        unit = match.group(1)
        for value in numbers:
            if unit or "." in value:
                found.append(value + (unit or ""))
    return found


def file_numbers(name: str) -> list[float]:
    """Every number in result file ``name`` (none in a plot)."""
    if name.endswith(".png"):
        return []
    values: list[float] = []

    def walk(node):
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            values.append(abs(float(node)))
        elif isinstance(node, str):
            values.extend(abs(float(n.replace(",", ""))) for n in FILE_NUMBER.findall(node))
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(key)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    text = (ROOT / name).read_text(encoding="utf-8")
    walk(json.loads(text) if name.endswith(".json") else text)
    return values


def matches(quoted: str, values: list[float]) -> bool:
    """Whether ``quoted`` (a headline number with its unit) is one of ``values`` rounded as written."""
    number = re.match(NUMBER, quoted).group(0).replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    target, tolerance = float(number), 0.5 * 10**-decimals + 1e-9
    unit = quoted[len(re.match(NUMBER, quoted).group(0)) :]
    scales = [1.0, *CONVERSIONS.get(unit, ())]
    return any(abs(v * scale - target) <= tolerance for v in values for scale in scales)


def quoted_numbers(texts: dict[str, str] | None = None) -> list[tuple[str, int, str, list[str]]]:
    """(doc, line, number, cited files) for every headline number of the three docs (``texts``: replaced docs)."""
    return [
        (doc, line, number, files)
        for name in DOCS
        for doc, line, sentence, files in citing_units(name, (texts or {}).get(name))
        for number in headline_numbers(sentence)
    ]


def mismatches(quoted: list[tuple[str, int, str, list[str]]]) -> list[str]:
    cache: dict[str, list[float]] = {}
    return [
        f"{doc}:{line}: {number} is in none of {', '.join(files)}"
        for doc, line, number, files in quoted
        if not matches(number, [v for f in files for v in cache.get(f) or cache.setdefault(f, file_numbers(f))])
    ]


def test_every_quoted_number_is_the_one_in_its_file():
    quoted = quoted_numbers()
    assert len(quoted) > 200, f"only {len(quoted)} headline numbers found: is the parser reading the docs?"
    assert not (bad := mismatches(quoted)), "\n".join(bad)


def test_the_rule_for_headline_numbers():
    sentence = (
        "At 100K, batch 1 / 8 on an 8B model with 2-bit keys and 64 tokens: 24.8 / 148.8 µs, 4.0-4.8x, "
        "2,367-3,220 GB/s, 93 s at 1,471 MiB, +1.5%, 20-30% of 2026-11-30, torch 2.13 (`--sink 16 0.96`)"
    )
    assert headline_numbers(sentence) == [
        "24.8µs",
        "148.8µs",
        "4.0x",
        "4.8x",
        "2,367GB/s",
        "3,220GB/s",
        "93s",
        "1,471MiB",
        "1.5%",
        "20%",
        "30%",
    ]


def test_rounding_as_written():
    assert matches("6.99ms", [6.987]) and matches("2,367GB/s", [2367.0]) and matches("712µs", [711.5])
    assert matches("45%", [0.45]) and not matches("6.98ms", [6.987]) and not matches("0.027", [0.0276])
    assert matches("17.4s", [17360.2]) and matches("90.00MiB", [94371840]) and not matches("4.7x", [33.16, 6.99])


@pytest.mark.parametrize(
    "doc, written, wrong",
    [
        ("README.md", "| 139.9 / 1,061.0 µs (SDPA) |", "| 139.8 / 1,061.0 µs (SDPA) |"),
        ("eval/RESULTS.md", "| oscar-k4v2 | 5.45 | 20.800 |", "| oscar-k4v2 | 5.45 | 20.801 |"),
        ("kernels/DESIGN.md", "took 147.2 µs staged", "took 147.9 µs staged"),
    ],
)
def test_a_wrong_number_in_a_doc_is_caught(doc, written, wrong):
    """Change one quoted number of a doc (in memory): the check fails on that line, and only there."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert text.count(written) == 1
    line = text[: text.index(written)].count("\n") + 1
    bad = mismatches(quoted_numbers({doc: text.replace(written, wrong)}))
    assert len(bad) == 1 and bad[0].startswith(f"{doc}:{line}: "), bad


@pytest.mark.parametrize("folder", ["eval/results"])
def test_every_result_file_is_cited(folder):
    """Each file in eval/results is linked from README.md, eval/RESULTS.md or kernels/DESIGN.md, or is the
    JSON beside a linked markdown file."""
    cited = set()
    for doc in DOCS:
        for _, target in LINK.findall((ROOT / doc).read_text(encoding="utf-8")):
            if name := result_path(ROOT / doc, target):
                cited |= {name, str(Path(name).with_suffix(".json"))} if name.endswith(".md") else {name}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*") if p.is_file()}
    assert not sorted(files - cited)
