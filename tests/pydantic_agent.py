"""The pydantic-ai coding agent the server's and the in-process client's tests both drive:
step 1 calls `list_files`, step 2 returns the structured answer through the output tool.
The random tiny model follows only what the grammar forces, so each step forces its tool
(the agent's own per-step tool_choice)."""

from __future__ import annotations


def coding_agent(model_name: str, provider) -> tuple:
    """(the agent on `model_name` through `provider`, an OpenAIProvider; the directories
    list_files was called with)."""
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, RunContext, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel

    class Report(BaseModel):
        count: int = Field(ge=0, le=9)

    def settings(ctx: RunContext):
        return {"temperature": 0.0, "max_tokens": 200,
                "tool_choice": ["list_files"] if ctx.run_step <= 1 else ["final_result"]}

    agent = Agent(OpenAIChatModel(model_name, provider=provider),
                  output_type=ToolOutput(Report, name="final_result"),
                  model_settings=settings, system_prompt="You are a coding agent.")
    listed = []

    @agent.tool_plain
    def list_files(directory: str) -> list[str]:
        """List the files in a directory."""
        listed.append(directory)
        return ["a.py", "b.py"]

    return agent, listed
