"""Write the built-in `heldout` prompt set: code contexts from the stdlib files the tiny pair never saw.

Uses the same split as scripts/train_tiny.py (a hash of each file's path), so acceptance measured
on these prompts is held-out acceptance.

    python scripts/make_heldout_prompts.py [--count 32] [--bytes 320]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import is_heldout, stdlib_files  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "specpipe" / "assets" / "prompts" / "heldout.jsonl"


def window(text: str, key: str, size: int) -> str:
    """A context of about `size` characters that starts and ends at line boundaries."""
    lines = text.splitlines(keepends=True)
    start = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % max(1, len(lines) - 20)
    out = ""
    for line in lines[start:]:
        if len(out) + len(line) > size and out:
            break
        out += line
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--bytes", type=int, default=320)
    ap.add_argument("--per-file", type=int, default=5)
    ap.add_argument("--heldout-mod", type=int, default=64)  # as scripts/train_tiny.py
    a = ap.parse_args()
    root, files = stdlib_files()
    prompts = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if not is_heldout(rel, a.heldout_mod):
            continue
        try:
            text = path.read_text("utf-8")
        except UnicodeDecodeError:
            continue
        for i in range(a.per_file):  # several contexts per file: only ~1/64 of the files are held out
            w = window(text, f"{rel}#{i}", a.bytes)
            if len(w.strip()) > 40 and w.isascii() and all(w != p["prompt"] for p in prompts):
                prompts.append({"prompt": w, "source": rel})
        if len(prompts) >= a.count:
            prompts = prompts[: a.count]
            break
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {OUT}")


if __name__ == "__main__":
    main()
