"""Text that exists offline, and what the head trains on from it.

Sources: the interpreter's standard library `.py` files (tests, idlelib, lib2to3 and site-packages left out), the
project's docs/*.md, and any folders `data.dirs` names. A source is held out by a hash of its name, the rule
scripts/train_tiny.py used for the shipped pair (so its held-out files stay held out here).

Each source is cut into pieces at line ends. A target with a chat template sees a piece as a chat: a user turn
that asks for it (or to continue it) and the piece as the assistant's answer; other targets see the text. The
same pieces give the self-distillation prompts (`distill_items`): requests about code and text, and everyday
requests built from a list of subjects and asks written here, for the target to answer in its own words.
"""
from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
TEXT_SUFFIXES = (".py", ".md", ".txt", ".rst")
DOCS = Path(__file__).resolve().parents[2] / "docs"  # a source checkout's docs (absent from an installed wheel)


def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib folder, its .py files in a fixed order) without the excluded folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and d != "__pycache__")
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel: str, heldout_mod: int) -> bool:
    """The held-out rule of the shipped pair: the sha256 of the relative name, mod `heldout_mod`, is 0."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % heldout_mod == 0


def stable_hash(*parts) -> int:
    """A hash that does not change between processes (Python's own is salted)."""
    return int(hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:12], 16)


@dataclass
class Source:
    name: str  # relative name, the held-out rule's input (stdlib files: as train_tiny.py names them)
    path: Path
    kind: str  # code | doc


def sources(names: list, dirs: list) -> list[Source]:
    """The corpora `data.sources` and `data.dirs` name, in a fixed order."""
    found = []
    if "stdlib" in names:
        root, files = stdlib_files()
        found += [Source(f.relative_to(root).as_posix(), f, "code") for f in files]
    if "docs" in names and DOCS.is_dir():
        found += [Source(f"docs/{f.name}", f, "doc") for f in sorted(DOCS.glob("*.md"))]
    for d in dirs:
        root = Path(d).expanduser()
        for f in sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
            found.append(Source(f"{root.name}/{f.relative_to(root).as_posix()}", f, "code" if f.suffix == ".py"
                                else "doc"))
    return found


def read_text(path: Path) -> Optional[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def pieces(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters (a longer line is a piece of its own)."""
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        if cur and len(cur) + len(line) > size:
            out.append(cur)
            cur = ""
        cur += line
    if cur.strip():
        out.append(cur)
    return [p for p in out if p.strip()]


def title_of(src: Source, text: str) -> str:
    """What a source is about, in a few words: a module docstring's first line or the first heading."""
    if src.kind == "doc":
        found = re.search(r"^#+\s*(.+)$", text, re.M)
        return found.group(1).strip() if found else Path(src.name).stem
    found = re.match(r'\s*(?:#.*\n\s*)*(?:r|u)?("""|\'\'\')\s*(.+)', text)
    line = found.group(2).strip().rstrip(".") if found else ""
    module = src.name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"the Python module `{module}`" + (f" ({line[:80]})" if line else "")


CODE_ASKS = (
    "Write the Python code for {title}.",
    "Show me part of the source of {title}.",
    "Continue this Python code from {title}:\n\n```python\n{head}```",
)
DOC_ASKS = (
    "Write the documentation section \"{title}\".",
    "Explain {title} as a project's documentation would.",
    "Continue this documentation:\n\n{head}",
)


def as_chat(src: Source, title: str, piece: str, index: int) -> list[dict]:
    """A piece as a conversation: a user turn asking for it, the piece as the assistant's answer. The "continue"
    asks move the piece's first lines into the user turn."""
    asks = CODE_ASKS if src.kind == "code" else DOC_ASKS
    k = stable_hash(src.name, index) % len(asks)
    lines = piece.splitlines(keepends=True)
    head, rest = ("".join(lines[:4]), "".join(lines[4:])) if k == 2 and len(lines) > 8 else ("", piece)
    if not head:
        k = k % 2
    return [{"role": "user", "content": asks[k].format(title=title, head=head)},
            {"role": "assistant", "content": rest}]


# self-distillation: asks about a piece of the corpus, and everyday requests on subjects written here
ABOUT_CODE = (
    "Explain what this code does:\n\n```python\n{piece}```",
    "Continue this Python code:\n\n```python\n{piece}```",
    "Write a docstring and type hints for this code:\n\n```python\n{piece}```",
    "Is there a bug in this code? Explain briefly.\n\n```python\n{piece}```",
    "Rewrite this code to be easier to read:\n\n```python\n{piece}```",
    "Write a short usage example for {title}.",
)
ABOUT_TEXT = (
    "Summarize this text in a few sentences:\n\n{piece}",
    "Continue this text:\n\n{piece}",
    "What are the main points of this passage?\n\n{piece}",
    "Explain {title} to a beginner.",
)
SUBJECTS = ("learning to play the guitar", "keeping houseplants alive", "writing a cover letter", "saving for a "
            "holiday", "training a puppy", "baking bread", "planning a road trip", "learning a second language",
            "starting to run", "organizing a small kitchen", "the water cycle", "photosynthesis", "black holes",
            "the Roman Empire", "electric cars", "recycling plastic", "making friends in a new city", "public "
            "speaking", "meal prepping for a week", "choosing a laptop", "time zones", "birthday party games",
            "reading more books", "volcanoes", "the moon's phases", "composting", "camping in the rain",
            "a good night's sleep", "budgeting for students", "learning to swim", "ancient Egypt", "honeybees",
            "writing a haiku", "painting a room", "how credit cards work", "rainforests", "chess openings",
            "the Olympic Games", "drinking enough water", "remote team meetings")
EVERYDAY_ASKS = ("Explain {s} in simple terms.", "Give me five practical tips about {s}.",
                 "Write a short poem about {s}.", "What are the pros and cons of {s}?",
                 "Write a friendly email to a friend about {s}.", "What should a beginner know about {s}?",
                 "Tell me three interesting facts about {s}.", "Write a short story that involves {s}.",
                 "Make a simple step-by-step plan for {s}.", "Answer briefly: why does {s} matter?")


def distill_messages(src: Source, title: str, piece: str, index: int) -> str:
    """A user request about `piece` (a few lines of it) for the target to answer."""
    lines = piece.splitlines(keepends=True)
    start = stable_hash("at", src.name, index) % max(1, len(lines) - 12)
    snippet = "".join(lines[start:start + 12])
    asks = ABOUT_CODE if src.kind == "code" else ABOUT_TEXT
    return asks[stable_hash("ask", src.name, index) % len(asks)].format(piece=snippet, title=title)


def everyday_requests(n: int, seed: int) -> list[str]:
    """`n` everyday requests (subject x ask), in an order fixed by `seed`."""
    all_ = [a.format(s=s) for s in SUBJECTS for a in EVERYDAY_ASKS]
    all_.sort(key=lambda t: stable_hash(seed, t))
    return all_[:n]
