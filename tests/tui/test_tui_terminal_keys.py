"""The message box's keys as a terminal sends them: tmux send-keys against the real app. Pilot's
`press("alt+a")` sends the key without its character, and Textual's parser is not in the way, so a
Pilot test passes where a terminal types the letter or closes the tab."""

import re
import shutil

import pytest
from support.terminal import Terminal, tiny_chat

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux); .ci/run installs it")


def box_shows(term: Terminal, *lines: str) -> None:
    """Wait until the message box holds exactly these lines: the chat column's lines that start with
    one space, not the transcript's "▌", and run blank to the panel's edge (or a notice's)."""
    pattern = "".join(rf"^ {re.escape(line)} +[▏▌].*\n" for line in lines)
    term.wait_for(rf"(?m)^ +[▏▌].*\n{pattern}^ +[▏▌]", 10)


def test_alt_backspace_deletes_a_word_and_ctrl_w_still_closes_the_tab(tiny_model, tmp_path):
    """A terminal sends alt+backspace as ESC DEL, which Textual read as ctrl+w: the tab closed."""
    term = tiny_chat(tiny_model, tmp_path)
    try:
        term.keys("-l", "hello world")
        box_shows(term, "hello world")
        term.keys("M-BSpace")
        box_shows(term, "hello")
        assert "Closed" not in term.screen() and "chat 1" in term.screen()
        term.keys("C-w")  # DESIGN's key to close the tab, the text in its box kept for ctrl+t
        term.wait_for(r"Closed chat 1: ctrl\+t reopens it", 10)
        term.wait_for(r"■ chat 2", 10)
    finally:
        term.close()


def test_alt_a_alt_l_alt_y_run_their_action_instead_of_typing_their_letter(tiny_model, tmp_path):
    term = tiny_chat(tiny_model, tmp_path)
    try:
        term.keys("-l", "hello world")
        term.keys("M-a", "X")  # select all: X replaces everything
        box_shows(term, "X")
        term.keys("C-j")
        term.keys("-l", "second line")
        box_shows(term, "X", "second line")
        term.keys("M-l", "Y")  # select the line: Y replaces the second line only
        box_shows(term, "X", "Y")
        term.keys("C-z")  # undo the Y: the selected line is back
        box_shows(term, "X", "second line")
        term.keys("M-y")  # redo: the Y again
        box_shows(term, "X", "Y")
    finally:
        term.close()
