"""f1: the keys, and how to read the KV panel."""

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from pagedchat.tui.message_box import SHADOWED

READING_THE_PANEL = """
## The KV panel

Every number and cell comes from the engine's own block pool.

- **Cells** are physical KV blocks of *block size* token slots, in block-id order.
  A cell in a tab's colour belongs to that conversation; its height shows how full it is.
- A **digit** on a coloured cell is a block shared by that many block tables (a fork, or a prefix
  two tabs have in common). Writing into it copies it first (copy-on-write, `cow` in the log).
- **░** free, but still holding a hashed prefix: a later turn with the same tokens reuses it.
- **·** free and empty.
- `free N/M blocks` counts every block with ref count 0, cached ones included.
- *contiguous would hold* is what an allocator reserving each conversation's maximum length up
  front would hold right now; *paging holds* is what the engine really holds.

Click a block (or focus the grid with tab and use the arrow keys) to see its tokens.
**f5** pauses the engine between steps, **f6** runs one step, **f3** slows every step down.
While paused or slowed, a **◂** after a cell says the last step wrote K/V into its slots and a **◃**
that it only read it; the block tables say which slots. **f9** lays the same sessions out as an
allocator reserving each one's maximum up front would: a model, beside the engine's real numbers.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 84;
        height: 90%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        # One row a key: f5's two bindings (pause, resume; one shown at a time) share theirs.
        actions: dict[str, list[str]] = {}
        for b in self.app.BINDINGS:
            if isinstance(b, Binding) and b.description:
                actions.setdefault(b.key_display or self.app.get_key_display(b), []).append(b.description)
        rows = [f"| `{key}` | {what[0]}{''.join(' or ' + other.lower() for other in what[1:])} |"
                for key, what in actions.items()]
        keys = "## Keys\n\n| Key | Action |\n| :- | :- |\n" + "\n".join(rows)
        keys += "\n| `enter` | Send the message |\n| `ctrl+j` | New line in the message |"
        keys += "\n| `ctrl+p` | Command palette: every action, themes, slow motion |"
        keys += "\n\n## Editing keys the app takes\n\n| Key | In the message box | Press instead |\n| :- | :- | :- |\n"
        keys += "\n".join(f"| `{key}` | {what} | `{instead}` |" for key, what, instead in SHADOWED)
        with VerticalScroll():
            yield Markdown(keys + "\n" + READING_THE_PANEL)

    def on_mount(self) -> None:
        # The arrow and page keys scroll the help at once, without a tab first to focus it.
        self.set_focus(self.query_one(VerticalScroll))

    def action_dismiss(self) -> None:
        self.dismiss()
