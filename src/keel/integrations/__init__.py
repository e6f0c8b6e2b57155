"""keel inside other frameworks, each module behind its own extra and never imported by keel's
core: ``keel.integrations.langgraph`` (``keel-runtime[langgraph]``), a checkpointer on keel's
state stores and a store on keel memory; ``keel.integrations.mcp_server``
(``keel-runtime[mcp]``), keel memory served as an MCP server to any MCP client (the servers
keel's agents connect to are [`MCPServer`][keel.tools.MCPServer]);
``keel.integrations.pydantic_ai``
(``keel-runtime[pydantic-ai]``), keel's context engine as a pydantic-ai history processor;
``keel.integrations.openai_agents`` (``keel-runtime[openai-agents]``), an Agents SDK session
within the model's window."""
