"""No secret in a log line: tokens, cookies and Authorization headers are redacted from every
log record of the process, whoever logs it and whichever handler writes it.

aiohttp logs a request it cannot parse with the raw bytes of that request (its headers,
``Authorization: Bearer ...`` included) and a traceback whose exception text repeats them.
:func:`install` wraps the logging module's record factory, so each record's message and
exception text are redacted once, when the record is made, before any handler (a file, stderr,
pytest's capture, a user's own) sees it. Patterns catch the shapes a secret travels in (an
Authorization or Cookie header, a Bearer credential, a ``token=`` query or form field, a JSON
``"token"`` field); :func:`add_secret` adds exact values a process knows (the admin token,
researcher tokens) so they are redacted wherever they appear.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

REDACTED = "[redacted]"
_MIN_SECRET = 8  # shorter values are not registered (they would redact ordinary words)

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # a header line, raw ("Authorization: Bearer x\r\n") or in a bytes repr ("...x\\r\\n'")
    (
        re.compile(
            r"(?i)\b((?:proxy-)?authorization|cookie|set-cookie|x-[a-z0-9-]*(?:token|key|secret))"
            r"(\s*[:=]\s*)[^\r\n'\"\\]*"
        ),
        r"\1\2" + REDACTED,
    ),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=:-]+"), r"\1\2" + REDACTED),
    # token=..., password=... in a query string or a form body
    (re.compile(r"(?i)\b((?:access_|admin_|api_)?(?:token|password|secret)=)[^&\s'\"\\]+"), r"\1" + REDACTED),
    # a JSON field: "token": "..."
    (re.compile(r'(?i)("(?:[a-z_]*_)?(?:token|password|secret)"\s*:\s*")[^"]*'), r"\1" + REDACTED),
]

_secrets: set[str] = set()
_lock = threading.Lock()
_installed = False


def add_secret(value: str | None) -> None:
    """Redact ``value`` wherever it appears in a log record from now on (values shorter than
    eight characters are ignored)."""
    if value and len(value.strip()) >= _MIN_SECRET:
        with _lock:
            _secrets.add(value.strip())


def redact(text: str) -> str:
    """``text`` with every secret shape and every registered secret replaced by ``[redacted]``."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    if _secrets:
        for secret in sorted(_secrets, key=len, reverse=True):  # the longest first
            if secret in text:
                text = text.replace(secret, REDACTED)
    return text


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: logging reports it itself; keep what we can
        message = str(record.msg)
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def install() -> None:
    """Redact every log record of this process from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        inner: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = inner(*args, **kwargs)
            _redact_record(record)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
