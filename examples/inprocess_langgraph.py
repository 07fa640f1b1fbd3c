"""A LangGraph thread as a kvsession session, in this process: the graph's checkpointer
keeps the thread's messages, and its model node names the thread's session
(`extra_body={"session_id": thread_id}`), so each invocation on the thread continues the
same Session: its history is read from the KV, not computed again.

Run: python examples/inprocess_langgraph.py [MODEL_DIR]
Needs: pip install 'kvsession[inprocess]' langgraph langchain-openai
"""

import sys
import tempfile

import httpx
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from kvsession import LLM
from kvsession.openai_compat import transport
from kvsession.testing import make_tiny_model


def main(model_dir: str) -> None:
    with LLM(model_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm, \
            httpx.Client(transport=transport(llm)) as http:
        chat = ChatOpenAI(model="tiny", base_url="http://kvsession/v1", api_key="-",
                          http_client=http, temperature=0, max_tokens=12)

        def model_node(state: MessagesState, config) -> dict:
            thread = config["configurable"]["thread_id"]  # the thread's session
            reply = chat.bind(extra_body={"session_id": thread}).invoke(state["messages"])
            return {"messages": [reply]}

        graph = StateGraph(MessagesState).add_node("model", model_node) \
            .add_edge(START, "model").compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "thread-1"}}
        for text in ("List the files.", "Now read one.", "And run the tests."):
            state = graph.invoke({"messages": [HumanMessage(text)]}, config)
            usage = state["messages"][-1].usage_metadata
            print(f"{text!r}: prompt {usage['input_tokens']} tokens, "
                  f"{usage['input_token_details']['cache_read']} from the thread's session")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(str(make_tiny_model(d, chat_template="hermes")))
