"""PII replacement: e-mail addresses, phone numbers, IPv4/IPv6 addresses -> fixed tokens, counted.

The tokens are the ones the pretraining-data literature uses (e.g. the Dolma/OLMo and StarCoder data papers):
``|||EMAIL_ADDRESS|||``, ``|||PHONE_NUMBER|||``, ``|||IP_ADDRESS|||``. Text that already holds a token is
split around it first, so a token is never matched, counted or changed again (running the step twice gives
the same text and counts zero the second time).

Phone numbers: NANP numbers with or without "+1"/"1", with "-", ".", " " or no separators and the area code
optionally in parentheses ("(555) 123-4567", "555.123.4567", "5551234567", "+1 800 555 0199"), and
international numbers written with a "+" or "00" country code (or "(+44)") and 6-14 more digits in groups
("+44 20 7946 0958", "(+44) 20 7946 0958", "+49 (0)30 901820", "0033 1 23 45 67 89", "+81-3-1234-5678",
"+861012345678").
A digit run that is part of a longer number or word is left alone.

IP addresses: candidates are validated with Python's ``ipaddress``; ``public_ips_only=True`` replaces only
addresses that are globally routable (``ip.is_global``), leaving private, loopback, link-local, reserved and
documentation ranges in the text. An IPv6 candidate needs two non-empty groups (or an embedded IPv4, or
is the loopback ``::1``): ``::``, ``::2`` and ``a::`` are valid addresses but in text they are code
(``f :: Int``, ``x[::2]``), so they are left alone.
"""

from __future__ import annotations

import ipaddress
import re

from lmstack.data.document import Document
from lmstack.data.step import Mapper, StepStats

EMAIL_TOKEN, PHONE_TOKEN, IP_TOKEN = "|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||"
_TOKENS = re.compile(r"\|\|\|(?:EMAIL_ADDRESS|PHONE_NUMBER|IP_ADDRESS)\|\|\|")

_EMAIL = r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)"
# Anything made of hex digits and colons with at least two colons (optionally ending in a dotted quad);
# ipaddress decides whether it is an IPv6 address.
_IPV6 = (
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:"
    + _OCTET
    + r"(?:\."
    + _OCTET
    + r"){3}|[0-9A-Fa-f]{1,4})?"
    r"(?![\w:]|\.\w)"
)
_SEP = r"[-. ]?"
_NANP = (
    r"(?:(?:\+|\b)1"
    + _SEP
    + r")?(?:\([2-9]\d\d\)[ ]?|\b[2-9]\d\d"
    + _SEP
    + r")\d\d\d"
    + _SEP
    + r"\d{4}"
)
_INTL = (
    r"(?:\(\+[1-9]\d{0,2}\)|(?:\+|\b00)[1-9]\d{0,2}(?!\)))"  # "(+44)" or "+44" / "0044"
    r"(?:[ .-]?\(0\))?(?:[ .-]?\(?\d{1,5}\)?){1,5}"
)
_PHONE = rf"(?<![\w+]){_NANP}(?![\w-])|(?<![\w+]){_INTL}(?![\w-])"
_MAYBE = re.compile(r"[@\d:]")
_PII = re.compile(rf"(?P<email>{_EMAIL})|(?P<ipv6>{_IPV6})|(?P<ipv4>{_IPV4})|(?P<phone>{_PHONE})")


class PIIReplacer:
    """``replace(text) -> (text, counts)`` with counts ``{"email_address", "phone_number", "ip_address"}``."""

    def __init__(
        self,
        emails: bool = True,
        phones: bool = True,
        ips: bool = True,
        public_ips_only: bool = False,
    ):
        self.emails, self.phones, self.ips, self.public_ips_only = (
            emails,
            phones,
            ips,
            public_ips_only,
        )

    def _ip_ok(self, s: str) -> bool:
        if ":" in s and "." not in s and s != "::1" and sum(1 for g in s.split(":") if g) < 2:
            return (
                False  # "::", "::2", "a::": Haskell's "::", Python's x[::2], not addresses in prose
            )
        try:
            ip = ipaddress.ip_address(s)
        except ValueError:
            return False
        return ip.is_global or not self.public_ips_only

    def _sub(self, m: re.Match, counts: dict[str, int]) -> str:
        kind = m.lastgroup
        s = m.group(0)
        if kind == "email" and self.emails:
            counts["email_address"] += 1
            return EMAIL_TOKEN
        if kind in ("ipv4", "ipv6") and self.ips and self._ip_ok(s):
            counts["ip_address"] += 1
            return IP_TOKEN
        if kind == "phone" and self.phones and sum(c.isdigit() for c in s) >= 7:
            counts["phone_number"] += 1
            return PHONE_TOKEN
        return s

    def replace(self, text: str) -> tuple[str, dict[str, int]]:
        counts = {"email_address": 0, "phone_number": 0, "ip_address": 0}
        if not _MAYBE.search(text):  # no '@', digit or ':': nothing any pattern could match
            return text, counts
        parts, last = [], 0
        for tok in _TOKENS.finditer(text):  # never look inside an existing token
            parts.append(_PII.sub(lambda m: self._sub(m, counts), text[last : tok.start()]))
            parts.append(tok.group(0))
            last = tok.end()
        parts.append(_PII.sub(lambda m: self._sub(m, counts), text[last:]))
        return "".join(parts), counts


class PII(Mapper):
    """Replaces PII in ``doc.text``; counts per kind into ``stats.counters`` and ``metadata["pii"]`` (when any)."""

    name = "pii"

    def __init__(
        self,
        emails: bool = True,
        phones: bool = True,
        ips: bool = True,
        public_ips_only: bool = False,
    ):
        self.replacer = PIIReplacer(emails, phones, ips, public_ips_only)

    def apply(self, doc: Document, stats: StepStats) -> Document:
        text, counts = self.replacer.replace(doc.text)
        if not any(counts.values()):
            return doc
        for k, v in counts.items():
            stats.counters[k] += v
        return Document(
            text, doc.id, {**doc.metadata, "pii": {k: v for k, v in counts.items() if v}}
        )


STEPS = {"pii": PII}
