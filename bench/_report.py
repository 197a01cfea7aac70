"""Writes a benchmark's Markdown report to ``bench/results/<date>-<name>.md`` (and prints it), and
its data as JSON beside it where given."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any


def publish(out: str, name: str, title: str, intro: str, header: list[str], rows: list[list[str]],
            data: dict[str, Any] | None = None) -> str:  # fmt: skip
    today = datetime.date.today().isoformat()
    lines = [f"# {title} — {today}\n", intro + "\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{today}-{name}.md")
    with open(path, "w") as f:
        f.write(text)
    if data is not None:
        with open(path.removesuffix(".md") + ".json", "w") as f:
            json.dump(data, f, indent=2)
    return path
