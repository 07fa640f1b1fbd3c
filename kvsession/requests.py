"""Turning `LLM` call arguments into validated requests: prompts or token ids, chat
conversations, the sampling parameters of a batch. Everything here raises ConfigError
naming the argument before anything is submitted."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError
from kvsession.generation_defaults import Budget
from kvsession.history import check_template_kwargs, split_reasoning, template_marks_reasoning
from kvsession.model.tokenizer import IncrementalText, check_messages
from kvsession.outputs import RequestOutput
from kvsession.params import SAMPLING_ARG_NAMES, SamplingParams
from kvsession.reply_stream import ReplySplitter, prompt_opens_reasoning
from kvsession.runtime import Runtime
from kvsession.tools import ToolSpec
from kvsession.validation import check_bool

GENERATE_ARGS = ("prompts", "sampling_params", "prompt_token_ids", "use_tqdm", "priority")
TOOL_ARGS = ("tools", "tool_choice", "chat_template_kwargs", "parallel_tool_calls")
CHAT_ARGS = ("messages", "sampling_params", "use_tqdm", "add_generation_prompt", "priority",
             *TOOL_ARGS)
SESSION_ARGS = ("system", "session_id", "pin_system", "sampling", "history", "tools",
                "chat_template_kwargs", "cache_salt", "fresh", "priority")
AGENERATE_ARGS = ("prompts", "sampling_params", "prompt_token_ids", "priority")
ACHAT_ARGS = ("messages", "sampling_params", "add_generation_prompt", "priority", *TOOL_ARGS)
STREAM_ARGS = ("prompt", "sampling_params", "prompt_token_ids", "messages", "priority",
               *TOOL_ARGS)
# sampling settings passed to generate()/chat() directly belong in a SamplingParams
TO_SAMPLING_PARAMS = {name: "sampling_params" for name in SAMPLING_ARG_NAMES}


def token_id_lists(prompt_token_ids) -> list[list[int]]:
    """One prompt (a list of ids) or a batch (a list of such lists); the ids themselves
    are checked by SequenceFactory.validate_prompt."""
    ids = prompt_token_ids
    if not isinstance(ids, (list, tuple)):
        raise ConfigError(f"prompt_token_ids must be a list of token ids or a list of such "
                          f"lists, got {ids!r:.80}")
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]
    for i, p in enumerate(ids):
        if not isinstance(p, (list, tuple)):
            raise ConfigError(f"prompt_token_ids[{i}] must be a list of token ids, "
                              f"got {p!r:.80}")
    return [list(p) for p in ids]


@dataclass
class ChatInputs:
    """Rendered conversations and their tools (None without tools); `reasoning`: the
    template marks thinking (<think>...</think>). None for a prompt's (not a chat)."""

    texts: list[str]
    ids: list[list[int]]
    tools: ToolSpec | None = None
    reasoning: bool = False
    tokenizer: object = field(default=None, repr=False)

    def params(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """The requests' parameters with a forced tool call's grammar (tool_choice)."""
        return params if self.tools is None else [self.tools.constrain(p) for p in params]

    def finish(self, output: RequestOutput) -> RequestOutput:
        """The output as a reply: a reasoning template's thinking split off
        (history.split_reasoning), then the tool calls parsed out of the answer (when
        tools were given), as a Session's turn does."""
        if not self.reasoning:
            return output if self.tools is None else self.tools.apply(output)
        outs = []
        for c in output.outputs:
            reasoning, text = split_reasoning(c.text)
            calls = []
            if self.tools is not None:
                text, calls = self.tools.parse(text) if reasoning is not None else \
                    self.tools.parse_output(c.token_ids, text)
            outs.append(replace(c, text=text, tool_calls=calls, reasoning=reasoning))
        return replace(output, outputs=outs)

    def splitter(self, prompt_ids: list[int]) -> ReplySplitter | None:
        """What splits the reply to `prompt_ids` as it streams (reply_stream.py); None for
        a prompt's inputs (not a chat: its text is all content)."""
        if self.tokenizer is None:
            return None
        return ReplySplitter(self.reasoning, self.tools,
                             self.reasoning and prompt_opens_reasoning(self.tokenizer,
                                                                       prompt_ids))

    def splitter_text(self) -> IncrementalText | None:
        """The text the splitter reads, where it is not the stream's own: Mistral's special
        markers put back (ToolSpec.marked_text), else None."""
        return self.tools.marked_text() if self.tools is not None and self.tools.markers \
            else None


class RequestBuilder:
    """Validated inputs for one `LLM`'s generate / chat / stream calls."""

    def __init__(self, runtime: Runtime):
        self._rt = runtime
        self.tokenizer = runtime.tokenizer
        self.defaults = runtime.generation

    def params_list(self, sampling_params, n: int,
                    budget: Budget = Budget.END_OF_TURN) -> list[SamplingParams]:
        """One SamplingParams per request, their unset fields filled with the model's
        defaults (generation_defaults.py); `budget`: generate()'s FIXED 16 tokens or, for
        the conversational calls, up to the end of the turn."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [self.defaults.apply(sampling_params, budget)] * n
        if not isinstance(sampling_params, (list, tuple)) or len(sampling_params) != n or \
                not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ConfigError(f"sampling_params must be None, one SamplingParams or a list of "
                              f"{n}, got {sampling_params!r:.80}")
        return [self.defaults.apply(p, budget) for p in sampling_params]

    def prompt_inputs(self, prompts, prompt_token_ids) -> tuple[list, list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ConfigError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else prompts
            if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
                raise ConfigError(f"prompts must be a string or a list of strings, "
                                  f"got {prompts!r:.80}")
            return list(texts), [self.tokenizer.encode(t) for t in texts]
        ids = token_id_lists(prompt_token_ids)
        return [None] * len(ids), ids

    def chat_inputs(self, messages, add_generation_prompt, tools=None, tool_choice="auto",
                    chat_template_kwargs=None, parallel_tool_calls=True) -> ChatInputs:
        check_bool("add_generation_prompt", add_generation_prompt)
        spec = ToolSpec.from_args(tools, tool_choice, self.tokenizer, parallel_tool_calls)
        kwargs = check_template_kwargs(chat_template_kwargs)
        if not isinstance(messages, (list, tuple)):
            raise ConfigError(f"messages must be a list of message dicts (one conversation) "
                              f"or a list of such lists, got {messages!r:.80}")
        if messages and isinstance(messages[0], dict):
            convs = [check_messages(messages, "messages")]
        else:
            convs = [check_messages(c, f"messages[{i}]") for i, c in enumerate(messages)]
        tools = None if spec is None else spec.template_tools
        texts = [self.tokenizer.render_chat(c, add_generation_prompt, tools, kwargs)
                 for c in convs]
        return ChatInputs(texts, [self.tokenizer.encode(t, add_special_tokens=False)
                                  for t in texts], spec,
                          template_marks_reasoning(self.tokenizer.chat_template),
                          self.tokenizer)

    def one_request(self, prompt, sampling_params, prompt_token_ids, messages, tools=None,
                    tool_choice="auto", chat_template_kwargs=None,
                    parallel_tool_calls=True) -> tuple[str | None, Sequence, ChatInputs]:
        if messages is None and isinstance(prompt, list) and prompt and \
                all(isinstance(m, dict) for m in prompt):
            prompt, messages = None, prompt  # a conversation in the prompt's place
        if messages is not None:
            if prompt is not None or prompt_token_ids is not None:
                raise ConfigError("pass exactly one of prompt, prompt_token_ids or messages")
            if messages and not isinstance(messages[0], dict):
                raise ConfigError("stream() takes one conversation: messages must be a list "
                                  "of message dicts")
            chat = self.chat_inputs(messages, True, tools, tool_choice, chat_template_kwargs,
                                    parallel_tool_calls)
            texts, ids = chat.texts, chat.ids
        else:
            choice = None if tool_choice == "auto" else tool_choice
            given = [n for n, v in (("tools", tools), ("tool_choice", choice),
                                    ("chat_template_kwargs", chat_template_kwargs),
                                    ("parallel_tool_calls",
                                     None if parallel_tool_calls is True else parallel_tool_calls))
                     if v is not None]
            if given:
                raise ConfigError(f"{given[0]} needs a conversation: pass messages=")
            if prompt is not None and not isinstance(prompt, str):
                raise ConfigError(f"prompt must be a string (one prompt), got {prompt!r:.80}")
            texts, ids = self.prompt_inputs(prompt, prompt_token_ids)
            if len(ids) != 1:
                raise ConfigError(f"stream() takes one prompt, got {len(ids)}")
            chat = ChatInputs(texts, ids)
        (params,) = chat.params(self.params_list(sampling_params, 1))
        if params.n != 1:
            raise ConfigError(f"n must be 1 to stream (one text), got {params.n}")
        seq = self._rt.sequences.new(ids[0], params)
        self._rt.check_open()
        return texts[0], seq, chat
