"""The OpenAI Agents SDK on an LLM in this process: no server, no port.

`kvsession.openai_compat.AsyncClient(llm).openai` is an `openai.AsyncOpenAI` whose requests
go straight to kvsession's OpenAI-compatible app inside this process; the agent's model
takes it as its client. The agent calls its tool (forced here: the built-in tiny model has
random weights), the tool runs, and its result ends the run.

Run: python examples/inprocess_openai_agents.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' openai-agents
"""

import asyncio
import sys
import tempfile

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from kvsession import LLM
from kvsession.openai_compat import AsyncClient
from kvsession.testing import make_tiny_model

set_tracing_disabled(True)  # the SDK exports traces to OpenAI by default: nothing leaves here


@function_tool
def read_file(path: str) -> str:
    """Read a file of the project."""
    print(f"tool read_file({path!r})")
    return f"contents of {path}"


async def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm:
        async with AsyncClient(llm) as client:
            agent = Agent(name="reader", instructions="You read files.", tools=[read_file],
                          model=OpenAIChatCompletionsModel(model="tiny",
                                                           openai_client=client.openai),
                          model_settings=ModelSettings(tool_choice="read_file",
                                                       temperature=0.0, max_tokens=64),
                          tool_use_behavior="stop_on_first_tool")
            result = await Runner.run(agent, "Read the readme.")
            print("final output:", result.final_output)
            assert result.final_output.startswith("contents of ")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            asyncio.run(main(str(make_tiny_model(d, chat_template="hermes"))))
