"""The one way a file's typed model says what is wrong with it: pydantic validates (strict: no coercion, no unknown
key), and its first error becomes the project's one line, never a traceback. A model's own validator says its line
itself (a ValueError); every other error is the model's template for that field (`MESSAGES`: by `field:type`, then
`field`, then `:type`), formatted with the key and the value as the file gave it.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ConfigDict, ValidationError

STRICT = ConfigDict(strict=True, extra="forbid")
# An unknown key is said first, then a missing one, then the rest in the model's field order.
_RANK = {"unexpected_keyword_argument": 0, "extra_forbidden": 0, "missing": 1, "missing_argument": 1}


def problem(exc: ValidationError, given, messages: dict[str, str | Callable[[str, object], str]], **ctx) -> str:
    """`exc`'s first error as one line (`given`: the data validated, whose values a template shows; `ctx`: more for
    the templates). A template is looked up by the error's place, longest first (`layout.tp`, then `layout`, then ""
    for the whole; `blend.*` for any entry of the list `blend`), each as `place:type`, then `place`, then by `:type`
    alone for a top-level key."""
    err = min(exc.errors(), key=lambda e: _RANK.get(e["type"], 2))
    if err["type"] == "value_error":
        return str(err["ctx"]["error"])
    loc = ["*" if isinstance(part, int) else str(part) for part in err["loc"]]  # an entry of a list: its place is *
    for n in range(len(loc), -1, -1):
        key = ".".join(loc[:n])
        kind = f":{err['type']}"
        for name in [key + kind, key, kind][: 3 if n == 1 else 2] if n else [""]:
            if (message := messages.get(name)) is not None:
                value = _at(given, err["loc"][:n])
                return message(key, value) if callable(message) else message.format(key=key, value=value, **ctx)
    return f"{'.'.join(map(str, err['loc']))} is {err['input']!r}: {err['msg'].lower()}"


def _at(given, loc):
    """The value at `loc` in `given` as the file gave it (None where it has none)."""
    for part in loc:
        given = given.get(part) if isinstance(given, dict) else given[part] if isinstance(given, list) else None
    return given
