"""The MCP server and the CLI: thin front doors that call tools, nothing else."""
