"""Issue 16: f2 and f1 take the keyboard at once; ctrl+e exports into the documents folder, each system
prompt shown before the turns it governed."""

from support.app import SIZE, loaded, reply_done  # noqa: F401 (make_app is a fixture)
from support.conversation import conversation, reply
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from textual.containers import VerticalScroll
from textual.widgets import TextArea

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.settings_screen import SettingsScreen, TabSettings


@async_test
async def test_f2_focuses_the_first_field_so_typing_goes_into_it():
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        await pilot.pause()
        system = app.screen.query_one("#system", TextArea)
        assert app.screen.focused is system
        await pilot.press(*"Be brief.")
        assert system.text == "Be brief."


@async_test
async def test_f1_help_scrolls_by_keyboard_without_a_tab_first():
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=(160, 24)) as pilot:  # short: the help is longer than the screen
        await loaded(pilot)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        await pilot.pause()
        scroll = app.screen.query_one(VerticalScroll)
        assert scroll.max_scroll_y > 0 and scroll.scroll_y == 0
        await pilot.press("down")
        await wait_until(pilot, lambda: scroll.scroll_y > 0, what="down to scroll the help")
        before = scroll.scroll_y
        await pilot.press("pagedown")
        await wait_until(pilot, lambda: scroll.scroll_y > before, what="pagedown to scroll the help")


@async_test
async def test_ctrl_e_exports_into_the_documents_folder_with_each_system_prompt_before_its_turns(
        make_app, tmp_path, monkeypatch):
    documents, cwd = tmp_path / "Documents", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("XDG_DOCUMENTS_DIR", str(documents))  # what platformdirs reads first
    monkeypatch.chdir(cwd)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        notices = []
        notify = app.notify
        monkeypatch.setattr(app, "notify", lambda message, **kw: (notices.append(str(message)), notify(message, **kw)))
        pane = app.current_pane
        for message, system in (("first question", None), ("second question", "Answer in French."),
                                ("third question", "Be brief.")):
            if system != pane.conversation.system_prompt:
                pane.apply_settings(TabSettings(system, pane.conversation.params))
            assert pane.send(message)
            await reply_done(pilot, pane)
            await wait_until(pilot, lambda: len(pane.conversation.turns) % 2 == 0, what="the reply to be kept")
        await pilot.press("ctrl+e")
        await wait_until(pilot, lambda: any("Saved" in n for n in notices), what="the export's notice")

    (path,) = (documents / "pagedchat").iterdir()
    assert list(cwd.iterdir()) == []
    assert str(path) in " ".join(notices)
    text = path.read_text(encoding="utf-8")
    first, second, third = (text.index(f"## User\n\n{q} question") for q in ("first", "second", "third"))
    french, brief = text.index("*System:* Answer in French."), text.index("*System:* Be brief.")
    assert text.startswith("# chat 1\n\n## User\n\nfirst question")  # the model's default: no line
    assert first < french < second < brief < third
    assert text.count("*System:*") == 2


def test_markdown_shows_a_prompt_where_it_changed_and_a_restored_chat_runs_under_its_own():
    conv = conversation(system="Be brief.")
    conv.send("hi")
    conv.add_reply("hello", reply("hello"))
    conv.set_system_prompt(None)
    conv.send("again")
    text = conv.markdown("t")
    assert text.index("*System:* Be brief.") < text.index("## User\n\nhi")
    assert text.index("## Assistant\n\nhello") < text.index("*System:* none") < text.index("## User\n\nagain")
    assert conv.fork("chat-2").markdown("t") == text

    restored = conversation(system="Be kind.")
    restored.restore(conv.turns)
    assert restored.markdown("t").count("*System:*") == 1 and "*System:* Be kind." in restored.markdown("t")
