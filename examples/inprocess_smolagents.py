"""A smolagents ToolCallingAgent on an LLM in this process: OpenAIServerModel's OpenAI
client takes kvsession's in-process transport (`client_kwargs`), with no server and no
port. The built-in tiny model has random weights, so each step's call is forced to the
tool; a real model chooses (final_answer included). smolagents' system prompt is long
(~2,500 tokens of the tiny tokenizer): the second step reads it from the prefix cache.

Run: python examples/inprocess_smolagents.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' 'smolagents[openai]'
"""

import sys
import tempfile

import httpx
from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

from kvsession import LLM
from kvsession.openai_compat import transport
from kvsession.testing import make_tiny_model


class ListFiles(Tool):
    name = "list_files"
    description = "List the files of the project."
    inputs = {"recursive": {"type": "boolean", "description": "into subdirectories"}}
    output_type = "string"

    def forward(self, recursive: bool) -> str:
        print(f"tool list_files(recursive={recursive})")
        return "a.py b.py"


def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="128MiB", max_model_len=8192) as llm, \
            httpx.Client(transport=transport(llm)) as http:
        model = OpenAIServerModel(
            "tiny", api_base="http://kvsession/v1", api_key="-",
            client_kwargs={"http_client": http}, temperature=0.0, max_tokens=256,
            tool_choice={"type": "function", "function": {"name": "list_files"}})
        agent = ToolCallingAgent(tools=[ListFiles()], model=model, max_steps=2,
                                 verbosity_level=0)
        agent.run("How many files are there?")
        st = llm.stats()
        print(f"prompt tokens computed {st.prefill_tokens}; prefix cache hit rate "
              f"{st.prefix.hit_rate:.0%}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(str(make_tiny_model(d, chat_template="hermes",
                                     max_position_embeddings=8192)))
