"""Models and their command queues."""

from __future__ import annotations

from wit_world.imports import allocate, output_text, runtime, scheduling, tokenize

from inferlet.errors import Error, host
from inferlet.futures import Future
from inferlet.sampling import Sampler


class Model:
    """A model the server serves, by name."""

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def default() -> Model:
        """The server's first model."""
        models = runtime.available_models()
        if not models:
            raise Error("not-found", "the server serves no model")
        return Model(models[0])

    @staticmethod
    def get(name: str) -> Model | None:
        """The model called `name`, if the server serves it."""
        return Model(name) if name in runtime.available_models() else None

    def traits(self) -> list[str]:
        """The traits (optional host features) the model supports."""
        return host(runtime.available_traits, self.name)

    def create_queue(self) -> Queue:
        """Calls on one queue run in order; calls on different queues batch together."""
        return Queue(host(runtime.create_queue, self.name), self.name)

    def create_context(self):
        """An empty context on a new queue of this model."""
        from inferlet.context import Context

        return Context(self.create_queue())


class Queue:
    """A command queue of one model, with the model's tokenizer at hand."""

    def __init__(self, raw, model: str):
        self.raw = raw
        self.model = Model(model)  # whose queue: another queue of it is `self.model.create_queue()`
        self.page_size = allocate.kv_page_size(raw)

    def tokenize(self, text: str) -> list[int]:
        """`text` as the model's tokens (no special tokens added)."""
        return tokenize.tokenize(self.raw, text)

    def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens`."""
        return host(tokenize.detokenize, self.raw, tokens)

    def eos_tokens(self) -> list[int]:
        """The tokens that end a turn or a document."""
        return tokenize.get_eos_tokens(self.raw)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        """`messages` rendered by the model's chat template."""
        return host(tokenize.apply_chat_template, self.raw, messages, add_generation_prompt)

    def sample(self, embed: int, sampler: Sampler) -> Future[int]:
        """A token drawn on the host from output embed `embed`."""
        return Future(host(output_text.sample, self.raw, embed, sampler.to_host()))

    def next_dist(self, embed: int, k: int) -> Future[tuple[list[int], list[float]]]:
        """The k most likely next tokens after `embed` and their probabilities."""
        return Future(host(output_text.get_next_dist, self.raw, embed, k),
                      lambda d: (list(d.token_ids), list(d.probs)))

    def synchronize(self) -> None:
        """Wait until everything enqueued so far has run; raise its first failure."""
        Future(runtime.synchronize(self.raw)).result()

    def set_priority(self, priority: int) -> None:
        """Rank this queue's calls against the instance's other queues (higher first)."""
        runtime.set_queue_priority(self.raw, priority)

    def set_objective(self, objective: str, group: str = "") -> None:
        """What the queue's calls are for: "latency" (goes first), "throughput" (every
        queue's default) or "background"; and its task group ("" for none). Raises
        `out-of-resources` past the `latency_queues` quota."""
        try:
            value = scheduling.Objective[objective.upper()]
        except KeyError:
            raise Error("invalid-argument", f"objective {objective!r} is not one of latency, "
                        f"throughput, background") from None
        host(scheduling.set_queue_objective, self.raw, value, group)

    def set_job_size(self, tokens: int) -> None:
        """How many new tokens the queue's current job still has to run (the `srjf`
        scheduler runs the least work first); 0 clears the hint."""
        host(scheduling.set_job_size, self.raw, tokens)
