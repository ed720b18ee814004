"""Secrets a server may send back, and how kvreplay keeps them off the screen and out of
the run folder.

A server knows the API key it was sent (``--api-key-env``) and may echo it anywhere: in
its model id, its version, a setting, an error. Whatever a server says is untrusted text,
so every string kvreplay reads from an answer is checked against the key and against the
other credentials this process holds (environment variables named like a key, token,
secret or password), in the forms an echo takes: whole, cut to a piece, upper- or
lower-cased, with characters put between (a normalisation to letters and digits), URL-,
base64- or hex-encoded (any :data:`PIECE` characters of an encoding). A value that holds
one is never printed or recorded.
"""

from __future__ import annotations

import base64
import os
import re
import unicodedata
import urllib.parse
from dataclasses import dataclass

PIECE = 12  # characters of a secret that, found in a server's text, count as the secret
SHORTEST = 8  # an environment variable's value shorter than this is no credential
CREDENTIAL_NAME = re.compile(r"(?:^|_)(?:API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD)$", re.ASCII)
WITHHELD = "[withheld: it holds the API key or another secret]"


def _letters(text: str) -> str:
    """Letters and digits only, compatibility-folded and case-folded: what is left of a
    secret whatever a server puts between its characters or however it spells them."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return "".join(c for c in folded if c.isascii() and c.isalnum())


def _encodings(secret: str) -> list[str]:
    """The secret as URL, hex and base64 encode it; base64 at each of its three
    alignments, less the characters that also encode what stands before or after it."""
    raw = secret.encode("utf-8")
    forms = [urllib.parse.quote(secret, safe=""), raw.hex()]
    for pad in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            encoded = encode(b"\0" * pad + raw).decode("ascii")
            forms.append(encoded[4 if pad else 0 : -4])
    return [form for form in forms if len(form) >= SHORTEST]


def _pieces(text: str) -> set[str]:
    """Every run of :data:`PIECE` characters (the whole text when shorter)."""
    if len(text) <= PIECE:
        return {text} if text else set()
    return {text[i : i + PIECE] for i in range(len(text) - PIECE + 1)}


@dataclass(frozen=True)
class Secrets:
    """The values a server's text must not hold, as :meth:`holds` looks for them."""

    plain: tuple[str, ...] = ()  # each secret as given (replaced in an error's text)
    pieces: frozenset[str] = frozenset()  # normalised pieces (see :func:`_letters`)
    encoded: frozenset[str] = frozenset()  # pieces of its lower-cased encodings

    @classmethod
    def of(cls, api_key: str | None) -> Secrets:
        """The API key and every credential in this process's environment."""
        values = [api_key] if api_key else []
        values += [
            value
            for name, value in os.environ.items()
            if CREDENTIAL_NAME.search(name.upper()) and len(value.strip()) >= SHORTEST
        ]
        values = sorted(set(values), key=len, reverse=True)
        pieces = frozenset(p for value in values for p in _pieces(_letters(value)))
        encoded = frozenset(
            p for value in values for form in _encodings(value) for p in _pieces(form.lower())
        )
        return cls(tuple(values), pieces, encoded)

    def holds(self, text: str) -> bool:
        """Whether ``text`` holds a secret in any of the forms an echo takes."""
        if not self.plain or not text:
            return False
        letters = _letters(text)
        if any(piece in letters for piece in self.pieces if len(piece) <= len(letters)):
            return True
        lowered = text.lower()
        return any(piece in lowered for piece in self.encoded)

    def redact(self, text: str) -> str:
        """``text`` with each secret replaced by ``[redacted]``; withheld whole when a
        secret is still in it in another form."""
        for value in self.plain:
            text = text.replace(value, "[redacted]")
        return WITHHELD if self.holds(text) else text
