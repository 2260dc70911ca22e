"""The calculator task as a LangGraph agent: LangChain's `ChatOpenAI` with the calculator
bound as a tool (`bind_tools`), in a graph that loops model -> tools -> model until the
model answers without a call. Run it as a rollout workflow with

    rollout.workflow=areal_ray.rollout.workflows.agent.AgentWorkflow
    rollout.workflow_kwargs={agent: examples.langgraph_agent.langgraph_agent}
    rollout.openai.enabled=true

(`langgraph` and `langchain-openai` are pinned in requirements.txt). The
endpoint renders the tool with the model's chat template, parses the model's calls into
`tool_calls` by `rollout.openai.tool_parser` (hermes: `<tool_call>{json}</tool_call>`, as
Qwen writes them), and LangGraph's `ToolNode` sends each result back as a `role: tool`
message; the endpoint replays the assistant's call as the text the model generated, so
the session records one trajectory (the model's tokens in the loss, the tool results
out). Unlike examples/calculator_agent.py, which parses the embedded task's
`calc(...)` format itself, this needs a model that writes the parser's format (a Qwen
model, or artifacts/tiny-agents: conf/agents_sdk.yaml with this agent instead of the
Agents SDK's). The calculator is the task's `calc` function, as the Agents SDK agent's.

`ChatOpenAI` is built over the workflow's own `openai` client, so it sends the run's key
and never retries (a retried completion would be recorded twice and break the chain).
Nothing here knows about training: the same graph runs against any OpenAI-compatible
server.
"""

from __future__ import annotations

from areal_ray.task.tool_arith import calc

MODEL = "policy"  # the endpoint serves the run's model under any name
MAX_TOOL_CALLS = 4


def chat_model(client, use_responses_api: bool = False):
    """LangChain's ChatOpenAI over `client` (an `openai.AsyncOpenAI`): its base URL, key,
    HTTP connection pool and retry setting. `use_responses_api`: LangChain's switch to
    `POST /v1/responses`, which the endpoint records as the same session."""
    from langchain_openai import ChatOpenAI
    # No temperature / max_tokens: the endpoint uses the episode's (the session's defaults).
    return ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key=client.api_key,
                      max_retries=0, root_async_client=client, async_client=client.chat.completions,
                      use_responses_api=use_responses_api)


def build_graph(llm):
    """model -> (a tool call?) -> tools -> model ... -> END, over LangGraph's prebuilt
    ToolNode and tools_condition."""
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    tools = [tool(calc)]
    model = llm.bind_tools(tools)

    async def agent(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # to "tools", or END without a call
    graph.add_edge("tools", "agent")
    return graph.compile()


async def langgraph_agent(client, row: dict, use_responses_api: bool = False) -> str | None:
    """Answer `row["prompt"]`; the final message (holding `\\boxed{...}`) is what the
    reward checker grades. None (the row rejected) when the model keeps calling tools."""
    from langgraph.errors import GraphRecursionError
    graph = build_graph(chat_model(client, use_responses_api))
    try:
        state = await graph.ainvoke({"messages": [("user", str(row["prompt"]))]},
                                    {"recursion_limit": 2 * MAX_TOOL_CALLS + 2})
    except GraphRecursionError:
        return None
    return state["messages"][-1].text
