"""Walking JSON Schemas and checking their regular expressions, wherever a schema enters
(a tool's parameters, a structured output's json_schema): the one place that knows where
a schema keeps subschemas. Imports nothing of kvsession but its errors (xgrammar, when
installed, to ask whether it reads a pattern)."""

from __future__ import annotations

import re

from kvsession.errors import ConfigError

# where JSON Schema keeps subschemas: everything else in a schema is data (enum, const,
# default, examples...), which may hold anything, keys named like keywords included
SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})
SUBSCHEMA_ONE = frozenset({"items", "additionalProperties", "additionalItems", "not",
                           "contains", "propertyNames", "if", "then", "else",
                           "unevaluatedItems", "unevaluatedProperties"})
SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})


def subschemas(node: dict):
    """(path suffix, subschema) of every subschema directly under `node`."""
    for k, v in node.items():
        if k in SUBSCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                yield f"/{k}/{name}", sub
        elif k in SUBSCHEMA_LISTS and isinstance(v, list):
            for i, sub in enumerate(v):
                yield f"/{k}/{i}", sub
        elif k in SUBSCHEMA_ONE and isinstance(v, dict | bool):
            yield f"/{k}", v


def regex_error(pattern: str) -> str | None:
    """Why `pattern` is no regular expression, or None. JSON Schema's dialect is ECMA 262's,
    which Python's `re` approximates and xgrammar (which compiles it for structured output)
    knows a subset of: a pattern is refused only when both reject it (Python's `re` alone
    without xgrammar), so a valid one is not refused for one parser's gaps (what the
    grammar engine cannot enforce is refused when it must be compiled)."""
    try:
        re.compile(pattern)
        return None
    except re.error as e:
        why = str(e)
    except (RecursionError, OverflowError, ValueError):
        why = None  # too deep for Python's parser to tell
    try:
        import xgrammar
    except ImportError:
        return why
    try:
        xgrammar.Grammar.from_regex(pattern)
        return None
    except (RuntimeError, ValueError, TypeError) as e:
        # xgrammar reports "[time] file.cc:line: message": keep the message
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return why or (msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg)


def check_patterns(schema, where: str, path: str = "") -> None:
    """ConfigError naming `where` when a `pattern` (or a patternProperties key) anywhere in
    the JSON schema is no regular expression: checked where a schema enters (a tool's
    parameters are compiled only when a call is forced, so a bad one went unnoticed)."""
    if not isinstance(schema, dict):
        return
    regexes = [("pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        regexes += [("patternProperties", k) for k in schema["patternProperties"]]
    for keyword, regex in regexes:
        why = regex_error(regex)
        if why is not None:
            raise ConfigError(f"{where} has an invalid regular expression in {keyword!r} (at "
                              f"{path or '/'}): {regex!r:.80}: {why}")
    for suffix, sub in subschemas(schema):
        check_patterns(sub, where, path + suffix)
