"""Append-only session history: the session's token log is the truth.

`HistoryMode.APPEND` (the default): a reply's tokens stay in the log exactly as generated;
each new message (user, tool result, system note) is appended as the chat template renders
it *after* what is already there. Past turns are never re-rendered, so a template that
rewrites history (strips reasoning from past assistant turns, re-dates the system prompt,
renders the last assistant turn differently) or a reply that re-tokenises differently costs
nothing: a turn computes only its delta (plus the reply's last token, whose KV no step has
written yet).

How a delta is derived from the template itself (`ChatRenderer.delta`): the template
renders a *probe* conversation that ends the way the log ends — an assistant reply whose
content is a sentinel — followed by the new messages, with the generation prompt; the
delta is the text after the sentinel: the template's end of the assistant turn, the new
messages, the next assistant header. The probe's earlier turns are placeholders, so what
the template would do to past turns cannot reach the delta. If the reply ended with an end
token the closing text starts with (the usual EOS), that token is in the log already and is
not appended twice. A template that cannot render the probe for a message shape (it
raises, or drops the sentinel) is not append-stable for it: that turn falls back to
`HistoryMode.TEMPLATE` (logged), never to a wrong log.

`HistoryMode.TEMPLATE`: every turn re-renders the whole conversation and reuses the longest
common token prefix (exact `llm.chat` equivalence; `Reply.diverged_at`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from kvsession.errors import ConfigError
from kvsession.model.tokenizer import Tokenizer
from kvsession.tools import json_copy

log = logging.getLogger("kvsession")

# placeholder contents of the probe conversation: plain text no template rewrites (no
# whitespace to trim, no reasoning markers) and no real conversation contains
REPLY_SENTINEL = "KVS0REPLY0SENTINEL"
USER_SENTINEL = "KVS0USER0SENTINEL"
# the markers reasoning templates (Qwen3, DeepSeek-R1) put around a reply's thinking
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class HistoryMode(enum.StrEnum):
    APPEND = "append"
    TEMPLATE = "template"

    @classmethod
    def parse(cls, value) -> HistoryMode:
        if isinstance(value, cls):
            return value
        for mode in cls:
            if value == mode.value:
                return mode
        raise ConfigError(f"history must be one of {[m.value for m in cls]}, got {value!r:.80}")


def check_template_kwargs(chat_template_kwargs) -> dict | None:
    """A validated copy of `chat_template_kwargs` (None or a dict of extra template
    variables holding JSON values: it is stored in snapshots and logs). Its keys become
    template variable names: identifiers, none starting with '_' (a dunder such as
    `__class__` names Python internals; no template reads a private name)."""
    if chat_template_kwargs is None:
        return None
    if not isinstance(chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in chat_template_kwargs):
        raise ConfigError(f"chat_template_kwargs must be None or a dict with str keys, "
                          f"got {chat_template_kwargs!r:.80}")
    for k in chat_template_kwargs:
        if not k.isidentifier() or k.startswith("_"):
            raise ConfigError(f"chat_template_kwargs keys must be template variable names "
                              f"(identifiers not starting with '_'), got {k!r:.80}")
    return json_copy(chat_template_kwargs, "chat_template_kwargs") or None


class NotAppendStable(Exception):
    """The template cannot render this message shape after a reply (internal: the turn
    falls back to re-rendering)."""


@dataclass(frozen=True)
class ChatRenderer:
    """Renders one session's conversation pieces: the system prefix, the first prompt, and
    the delta that appends messages after a reply. Everything goes through the template
    with the session's tools and chat_template_kwargs."""

    tokenizer: Tokenizer
    tools: list[dict] | None = None
    template_kwargs: dict | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt, self.tools,
                                          self.template_kwargs)

    def encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.render(messages, add_generation_prompt),
                                     add_special_tokens=False)

    def system_prefix(self, system: str) -> list[int]:
        """The tokens the template writes for the system message whatever follows it: the
        common prefix of two conversations that differ only after it (a template that
        moves the system prompt next to the last user message shares little)."""
        sys_msg = {"role": "system", "content": system}
        # user messages that differ in their first character: the common prefix ends
        # where a real first message's own tokens would start
        a = self.encode([sys_msg, {"role": "user", "content": "A"}], False)
        b = self.encode([sys_msg, {"role": "user", "content": "B"}], False)
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return a[:n]

    def delta(self, system_messages: list[dict], new: list[dict], last_token: int | None
              ) -> list[int]:
        """Tokens that append `new` (with the generation prompt) after an assistant reply
        whose last token is `last_token`. `system_messages`: the session's leading system
        message(s), kept in the probe because some templates render differently without
        one. Raises NotAppendStable."""
        probe = [*system_messages, {"role": "user", "content": USER_SENTINEL},
                 {"role": "assistant", "content": REPLY_SENTINEL}, *new]
        try:
            text = self.render(probe, True)
        except ConfigError as e:
            raise NotAppendStable(str(e)) from None
        at = text.find(REPLY_SENTINEL)
        if at < 0 or text.find(REPLY_SENTINEL, at + 1) >= 0:
            raise NotAppendStable("the template does not render a reply's content verbatim")
        text = text[at + len(REPLY_SENTINEL):]
        if last_token is not None and last_token in self.tokenizer.eos_token_ids:
            end = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if end and text.startswith(end):  # the reply's own end token closed it
                text = text[len(end):]
        return self.tokenizer.encode(text, add_special_tokens=False)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply from a template that marks thinking with
    <think>...</think>; (None, text) when the reply has no closed thinking block. The
    opening tag may be in the generation prompt (then the reply starts inside it)."""
    head, sep, answer = text.partition(THINK_CLOSE)
    if not sep:
        return None, text
    head = head.strip()
    if head.startswith(THINK_OPEN):
        head = head[len(THINK_OPEN):]
    return head.strip(), answer.lstrip("\n")


def template_marks_reasoning(template: str | None) -> bool:
    return bool(template) and THINK_CLOSE in template
