"""The message box's keys as a terminal sends them: tmux send-keys against the real app. Pilot's
`press("alt+a")` sends the key without its character, and Textual's parser is not in the way, so a
Pilot test passes where a terminal types the letter or closes the tab."""

import re
import shutil
import time

import pytest
from support.terminal import Terminal, tiny_chat

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux); .ci/run installs it")


def box_shows(term: Terminal, *lines: str) -> None:
    """Wait until the message box holds exactly these lines: the chat column's lines that start with
    one space, not the transcript's "▌", and run blank to the panel's edge (or a notice's)."""
    pattern = "".join(rf"^ {re.escape(line)} +[▏▌].*\n" for line in lines)
    term.wait_for(rf"(?m)^ +[▏▌].*\n{pattern}^ +[▏▌]", 10)


def settle() -> None:
    """A key bound on a widget or screen (home, tab) runs once it has bubbled up to the app; a letter
    typed right after it is inserted before that, which is Textual's order, not the terminal's."""
    time.sleep(1)


def gone(text: str) -> str:
    """A pattern that matches a screen without the text."""
    return rf"\A(?![\s\S]*{re.escape(text)})"


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
        term.keys("F2")  # the settings' fields delete the word before the cursor too
        term.wait_for(r"chat 2: settings", 10)
        term.keys("Tab")  # the temperature, selected whole: typing replaces it
        settle()
        term.keys("-l", "warm day")
        term.wait_for(r"▊ +warm day +▎", 10)
        term.keys("M-BSpace")
        term.wait_for(r"▊ +warm +▎", 10)
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


def test_the_keys_readme_lists_reach_the_app_through_a_terminal(tiny_model, tmp_path):
    """Each key of README's list, as tmux sends it, does what README says (a notice, a dialog, the tab
    on show); the tabs' drafts tell which tab is on show."""
    term = tiny_chat(tiny_model, tmp_path)
    try:
        term.keys("-l", "one")
        term.keys("C-n")
        term.wait_for(r"■ chat 2", 10)
        settle()  # the new tab's label shows before its message box takes the focus
        term.keys("-l", "two")
        box_shows(term, "two")
        for key, draft in (("F7", "one"), ("F8", "two"), ("M-Left", "one"), ("M-Right", "two"),
                           ("C-PPage", "one"), ("C-NPage", "two")):
            term.keys(key)
            box_shows(term, draft)
        for key, shows in (("F4", r"KV panel hidden"), ("F4", r"KV panel shown"), ("F9", r"Contiguous view shown"),
                           ("F5", r"Engine paused"), ("F5", r"Engine resumed"), ("F3", r"Slow motion: "),
                           ("C-e", r"Nothing to export yet"), ("C-y", r"No reply to copy yet"),
                           ("C-r", r"no reply to regenerate"), ("C-f", r"Nothing to fork yet"),
                           ("C-t", r"No closed chat to reopen"), ("C-o", r"No message to edit yet"),
                           ("F2", r"chat 2: settings"), ("Escape", gone("chat 2: settings")),
                           ("F1", r"f5 +│ Pause or resume"), ("Escape", gone("Pause or resume")),
                           ("C-p", r"Search for commands"), ("Escape", gone("Search for commands"))):
            term.keys(key)
            term.wait_for(shows, 10)
        for key, text, box in (("Home", "<", "<two"), ("End", ">", "<two>")):
            term.keys(key)
            settle()
            term.keys("-l", text)
            box_shows(term, box)
        term.keys("C-q")
        term.wait_for(r"(?m)^exit=0$", 30)
    finally:
        term.close()
