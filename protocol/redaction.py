"""Credentials out of everything printed or logged: a Redis URL shows its host, never its password."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

MASK = "***"
_SECRET_PARAMS = {"password", "username"}


def redact_url(url: str) -> str:
    """`redis://user:secret@host:6379/0` -> `redis://user:***@host:6379/0`.

    A lone userinfo (`redis://secret@host`, a password written without the colon) is masked whole, and so
    are `password=` / `username=` query parameters. Text that is not a URL comes back masked after any '@'.
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:  # not parseable: keep the scheme and what follows the last '@'
        if "@" not in url:
            return url
        head, _, rest = url.rpartition("@")
        scheme = head.split("//", 1)[0] + "//" if "//" in head else ""
        return f"{scheme}{MASK}@{rest}"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo = f"{parts.username or ''}:{MASK}" if parts.password is not None else MASK
        netloc = f"{userinfo}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = [(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        query = urlencode(pairs, safe="*")
    out = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else f"{netloc}{parts.path}"
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def secrets_of(url: str) -> list[str]:
    """The secret strings inside a URL (password, lone userinfo, query secrets), raw and percent-decoded."""
    found: list[str] = []
    try:
        parts = urlsplit(url)
        if "@" in parts.netloc:
            userinfo = parts.netloc.rsplit("@", 1)[0]
            found.append(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)
        found += [v for k, v in parse_qsl(parts.query) if k.lower() in _SECRET_PARAMS]
    except ValueError:
        if "@" in url:
            found.append(url.split("//", 1)[-1].rsplit("@", 1)[0])
    found += [unquote(s) for s in found]
    return [s for s in dict.fromkeys(found) if s]


def scrub(text: str, url: str) -> str:
    """`text` (an error message, say) with every secret of `url` replaced by ***."""
    for secret in sorted(secrets_of(url), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
