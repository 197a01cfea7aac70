"""Writes a benchmark's Markdown report to ``bench/results/<date>-<name>.md`` (and prints it)."""

from __future__ import annotations

import datetime
import os


def publish(out: str, name: str, title: str, intro: str, header: list[str], rows: list[list[str]]) -> str:
    today = datetime.date.today().isoformat()
    lines = [f"# {title} — {today}\n", intro + "\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{today}-{name}.md")
    with open(path, "w") as f:
        f.write(text)
    return path
