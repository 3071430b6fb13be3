"""Secrets out of everything the harness shows or stores: the password of any `scheme://user:password@host`.

Storage URLs (`tune.storage=postgresql://user:password@host/db`) reach the command line, the config,
messages and W&B; each of those goes through `mask_secrets` first. A password may hold '@' when the URL is
typed unencoded, so the mask runs to the last '@' before whitespace or a quote: it may hide a little more than
the password, never less.
"""

from __future__ import annotations

import re
from typing import Any

_USERINFO = re.compile(r"""([A-Za-z][\w+.\-]*://[^:/@\s'"]*:)[^\s'"]*@""")


def mask_secrets(value: Any) -> Any:
    """`value` with every URL password replaced by `***`: a string, or the strings inside dicts, lists, tuples."""
    if isinstance(value, str):
        return _USERINFO.sub(r"\1***@", value)
    if isinstance(value, dict):
        return {mask_secrets(k): mask_secrets(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_secrets(v) for v in value)
    return value
