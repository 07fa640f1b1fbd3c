"""Notebook display (`_repr_html_`) of the public result objects: a Reply, a RequestOutput,
`llm.stats()` and a PinnedPrefix show as small HTML tables in Jupyter, the text escaped.
Imports nothing of kvsession: the classes pass their fields in."""

from __future__ import annotations

import html

MAX_TEXT_CHARS = 2000  # a long reply is cut in the display (the object keeps it whole)


def text_cell(text: str | None) -> str:
    """`text` escaped, newlines kept, cut at MAX_TEXT_CHARS."""
    if text is None:
        return ""
    cut = text if len(text) <= MAX_TEXT_CHARS else \
        text[:MAX_TEXT_CHARS] + f"... ({len(text) - MAX_TEXT_CHARS} more characters)"
    return f"<pre style='white-space: pre-wrap; margin: 0'>{html.escape(cut)}</pre>"


def table(title: str, rows: list[tuple[str, object]]) -> str:
    """A two-column table under a bold title; a value that is already HTML (from
    text_cell) goes in as it is, others are escaped."""
    body = "".join(
        f"<tr><th style='text-align: left'>{html.escape(name)}</th><td style='text-align: "
        f"left'>{value if isinstance(value, Html) else html.escape(str(value))}</td></tr>"
        for name, value in rows)
    return f"<b>{html.escape(title)}</b><table>{body}</table>"


class Html(str):
    """A string that is HTML already (not escaped again by `table`)."""


def text(value: str | None) -> Html:
    return Html(text_cell(value))


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"
