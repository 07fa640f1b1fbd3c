"""LlamaIndex's OpenAILike on an LLM in this process: its httpx client takes kvsession's
in-process transport, with no server and no port. A tool call (required here: the
built-in tiny model has random weights), the tool run, the conversation with its result
sent back.

LlamaIndex asks `parallel_tool_calls: false` by default; a kvsession Session cannot limit
a reply to one call, so such requests run stateless (their shared prefix still comes from
the prefix cache). `allow_parallel_tool_calls=True` lets the conversation continue on its
Session.

Run: python examples/inprocess_llamaindex.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' llama-index-llms-openai-like
"""

import sys
import tempfile

import httpx
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

from kvsession import LLM
from kvsession.openai_compat import transport
from kvsession.testing import make_tiny_model


def list_files(recursive: bool) -> str:
    """List the files of the project."""
    print(f"tool list_files(recursive={recursive})")
    return "a.py b.py"


def main(model_dir: str) -> None:
    tool = FunctionTool.from_defaults(fn=list_files)
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm, \
            httpx.Client(transport=transport(llm)) as http:
        model = OpenAILike(model="tiny", api_base="http://kvsession/v1", api_key="-",
                           is_chat_model=True, is_function_calling_model=True,
                           http_client=http, temperature=0.0, max_tokens=128)
        first = model.chat_with_tools([tool], user_msg="List the files.", tool_required=True,
                                      allow_parallel_tool_calls=True)
        (call,) = model.get_tool_calls_from_response(first)
        result = tool(**call.tool_kwargs)
        history = [ChatMessage(role="user", content="List the files."), first.message,
                   ChatMessage(role="tool", content=str(result),
                               additional_kwargs={"tool_call_id": call.tool_id})]
        reply = model.chat_with_tools([tool], chat_history=history, tool_choice="none",
                                      allow_parallel_tool_calls=True)
        usage = reply.raw.usage
        print(f"reply: {reply.message.content!r:.60}; prompt {usage.prompt_tokens} tokens, "
              f"{usage.prompt_tokens_details.cached_tokens} from the session's KV")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(str(make_tiny_model(d, chat_template="hermes")))
