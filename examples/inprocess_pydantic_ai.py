"""A pydantic-ai agent on an LLM in this process, through the in-process OpenAI client: a
two-step tool task (list the files, then answer in a typed result) with no server.

The second model request re-sends the first's conversation plus the tool's result; the
in-process app continues the conversation's Session, so its prompt comes from the KV cache
(printed: step 2's prompt tokens read from the cache).

Run: python examples/inprocess_pydantic_ai.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' 'pydantic-ai-slim[openai]'
"""

import asyncio
import sys
import tempfile

from pydantic import BaseModel, Field
from pydantic_ai import Agent, RunContext, ToolOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from kvsession import LLM
from kvsession.openai_compat import AsyncClient
from kvsession.testing import make_tiny_model


class Report(BaseModel):
    count: int = Field(ge=0, le=9)


def settings(ctx: RunContext) -> dict:
    # the tiny model has random weights: each step forces its tool (a real one chooses)
    return {"temperature": 0.0, "max_tokens": 200,
            "tool_choice": ["list_files"] if ctx.run_step <= 1 else ["final_result"]}


async def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm:
        async with AsyncClient(llm) as client:
            model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client.openai))
            agent = Agent(model, output_type=ToolOutput(Report, name="final_result"),
                          model_settings=settings, system_prompt="You are a coding agent.")

            @agent.tool_plain
            def list_files(directory: str) -> list[str]:
                """List the files in a directory."""
                print(f"tool list_files({directory!r})")
                return ["a.py", "b.py"]

            result = await agent.run("How many files are in the project?")
            print("output:", result.output)
            steps = [m for m in result.all_messages() if type(m).__name__ == "ModelResponse"]
            first, second = steps[0].usage, steps[1].usage
            print(f"step 2: {second.input_tokens} prompt tokens, {second.cache_read_tokens} "
                  f"of them from the session's KV (step 1's prompt: {first.input_tokens})")
            assert second.cache_read_tokens >= first.input_tokens


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            asyncio.run(main(str(make_tiny_model(d, chat_template="hermes"))))
