"""The `anthropic` SDK on an LLM in this process: its httpx client takes kvsession's
in-process transport, so `messages.create` and `messages.stream` reach the Anthropic
Messages route of kvsession's app with no server and no port. (The SDK 2.x takes clients of
`httpx2`, httpx's API under another name: the transport is made for that package.)

Run: python examples/inprocess_anthropic.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' anthropic
"""

import sys
import tempfile

import anthropic

from kvsession import LLM
from kvsession.openai_compat import transport
from kvsession.testing import make_tiny_model

if int(anthropic.__version__.split(".")[0]) >= 2:
    import httpx2 as http_package
else:
    import httpx as http_package


def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm, \
            http_package.Client(transport=transport(llm, http=http_package)) as http:
        client = anthropic.Anthropic(base_url="http://kvsession", api_key="-",
                                     http_client=http)
        messages = [{"role": "user", "content": "Say something."}]
        reply = client.messages.create(model="tiny", max_tokens=16, messages=messages)
        print("reply:", reply.content[0].text, f"({reply.usage.output_tokens} tokens)")
        with client.messages.stream(model="tiny", max_tokens=16, messages=messages) as s:
            for piece in s.text_stream:
                print("streamed:", repr(piece))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(str(make_tiny_model(d, chat_template="hermes")))
