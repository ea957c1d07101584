"""JSON-lines files read row by row, so that an error names the file and the row: the user's files
(demonstrations, math datasets, prompt tables, golden-negative pools) all go through here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional


def numbered_jsonl_rows(path: str) -> list[tuple[int, Any]]:
    """(1-based line number, parsed value) of each non-blank line of a JSON-lines file, so that later
    checks can name the row.

    Raises FileNotFoundError naming ``path``; ValueError naming the file and row of invalid JSON.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"file not found: {path} (resolved to {file.resolve()})")
    rows = []
    for number, line, problem in utf8_lines(file):
        if problem:
            raise ValueError(f"{path}, row {number}: {problem}")
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, row {number}: not valid JSON ({err.msg})") from err
    return rows


def utf8_lines(path) -> Iterator[tuple[int, Optional[str], str]]:
    """``(1-based line number, text, "")`` of each line of ``path``, or ``(number, None, problem)`` for a
    line that is not UTF-8 text, so a reader can name the row (decoding the whole file would name neither)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8"), ""
            except UnicodeDecodeError as err:
                yield number, None, f"not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})"
