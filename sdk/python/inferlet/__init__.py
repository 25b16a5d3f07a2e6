"""Pie's Python SDK: write an inferlet as a module with `def main(args: list[str]) -> None`.

```python
import inferlet

def main(args: list[str]) -> None:
    model = inferlet.Model.default()
    ctx = model.create_context()
    ctx.fill_chat([inferlet.chat("user", "Hi!")])
    stop = inferlet.Stop(32, eos=ctx.queue.eos_tokens())
    inferlet.send(ctx.generate(inferlet.Sampler.greedy(), stop))
```

Build it with `pie build my_inferlet.py` (componentize-py; the component embeds CPython).
Same concepts as the Rust SDK (sdk/rust/inferlet), over the same WIT (sdk/wit): `Model` and
`Queue`, `Context` (fill / flush / generate / fork), samplers and stop conditions, futures
with `wait_any` / `wait_all`, messaging, HTTP, KV export/import, and semantic variables
(`inferlet.semvar`: an application's calls as prompt templates run inside the inferlet), and
workflows (`inferlet.workflow`: a graph of operators checked and optimized before it runs). Host calls that fail raise
`inferlet.Error`; an exception escaping `main` ends the instance with its message and the
line it came from, its traceback going to the log; `print()` writes to the log too.
"""

import os
import sys

from componentize_py_types import Err
from wit_world.imports import runtime

from inferlet.beam import beam_search
from inferlet.branch import Branch, generate_branches
from inferlet.context import Context
from inferlet.errors import Error, describe, traceback_lines
from inferlet.futures import Future, wait_all, wait_any
from inferlet.grammar import Grammar
from inferlet.io import (Response, Subscription, args, broadcast, chat, http_get, http_post, log,
                         receive, send, store_delete, store_get, store_set, subscribe)
from inferlet.model import Model, Queue
from inferlet.sampling import Echo, Sampler, Stop
from inferlet.select import Selection
from inferlet.snapshot_finder import SnapshotFinder
from inferlet.stdio import LogStream
from inferlet.text_stream import TextStream

__all__ = ["Branch", "Context", "Echo", "Error", "Future", "Grammar", "Model", "Queue", "Response", "Sampler",
           "Selection", "Stop", "Subscription", "TextStream", "args", "beam_search", "broadcast", "chat",
           "generate_branches", "http_get", "http_post", "log", "receive", "run_main",
           "send", "store_delete", "store_get", "store_set", "subscribe", "wait_all",
           "wait_any"]


def run_main(main) -> None:
    """Run an inferlet's `main(args)`; what escapes it becomes the instance's failure reason.
    Called by the entry module that `pie build` generates.

    Before `main`: `sys.stdout` / `sys.stderr` log their lines (`inferlet.stdio`), `sys.argv`
    is the module's file name and the launch arguments (so `argparse` works unchanged), and
    COLUMNS / LINES are set (so nothing asks the absent terminal for its size), and an import
    of a module the build did not load fails with an ImportError that says so
    (`inferlet.snapshot_finder`) instead of trapping. `sys.exit(0)`
    finishes normally; another exit status fails with what was last written to stderr (an
    argparse error); an exception fails with `Type: message (at FILE:LINE in FUNCTION)` —
    the innermost frame in the inferlet's own folder — and its traceback in the log."""
    out, err = LogStream(runtime.LogLevel.INFO), LogStream(runtime.LogLevel.WARN)
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = err
    sys.argv = [f"{main.__module__}.py", *args()]
    os.environ.setdefault("COLUMNS", "100")
    os.environ.setdefault("LINES", "40")
    sys.meta_path.insert(0, SnapshotFinder)
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        err.flush()
        if e.code not in (None, 0):
            said = e.code if isinstance(e.code, str) else err.last
            raise Err(f"exit status {e.code if isinstance(e.code, int) else 1}"
                      + (f": {said}" if said else "")) from None
    except Exception as e:
        for line in traceback_lines(e):
            runtime.log(runtime.LogLevel.ERROR, line)
        raise Err(describe(e, main.__code__.co_filename.rpartition("/")[0] + "/")) from None
    finally:
        out.flush()
        err.flush()
