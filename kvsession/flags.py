"""Every `LLM(...)` keyword as a `--kebab-case` command-line flag, read off the signature of
`LLM.__init__` so that a new engine argument is a new flag without touching this file. Used
by the server (`python -m kvsession serve`) and the prefill worker (`python -m
kvsession.worker`, which leaves out the arguments that only a caller has). Imports nothing
of kvsession (the LLM class is passed in): the server may use it.

The flag's type is the default's type (`--block-size 32` is an int, `--enable-prefix-caching`
/ `--no-enable-prefix-caching` a bool). Arguments whose default is None name their type in
`NONE_DEFAULT_TYPES` (a None default says nothing about the type); those not listed take a
string, which `LLM` validates like any other value. The value "none" gives None back.
"""

from __future__ import annotations

import argparse
import inspect
import json


def _optional(kind):
    """A parser of `kind` that also reads "none" as None (to reset a non-None default)."""
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def json_value(text: str):
    """A JSON flag value (`--speculative-config '{"method": "ngram", ...}'`, as vLLM's)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


json_value.__name__ = "json"  # argparse names the type in its messages and metavar

# arguments whose default is None: the type their values take (others: strings)
NONE_DEFAULT_TYPES = {"max_model_len": int, "spill_after_s": float,
                      "speculative_config": json_value, "object_store_options": json_value}
# arguments that take several values (`--prefill-worker tcp://a:1 tcp://b:2`)
MANY = {"prefill_worker"}


def llm_parameters(llm_cls, exclude: frozenset[str] = frozenset()) -> list[inspect.Parameter]:
    """The keyword arguments of `llm_cls.__init__` (model, self, **unknown and `exclude`
    left out)."""
    return [p for name, p in inspect.signature(llm_cls.__init__).parameters.items()
            if name not in ("self", "model", *exclude) and p.kind in (
                inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def add_llm_flags(parser: argparse.ArgumentParser, llm_cls,
                  exclude: frozenset[str] = frozenset(), model_required: bool = True) -> None:
    """`--model DIR` and one flag per LLM keyword (but `exclude`), in an "engine" group."""
    group = parser.add_argument_group("engine (every LLM(...) argument"
                                      + (", but those of a caller)" if exclude else ")"))
    group.add_argument("--model", required=model_required, help="a HF checkpoint directory")
    for p in llm_parameters(llm_cls, exclude):
        flag = "--" + p.name.replace("_", "-")
        default = p.default
        if isinstance(default, bool):
            group.add_argument(flag, dest=p.name, default=default,
                               action=argparse.BooleanOptionalAction,
                               help=f"LLM({p.name}=...); default {default}")
            continue
        kind = type(default) if default is not None else NONE_DEFAULT_TYPES.get(p.name, str)
        group.add_argument(flag, dest=p.name, default=default, type=_optional(kind),
                           nargs="+" if p.name in MANY else None, metavar=kind.__name__.upper(),
                           help=f"LLM({p.name}=...); default {default!r}")


def llm_kwargs(args: argparse.Namespace, llm_cls, exclude: frozenset[str] = frozenset()) -> dict:
    """The LLM keyword arguments the parsed flags give (defaults included)."""
    out = {}
    for p in llm_parameters(llm_cls, exclude):
        value = getattr(args, p.name)
        if p.name in MANY and isinstance(value, list) and len(value) == 1:
            value = value[0]  # one address: the plain string form LLM documents
        out[p.name] = value
    return out
