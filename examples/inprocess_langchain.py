"""LangChain's ChatOpenAI on an LLM in this process: its httpx client takes kvsession's
in-process transport, so `bind_tools`, `stream` and `invoke` reach kvsession's
OpenAI-compatible app with no server and no port. A two-step tool loop: the model calls the
tool (forced here: the built-in tiny model has random weights), the tool runs, and the
conversation with its result goes back, continuing the first request's session.

Run: python examples/inprocess_langchain.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' langchain-openai
"""

import sys
import tempfile

import httpx
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from kvsession import LLM
from kvsession.openai_compat import transport
from kvsession.testing import make_tiny_model


@tool
def read_file(path: str) -> str:
    """Read a file of the project."""
    print(f"tool read_file({path!r})")
    return f"contents of {path}"


def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm, \
            httpx.Client(transport=transport(llm)) as http:
        chat = ChatOpenAI(model="tiny", base_url="http://kvsession/v1", api_key="-",
                          http_client=http, temperature=0, max_tokens=64)
        messages = [HumanMessage("Read the readme.")]
        chunks = list(chat.bind_tools([read_file], tool_choice="read_file").stream(messages))
        call = sum(chunks[1:], chunks[0])  # the streamed pieces, assembled
        result = read_file.invoke(call.tool_calls[0])
        reply = chat.bind_tools([read_file], tool_choice="none").invoke(
            messages + [call, result])
        print("reply:", reply.content[:60])
        print("prompt tokens:", reply.usage_metadata["input_tokens"], "of which cached:",
              reply.usage_metadata["input_token_details"]["cache_read"])


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(str(make_tiny_model(d, chat_template="hermes")))
