"""A local HTTP tool server (calculator, search, slow, execute) for agent inferlets and
benchmarks. See docs/tools.md."""

from pie.tools.config import ToolConfig, ToolConfigError
from pie.tools.server import create_tool_app, serve_tools

__all__ = ["ToolConfig", "ToolConfigError", "create_tool_app", "serve_tools"]
