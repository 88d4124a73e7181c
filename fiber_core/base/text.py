"""Text a program sent, made safe to show: escape sequences and control characters out."""

from __future__ import annotations

import re

# Compiled at the first text that needs it (re caches it), not at import: every job imports
# this module, and most never show a control character.
_ESCAPE_SEQUENCE = (
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"  # CSI: parameters, intermediates, the final byte
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d-\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, DCS...: to ST
    r"|\x1b[ -/]*[0-~]?"  # any other escape: intermediates and one final byte
)
_LINE_BREAKS = str.maketrans("\t\n\r\v\f", "     ")
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # controls, bidi and zero-width marks


def printable(text: str, mark: str = "?") -> str:
    """``text`` safe to write to a terminal or a page: each escape sequence and each other
    control character (C0, C1, DEL, bidi overrides, line separators) becomes ``mark``
    (``""``: removed), tabs and line breaks a space. Printable Unicode is kept as it is."""
    if text.isprintable():
        return text
    import unicodedata  # here: its tables are not needed for printable text

    text = re.sub(_ESCAPE_SEQUENCE, mark, text).translate(_LINE_BREAKS)
    return "".join(mark if unicodedata.category(c) in _UNPRINTABLE else c for c in text)
