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
`inferlet.Error`; an exception escaping `main` ends the instance with its message.
"""

from inferlet.context import Context
from inferlet.errors import Error
from inferlet.futures import Future, wait_all, wait_any
from inferlet.io import (Response, Subscription, args, broadcast, chat, http_get, http_post, log,
                         receive, send, store_delete, store_get, store_set, subscribe)
from inferlet.model import Model, Queue
from inferlet.sampling import Sampler, Stop

__all__ = ["Context", "Error", "Future", "Model", "Queue", "Response", "Sampler", "Stop",
           "Subscription", "args", "broadcast", "chat", "http_get", "http_post", "log", "receive",
           "run_main", "send", "store_delete", "store_get", "store_set", "subscribe", "wait_all",
           "wait_any"]


def run_main(main) -> None:
    """Run an inferlet's `main(args)`; what escapes it becomes the instance's failure reason.
    Called by the entry module that `pie build` generates."""
    from componentize_py_types import Err

    try:
        main(args())
    except Error as e:
        raise Err(str(e)) from None
    except Exception as e:
        raise Err(f"{type(e).__name__}: {e}") from None
