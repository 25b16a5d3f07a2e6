"""`hello` in Python, the twin of inferlets/hello: sends its arguments back as one message,
then echoes every message until an empty one or "quit". Used to measure the launch latency
of Python inferlets (benchmarks/frontends.py)."""

import inferlet


def main(args: list[str]) -> None:
    inferlet.send(" ".join(args))
    while (message := inferlet.receive().result()) not in ("", "quit"):
        inferlet.send(message)
