"""Issue 16, item 9: the f2 dialog offers vLLM's three penalties (checked as SamplingParams checks them),
the tab's next turn samples with them, and they are saved with the tab's settings in the history and
restored at the next start."""

from support.app import SIZE, loaded, reply_done  # noqa: F401 (make_app is a fixture)
from support.tui import async_test, wait_until
from textual.widgets import Input, TextArea

from pagedchat.engine.api.params import SamplingParams
from pagedchat.history import History
from pagedchat.tui.chat_backend import LocalChat
from pagedchat.tui.chat_record import settings_of
from pagedchat.tui.conversation import DEFAULT_PARAMS
from pagedchat.tui.restore_screen import RestoreScreen
from pagedchat.tui.settings_screen import SettingsScreen

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PENALTIES = {"repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.75}


async def open_settings(pilot) -> SettingsScreen:
    await pilot.press("f2")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), what="the settings")
    await pilot.pause()
    return pilot.app.screen


async def save(pilot, screen: SettingsScreen, **values: str) -> None:
    for name, value in values.items():
        screen.query_one(f"#{name}", Input).value = value
    save_button = screen.query_one("#save")  # a button ignores clicks while it shows the last one
    await wait_until(pilot, lambda: not save_button.has_class("-active"), what="the save button to take clicks")
    await pilot.click("#save")


async def restored(pilot):
    """The pane of the chat the app offered back at its start."""
    app = pilot.app
    await wait_until(pilot, lambda: isinstance(app.screen, RestoreScreen), what="the offer")
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.current_pane is not None and app.current_pane.conversation.turns,
                     what="the restored tab")
    return app.current_pane


def error(screen: SettingsScreen) -> str:
    return str(screen.query_one("#error").render())


@async_test
async def test_f2_offers_the_penalties_checks_them_and_the_next_turn_samples_with_them(make_app, tmp_path,
                                                                                       monkeypatch):
    sent = []
    reply = LocalChat.reply
    monkeypatch.setattr(LocalChat, "reply", lambda self, send, params, sink: (sent.append(params),
                                                                               reply(self, send, params, sink)))
    app = make_app(PARAMS)
    app.history = History(tmp_path / "history.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        pane = app.current_pane
        screen = await open_settings(pilot)
        assert screen.focused is screen.query_one("#system", TextArea)  # typing goes into a field at once
        shown = {name: screen.query_one(f"#{name}", Input).value for name in PENALTIES}
        assert shown == {"repetition_penalty": "1", "presence_penalty": "0", "frequency_penalty": "0"}

        for values, message in (
                ({"repetition_penalty": "0"}, "repetition_penalty must be greater than zero, got 0.0"),
                ({"repetition_penalty": "-1.5"}, "repetition_penalty must be greater than zero"),
                ({"repetition_penalty": "1.2", "presence_penalty": "2.5"}, "presence_penalty must be in [-2, 2], got 2.5"),
                ({"presence_penalty": "0", "frequency_penalty": "-3"}, "frequency_penalty must be in [-2, 2], got -3.0"),
                ({"frequency_penalty": "lots"}, "frequency_penalty must be a number, got 'lots'"),
                ({"frequency_penalty": "nan"}, "frequency_penalty must be a number, got 'nan'"),
                ({"frequency_penalty": "0", "max_tokens": "8.5"}, "max_tokens must be a whole number, got '8.5'")):
            await save(pilot, screen, **values)
            await wait_until(pilot, lambda: message in error(screen), what=f"the message {message!r}")
            assert app.screen is screen and pane.conversation.params == PARAMS  # nothing applied

        await save(pilot, screen, max_tokens="8", **{name: str(value) for name, value in PENALTIES.items()})
        await wait_until(pilot, lambda: app.screen is not screen, what="the dialog to close")
        expected = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **PENALTIES)
        assert pane.conversation.params == expected  # the tab's other settings kept

        assert pane.send("hello")
        await reply_done(pilot, pane)
        assert sent == [expected]  # the next turn asks the engine for them

        screen = await open_settings(pilot)  # the dialog shows what the tab has now
        assert {name: screen.query_one(f"#{name}", Input).value for name in PENALTIES} == \
            {"repetition_penalty": "1.25", "presence_penalty": "0.5", "frequency_penalty": "-0.75"}
        await pilot.press("escape")

    [saved] = History(tmp_path / "history.sqlite3").open_chats()
    assert saved.settings == settings_of(expected)
    assert {name: saved.settings[name] for name in PENALTIES} == PENALTIES

    again = make_app(PARAMS)
    again.history = History(tmp_path / "history.sqlite3")
    async with again.run_test(size=SIZE) as pilot:
        assert (await restored(pilot)).conversation.params == expected


@async_test
async def test_a_chat_saved_before_the_penalties_existed_gets_the_apps_penalties(make_app, tmp_path):
    app_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.1)
    history = History(tmp_path / "history.sqlite3")
    chat = history.new_chat("old chat", None, {"temperature": 0.5, "top_p": 0.9, "max_tokens": 6})
    history.add_message(chat, "user", "hi")
    history.add_message(chat, "assistant", "hello")
    app = make_app(app_params)
    app.history = History(tmp_path / "history.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        assert (await restored(pilot)).conversation.params == SamplingParams(
            temperature=0.5, top_p=0.9, max_tokens=6, ignore_eos=True, repetition_penalty=1.1)


def test_the_app_default_saves_and_restores_every_field_of_the_dialog():
    saved = settings_of(DEFAULT_PARAMS)
    assert set(saved) == {"temperature", "top_p", "max_tokens", "repetition_penalty", "presence_penalty",
                          "frequency_penalty"}
    assert SamplingParams(**saved) == SamplingParams(**{name: getattr(DEFAULT_PARAMS, name) for name in saved})
