"""`python -m pie.tools [--host H] [--port P]`: serve the tools and print their URL."""

from __future__ import annotations

import argparse
import sys

from pie.tools import ToolConfig, ToolConfigError, serve_tools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pie.tools", description=__doc__)
    parser.add_argument("--host", default=ToolConfig.host, help="a loopback address")
    parser.add_argument("--port", type=int, default=ToolConfig.port, help="0 = any free port")
    args = parser.parse_args(argv)
    try:
        config = ToolConfig(host=args.host, port=args.port)
    except ToolConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve_tools(config, on_ready=lambda url: print(f"Pie tools serving on {url}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
