"""The app's keys. All are priority bindings, so that the message box cannot swallow them."""

from textual.binding import Binding

BINDINGS = [
    Binding("ctrl+n", "new_chat", "New chat", priority=True),
    Binding("ctrl+w", "close_chat", "Close", priority=True),
    Binding("ctrl+t", "reopen_chat", "Reopen closed chat", priority=True, show=False),
    Binding("ctrl+f", "fork_chat", "Fork", priority=True),
    Binding("ctrl+o", "edit_message", "Edit an earlier message", priority=True, show=False),
    Binding("escape", "stop", "Stop", priority=True),
    Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
    # f5 has two bindings, one shown at a time (the app's check_action): the footer says what f5 will do.
    Binding("f5", "pause", "Pause", priority=True),
    Binding("f5", "resume", "Resume", priority=True),
    Binding("f6", "step", "Step", priority=True),
    Binding("f3", "slow_motion", "Slow motion", priority=True, show=False),
    Binding("f2", "settings", "Settings", priority=True),
    Binding("f4", "toggle_panel", "Panel", priority=True),
    Binding("f9", "toggle_contiguous", "Contiguous view", priority=True, show=False),
    Binding("f1", "help", "Help", priority=True),
    Binding("ctrl+y", "copy_reply", "Copy last reply", priority=True, show=False),
    Binding("ctrl+e", "export_chat", "Export as Markdown", priority=True, show=False),
    Binding("ctrl+pageup,alt+left,f7", "previous_tab", "Previous tab", priority=True, show=False,
            key_display="ctrl+pgup / alt+← / f7"),
    Binding("ctrl+pagedown,alt+right,f8", "next_tab", "Next tab", priority=True, show=False,
            key_display="ctrl+pgdn / alt+→ / f8"),
    Binding("ctrl+q", "quit", "Quit", priority=True),
]

# Actions that belong to the chat screen: off while a dialog or the loading screen is up, so that
# escape and friends reach the dialog despite being priority bindings.
CHAT_ACTIONS = {"new_chat", "close_chat", "reopen_chat", "fork_chat", "edit_message", "stop", "regenerate", "pause",
                "resume", "step", "slow_motion", "settings", "copy_reply", "export_chat", "previous_tab", "next_tab",
                "toggle_demo", "toggle_panel", "toggle_contiguous"}
