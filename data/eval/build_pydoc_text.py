"""Build the Python-documentation parts of the eval text and the calibration text (see README.md here).

    python data/eval/build_pydoc_text.py      # with Python 3.11: rewrites eval_text.txt and calib_text.txt

Source: `pydoc_data.topics.topics`, the plain-text language reference that ships inside CPython's standard
library (Python 3.11 documentation, PSF licence). From each listed topic we keep only prose paragraphs, in
document order: a paragraph is a run of non-blank lines, its wrapped lines joined. Dropped: headings (a line
underlined with *, =, -), indented blocks (code, grammar productions, nested lists, method descriptions), bullet
items, tables, anything with `::=` or `>>>`, paragraphs under 80 characters and paragraphs that do not end with
a full stop (e.g. "For example:" before a dropped code block). Each topic starts with its title as a heading,
the way the authored part does.

eval_text.txt = the authored part (its first 12,862 bytes, checked by sha256; never changed) + a blank line +
the prose of EVAL_TOPICS. calib_text.txt = the prose of CALIB_TOPICS, a disjoint list (checked: no paragraph
of one text appears in the other). Deterministic: same Python docs in, same bytes out.
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL_TOPICS = ("objects", "types")                 # "Objects, values and types", "The standard type hierarchy"
CALIB_TOPICS = ("execmodel", "import", "class")    # "Execution model", "The \"import\" statement", "Class definitions"
AUTHORED_BYTES = 12862                              # the project's own prose, the start of eval_text.txt
AUTHORED_SHA256 = "a802b9ebe795149e2163bf5a405a9c33cca5a37c400b769b13a6c130fbb641ef"
BUILT_WITH = "3.11.7"       # the Python whose pydoc_data made the recorded files (patch releases edit the docs)
MIN_CHARS = 80
_UNDERLINE = re.compile(r"^(\*+|=+|-+|\^+|~+)$")


def topic_title(topic: str) -> str:
    """The topic's first line, e.g. "Execution model"."""
    from pydoc_data.topics import topics
    return topics[topic].split("\n", 1)[0].strip()


def _join(lines: list[str]) -> str:
    """Wrapped lines -> one line. A line broken after a hyphen ("reference-" / "counting") joins without a space."""
    text = lines[0].strip()
    for line in lines[1:]:
        sep = "" if re.search(r"\w-$", text) else " "
        text += sep + line.strip()
    return text


def prose_paragraphs(topic: str) -> list[str]:
    """The prose paragraphs of one pydoc topic, in order, each on one line."""
    from pydoc_data.topics import topics
    blocks, cur = [], []
    for line in topics[topic].split("\n") + [""]:
        if line.strip():
            cur.append(line)
        elif cur:
            blocks.append(cur)
            cur = []
    keep = []
    for block in blocks:
        if any(_UNDERLINE.match(l.strip()) for l in block):   # a heading (and its underline)
            continue
        if any(l[:1].isspace() for l in block):                # code, grammar, nested list, indented description
            continue
        text = _join(block)
        if "::=" in text or ">>>" in text or "|" in text or text.startswith(("* ", "+-", "=")):
            continue
        if len(text) < MIN_CHARS or not text.endswith("."):
            continue
        keep.append(text)
    return keep


def build(topics: tuple[str, ...]) -> tuple[str, list[str]]:
    """Text of the listed topics (title line, blank line, paragraphs separated by blank lines) and its paragraphs.
    A paragraph already taken from an earlier topic is not repeated (pydoc topics overlap)."""
    parts, seen = [], []
    for topic in topics:
        paras = []
        for p in prose_paragraphs(topic):
            if p not in seen:
                seen.append(p)
                paras.append(p)
        parts.append("\n\n".join([topic_title(topic)] + paras))
    return "\n\n".join(parts) + "\n", seen


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"run this with Python 3.11 (its pydoc_data is the recorded source); this is {sys.version.split()[0]}")
    if sys.version.split()[0] != BUILT_WITH:
        print(f"note: the recorded files were built with Python {BUILT_WITH}; {sys.version.split()[0]}'s docs may "
              f"differ slightly, and then the recorded sha256s in llmso_lab/quality.py no longer match", file=sys.stderr)
    eval_path, calib_path = HERE / "eval_text.txt", HERE / "calib_text.txt"
    authored = eval_path.read_bytes()[:AUTHORED_BYTES]
    if hashlib.sha256(authored).hexdigest() != AUTHORED_SHA256:
        sys.exit(f"the first {AUTHORED_BYTES} bytes of {eval_path} are not the authored text; restore it from git")
    appended, eval_paras = build(EVAL_TOPICS)
    calib, calib_paras = build(CALIB_TOPICS)
    shared = set(eval_paras) & set(calib_paras)
    assert not shared, f"eval and calibration texts share {len(shared)} paragraphs; change the topic lists"
    eval_path.write_bytes(authored + b"\n" + appended.encode("utf-8"))
    calib_path.write_bytes(calib.encode("utf-8"))
    for path in (eval_path, calib_path):
        data = path.read_bytes()
        print(f"{path.name}: {len(data.decode().split())} words, {len(data)} bytes, "
              f"sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
