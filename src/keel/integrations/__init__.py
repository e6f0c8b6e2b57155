"""keel inside other frameworks, each module behind its own extra and never imported by keel's
core: ``keel.integrations.langgraph`` (``keel-runtime[langgraph]``), a checkpointer on keel's
state stores and a store on keel memory; ``keel.integrations.mcp`` (``keel-runtime[mcp]``), a
memory server for any MCP client; ``keel.integrations.pydantic_ai``
(``keel-runtime[pydantic-ai]``), keel's context engine as a pydantic-ai history processor;
``keel.integrations.openai_agents`` (``keel-runtime[openai-agents]``), an Agents SDK session
within the model's window."""
