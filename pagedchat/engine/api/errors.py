"""An exception told in one line: what the app, the CLI and the model loader show the user."""


def one_line(error: BaseException, *, with_type: bool = False) -> str:
    """The first line of `str(error)`, or the type's name when it says nothing. `with_type`: prefixed by
    the type's name ("ValueError: ..."), for errors that are not the user's to fix."""
    lines = str(error).strip().splitlines()
    name = type(error).__name__
    if not lines:
        return name
    return f"{name}: {lines[0]}" if with_type else lines[0]
