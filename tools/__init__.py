"""gpurig's tools: plain typed functions returning pydantic models.

The MCP server, the CLI and the tests all call these same functions; nothing here knows about
MCP or argparse.
"""
