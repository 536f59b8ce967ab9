"""Showing untrusted text on a terminal: nothing from the input reaches it raw.

Every key, value, file name and tensor name that specvit echoes comes from a file someone else may have
written. :func:`escape` turns control characters (ANSI escape sequences, carriage returns, newlines, NUL)
and invisible characters (zero-width spaces, bidirectional overrides, soft hyphens) into visible Python
escapes such as ``\\x1b`` and ``\\u200b``, so they can neither move the cursor, clear the screen, fake an
"ok" line nor hide text. :func:`quote` also escapes the characters that look like ASCII letters but are
not (a Cyrillic ``е`` in ``depth``, a fullwidth ``ａ``) and :func:`oddities` says in words what they are.
Only :mod:`unicodedata` is used: no confusables table is needed, because the keys and kinds of a spec are
all ASCII, so every non-ASCII letter in a word that also has ASCII letters is worth pointing out.
"""

from __future__ import annotations

import unicodedata

__all__ = ["escape", "oddities", "quote", "visible", "with_oddities"]

_INVISIBLE_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Mn", "Me"}


def _code(ch: str) -> str:
    """``\\x1b``, ``\\u200b`` or ``\\U000e0041``: the Python escape of one character."""
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _invisible(ch: str) -> bool:
    """Whether ``ch`` draws nothing, moves the cursor, or changes how the text around it is shown."""
    if ch == " ":
        return False
    category = unicodedata.category(ch)
    return category in _INVISIBLE_CATEGORIES or category == "Zs" or not ch.isprintable()


def _script(ch: str) -> str:
    """The first word of the character's Unicode name (``CYRILLIC``, ``GREEK``, ``FULLWIDTH``), or ``""``."""
    return unicodedata.name(ch, "").split(" ", 1)[0]


def _lookalike(ch: str, text: str) -> bool:
    """Whether ``ch`` is a non-ASCII letter or digit that passes for an ASCII one in ``text``.

    True when NFKC folds it to ASCII (fullwidth and mathematical letters, superscript digits) or when it is
    a letter of another script inside a word that also has ASCII letters (``dеpth`` with a Cyrillic ``е``).
    """
    if ch.isascii() or not ch.isalnum():
        return False
    if unicodedata.normalize("NFKC", ch).isascii():
        return True
    return _script(ch) != "LATIN" and any(c.isascii() and c.isalpha() for c in text)


def escape(text: str) -> str:
    """``text`` with every control and invisible character written as a visible escape (``\\x1b``).

    Printable characters, ASCII and not, are kept as they are; a backslash is kept too, so the result
    is for reading, not for parsing back.

    Args:
        text: untrusted text.
    """
    if text.isascii() and text.isprintable():
        return text
    return "".join(_code(c) if _invisible(c) else c for c in text)


def visible(text: str) -> str:
    """``text`` with control, invisible and look-alike characters escaped: ``d\\u0435pth``.

    Args:
        text: untrusted text, such as a key path.
    """
    return "".join(_code(c) if _invisible(c) or _lookalike(c, text) else c for c in text)


def quote(text: str) -> str:
    """``text`` in single quotes, with control, invisible and look-alike characters escaped.

    ``quote("dеpth")`` with a Cyrillic ``е`` is ``'d\\u0435pth'``; ``quote("depth")`` is ``'depth'``.

    Args:
        text: untrusted text, such as a key or a value from a spec.
    """
    return f"'{visible(text)}'"


def oddities(text: str) -> list[str]:
    """What is unusual about ``text``, in words: ``["a Cyrillic 'е' (U+0435)"]``.

    One entry per distinct look-alike or invisible character, in order of first appearance.

    Args:
        text: untrusted text.
    """
    out: list[str] = []
    seen: set[str] = set()
    for ch in text:
        if ch in seen:
            continue
        seen.add(ch)
        name = unicodedata.name(ch, "")
        if _invisible(ch):
            if unicodedata.category(ch) == "Cc":
                out.append(f"a control character {_code(ch)}")
            else:
                out.append(
                    f"an invisible U+{ord(ch):04X} ({name})" if name else f"an invisible U+{ord(ch):04X}"
                )
        elif _lookalike(ch, text):
            script = _script(ch).capitalize()
            article = "an" if script[:1] in "AEIOU" else "a"
            twin = _ascii_twin(ch)
            like = f" that looks like '{twin}'" if twin else ""
            out.append(f"{article} {script} '{ch}' (U+{ord(ch):04X}){like}")
    return out


def _ascii_twin(ch: str) -> str:
    """The ASCII letter ``ch`` passes for (by NFKC, else by its name: Cyrillic ``е`` is ``e``), or ``""``."""
    folded = unicodedata.normalize("NFKC", ch)
    if folded.isascii() and folded:
        return folded
    name = unicodedata.name(ch, "")
    latin = _TWINS.get(name.split(" LETTER ", 1)[-1], "") if " LETTER " in name else ""
    return latin.upper() if "CAPITAL" in name else latin


# letters of other scripts drawn like a Latin letter, by the last words of their Unicode names
_TWINS = {
    "A": "a", "IE": "e", "O": "o", "OMICRON": "o", "ES": "c", "ER": "p", "HA": "x", "U": "y",
    "BYELORUSSIAN-UKRAINIAN I": "i", "IOTA": "i", "JE": "j", "DZE": "s", "KA": "k", "KAPPA": "k",
    "EN": "h", "NU": "v", "TE": "t", "TAU": "t", "EM": "m", "VE": "b", "ALPHA": "a", "EPSILON": "e",
    "RHO": "p", "CHI": "x", "UPSILON": "u", "BETA": "b", "ETA": "n", "ZETA": "z", "GHE": "r",
}  # fmt: skip


def with_oddities(text: str) -> str:
    """``"it contains a Cyrillic 'е' (U+0435) that looks like 'e'"`` for ``text``, or ``""``.

    Args:
        text: untrusted text.
    """
    found = oddities(text)
    return f"it contains {', '.join(found)}" if found else ""
