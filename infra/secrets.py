"""Secrets: the one rule for which keys name a credential, the one masking of credentials in text, and the scrubbed
environment of helper processes.

- `is_secret(key, value)`: a key names a credential if it contains key, secret, passw, auth, cred or signature, is
  `sig`, or contains token with a non-numeric value (any case). Two deliberate exceptions, because hiding
  hyperparameters makes runs incomparable: "tokeniz…" (a tokenizer path) is no credential, and a token key whose
  value is a number (or unset) is a count (max_new_tokens=16), never a credential. MLflow params
  (`infra.tracking.redact`), secret config overrides (`infra.config.is_secret_override`) and `mask_secrets` below
  all use it.
- `mask_secrets(text)`: the credentials inside free text become "***": a URL's user info (`user:***@`, and a
  token-only `https://***@host`; a password holding '@' is masked whole), query parameters that name a secret
  (`?token=***`, `&X-Amz-Signature=***`), `Authorization:`/`Bearer` values and `name: value` / `name=value` pairs
  whose name is a secret (`api_key=***`, `"password": "***"`).
- `scrubbed_env(environ)`: a copy of the environment without credentials (every AWS_*, names holding TOKEN, KEY,
  SECRET, PASSW, AUTH, CRED or SIGNATURE, values with a credential in a URL), for helper processes that run code
  or parse untrusted text (the `math` verifier's sympy helper): what is needed to start Python stays (PATH, HOME,
  LANG, LC_*, PYTHON*, VIRTUAL_ENV, TMPDIR, …).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

REDACTED = "***"

_ALWAYS_SECRET = re.compile(r"key|secret|passw|auth|cred|signature", re.IGNORECASE)
_SIG = re.compile(r"(^|[._-])sig$", re.IGNORECASE)
_TOKEN = re.compile(r"token", re.IGNORECASE)
_TOKENIZER = re.compile(r"tokeniz", re.IGNORECASE)
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

# scheme://userinfo@host: the user info runs to the LAST '@' before the path, query, fragment or whitespace, so a
# password holding '@' is masked whole
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s\"'<>]*)@(?=[^/?#\s@\"'<>])")
_QUERY = re.compile(r"(?P<pre>[?&;](?P<name>[A-Za-z0-9_.%~-]+)=)(?P<val>[^&;#\s\"'<>]*)")
_BEARER = re.compile(r"(?P<pre>\b(?:Bearer|Basic|Token|Digest)\s+)(?P<val>[A-Za-z0-9._~+/=:-]{4,})", re.IGNORECASE)
# name: value / name=value / "name": "value"; an Authorization value runs to the end of its line or quote
_AUTH_HEADER = re.compile(r"(?P<pre>\b(?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?)(?P<val>[^\"'\r\n]+)",
                          re.IGNORECASE)
_PAIR = re.compile(r"(?P<pre>(?<![\w.-])(?P<name>[A-Za-z_][\w.-]*)[\"']?[ \t]*[:=][ \t]*(?P<q>[\"']?))"
                   r"(?P<val>[^\s\"'&,;}\]]+)")

# environment variables always kept by `scrubbed_env` (what starting Python and locale/temp handling need)
_ENV_KEEP = re.compile(r"PATH|HOME|LANG|LANGUAGE|LC_\w+|TZ|TERM|USER|LOGNAME|SHELL|TMPDIR|TEMP|TMP|VIRTUAL_ENV|"
                       r"PYTHONPATH|PYTHONHOME|PYTHONIOENCODING|PYTHONUTF8|PYTHONHASHSEED|PYTHONDONTWRITEBYTECODE|"
                       r"PYTHONNOUSERSITE|PYTHONSAFEPATH|PYTHONWARNINGS|PYTHONUNBUFFERED|SYSTEMROOT|"
                       r"TOKENIZERS_PARALLELISM")
_ENV_DROP = re.compile(r"^AWS_|^AZURE_|^GOOGLE_APPLICATION_CREDENTIALS$|TOKEN|KEY|SECRET|PASSW|AUTH|CRED|SIGNATURE|"
                       r"^ALLOY_SECRET_OVERRIDES$", re.IGNORECASE)


def _numeric_or_unset(value: Any) -> bool:
    if value is None or value == "null":
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, str) and _NUMBER.fullmatch(value.strip()) is not None


def is_secret(key: Any, value: Any = "?") -> bool:
    """Whether `key` names a credential (module docstring). `value` only matters for token keys: a number or an
    unset value there is a count, not a credential; leave it out to ask about the name alone."""
    k = _TOKENIZER.sub("", str(key))
    last = k.rsplit(".", 1)[-1]
    if _ALWAYS_SECRET.search(k) or _SIG.search(last):
        return True
    if _TOKEN.search(k):
        return not _numeric_or_unset(value)
    return False


def _userinfo(m: re.Match) -> str:
    info = m.group("info")
    if not info:
        return m.group(0)
    user, sep, _ = info.partition(":")
    return m.group("scheme") + (f"{user}:{REDACTED}" if sep else REDACTED) + "@"


def _query(m: re.Match) -> str:
    return m.group("pre") + REDACTED if m.group("val") and is_secret(m.group("name"), m.group("val")) else m.group(0)


def _pair(m: re.Match) -> str:
    if m.group("val") == REDACTED or not is_secret(m.group("name"), m.group("val")):
        return m.group(0)
    return m.group("pre") + REDACTED


def mask_secrets(text: str) -> str:
    """`text` with every credential the module docstring lists replaced by "***"; anything else unchanged.

    mask_secrets("https://u:p@ss@h/x?token=t&n=1") == "https://u:***@h/x?token=***&n=1"
    mask_secrets("https://ghp_abc@github.com") == "https://***@github.com"
    mask_secrets("Authorization: Bearer sk-1") == "Authorization: ***"
    """
    if not isinstance(text, str) or not text:
        return text
    out = _URL_USERINFO.sub(_userinfo, text)
    out = _QUERY.sub(_query, out)
    out = _AUTH_HEADER.sub(lambda m: m.group("pre") + REDACTED, out)
    out = _BEARER.sub(lambda m: m.group("pre") + REDACTED if m.group("val") != REDACTED else m.group(0), out)
    return _PAIR.sub(_pair, out)


def scrubbed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) without credentials (module docstring), for helper processes."""
    env = os.environ if environ is None else environ
    out = {}
    for name, value in env.items():
        if not _ENV_KEEP.fullmatch(name) and (_ENV_DROP.search(name) or mask_secrets(value) != value):
            continue
        out[name] = value
    return out
