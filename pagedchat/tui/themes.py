"""Themes: TOML files in `pagedchat.themes` turned into Textual themes.

A theme file has the app's colours (`[colors]`, Textual's theme fields), the colours given to chat
sessions in turn (`[sessions] colors`) and the block states of the KV grid (`[blocks]`). Session and
block colours travel as theme variables (`$session-0`, `$block-free`, ...) so CSS can use them and the
grid reads them back from `App.theme_variables` when the theme changes.
"""

import tomllib
import zlib
from functools import cache
from importlib.resources import files
from typing import NamedTuple

from textual.theme import Theme

DEFAULT_THEME = "harbor"
BLOCK_STATES = ("free", "cached", "shared")
SESSION_COLOURS = 8  # every theme has exactly this many, so a tab keeps its colour across themes


class SessionTag(NamedTuple):
    """How the panel names and colours a request: its tab's title and colour."""

    name: str
    colour: int  # index into the theme's session colours

    @property
    def variable(self) -> str:
        return f"session-{self.colour % SESSION_COLOURS}"

    @staticmethod
    def fallback(request_id: str) -> "SessionTag":
        """For a request no tab owns (an API client's): a stable colour from its id, a name cut to fit."""
        name = request_id if len(request_id) <= 14 else request_id[:13] + "…"
        return SessionTag(name, zlib.crc32(request_id.encode()) % SESSION_COLOURS)


@cache
def load_themes() -> dict[str, Theme]:
    """Every theme shipped in `pagedchat.themes`, by name."""
    themes = {}
    for entry in sorted(files("pagedchat.themes").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            theme = parse_theme(tomllib.loads(entry.read_text(encoding="utf-8")))
            themes[theme.name] = theme
    return themes


def parse_theme(data: dict) -> Theme:
    sessions = data["sessions"]["colors"]
    if len(sessions) != SESSION_COLOURS:
        raise ValueError(f"theme {data['name']!r} needs {SESSION_COLOURS} session colours")
    variables = {f"session-{i}": colour for i, colour in enumerate(sessions)}
    variables.update({f"block-{state}": data["blocks"][state] for state in BLOCK_STATES})
    return Theme(name=data["name"], dark=data.get("dark", True), variables=variables, **data["colors"])

