"""PII: every listed format replaced with its token and counted exactly; existing tokens left alone; the
public-IPs-only option decided by Python's ipaddress (the independent reference for private/reserved)."""

import ipaddress

import pytest

from lmstack.data.document import Document
from lmstack.data.pii import EMAIL_TOKEN, IP_TOKEN, PHONE_TOKEN, PII, PIIReplacer
from lmstack.data.step import StepStats

PHONES = [
    "(555) 123-4567",
    "(555)123-4567",
    "555-123-4567",
    "555.123.4567",
    "555 123 4567",
    "5551234567",
    "+1 555 123 4567",
    "+1-555-123-4567",
    "1-800-555-0199",
    "+1 (555) 123-4567",
    "+44 20 7946 0958",
    "+44 (0)20 7946 0958",
    "(+44) 20 7946 0958",  # the country code in parentheses: the whole number, both parentheses
    "+44-20-7946-0958",
    "+49 30 901820",
    "+33 1 23 45 67 89",
    "+81-3-1234-5678",
    "+86 10 1234 5678",
    "+861012345678",
    "0044 20 7946 0958",
    "+91 98765 43210",
    "+61 2 9374 4000",
]
EMAILS = [
    "john.doe@example.com",
    "a@b.io",
    "first.last+tag@mail.example.co.uk",
    "x_y-z@sub-domain.example.org",
]
IPS = [
    "8.8.8.8",
    "192.168.1.1",
    "10.0.0.254",
    "255.255.255.255",
    "2001:4860:4860::8888",
    "fe80::1",
    "::1",
    "2001:db8:0:0:1:0:0:1",
    "::ffff:192.0.2.128",
]


@pytest.mark.parametrize("phone", PHONES)
def test_every_phone_format(phone):
    out, counts = PIIReplacer().replace(f"Call {phone} today.")
    assert out == f"Call {PHONE_TOKEN} today." and counts["phone_number"] == 1


@pytest.mark.parametrize("email", EMAILS)
def test_every_email_format(email):
    out, counts = PIIReplacer().replace(f"Write to {email}, please.")
    assert out == f"Write to {EMAIL_TOKEN}, please." and counts["email_address"] == 1


@pytest.mark.parametrize("ip", IPS)
def test_every_ip_format_and_public_only(ip):
    out, counts = PIIReplacer().replace(f"Server {ip} is up.")
    assert out == f"Server {IP_TOKEN} is up." and counts["ip_address"] == 1
    public = ipaddress.ip_address(ip).is_global  # the reference for "public"
    out, counts = PIIReplacer(public_ips_only=True).replace(f"Server {ip} is up.")
    assert counts["ip_address"] == int(public)
    assert out == (f"Server {IP_TOKEN} is up." if public else f"Server {ip} is up.")


@pytest.mark.parametrize(
    "text",
    [
        "Version 3.11.2 and 1.2.3.4.5",
        "On 2024-01-01 at 12:30:45",
        "pi = 3.14159",
        "ISBN 978-3-16-148410-0",
        "order 1234567890123456",
        "999.1.1.1 and 256.0.0.1",
        "an @ sign alone",
        "zip 12345",
        "f :: Int -> Int",  # valid IPv6 ("::", "::2", "a::") in ipaddress's eyes, but code in text
        "x[::2] and a[::-1]",
        "std::vector and a::",
    ],
)
def test_non_pii_left_alone(text):
    assert PIIReplacer().replace(text) == (
        text,
        {"email_address": 0, "phone_number": 0, "ip_address": 0},
    )


def test_exact_counts_and_existing_tokens_never_touched():
    text = (
        f"Mail {EMAILS[0]} or {EMAILS[1]}; call {PHONES[0]}, {PHONES[10]} or {PHONES[5]}; hosts {IPS[0]}, "
        f"{IPS[4]}. Already clean: {EMAIL_TOKEN} {PHONE_TOKEN} {IP_TOKEN}|||PHONE_NUMBER|||."
    )
    st = StepStats("pii")
    doc = PII().apply(Document(text, "x"), st)
    assert dict(st.counters) == {"email_address": 2, "phone_number": 3, "ip_address": 2}
    assert doc.metadata["pii"] == {"email_address": 2, "phone_number": 3, "ip_address": 2}
    assert (
        doc.text.count(EMAIL_TOKEN) == 3
        and doc.text.count(PHONE_TOKEN) == 5
        and doc.text.count(IP_TOKEN) == 3
    )
    assert doc.text.endswith(
        f"Already clean: {EMAIL_TOKEN} {PHONE_TOKEN} {IP_TOKEN}|||PHONE_NUMBER|||."
    )
    st2 = StepStats("pii")  # idempotent: a second pass finds nothing and changes nothing
    again = PII().apply(doc, st2)
    assert again.text == doc.text and sum(st2.counters.values()) == 0
