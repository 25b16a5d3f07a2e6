"""A token sequence and the KV pages that hold it (the Rust SDK's Context, in Python).

The committed tokens' K/V fill the pages in order, every page full but the last
(`last_len` slots); `pending` tokens are filled but not yet run. Full pages are shared by
forks; a page that may be shared (forked or imported) is copied before it is written.
"""

from __future__ import annotations

import re

from wit_world.imports import allocate, forward, input_text, kvs

from inferlet.errors import Error, host
from inferlet.model import Queue
from inferlet.sampling import Sampler, Stop


class Page:
    """A KV page, freed when no context holds it any more."""

    def __init__(self, queue: Queue, page_id: int, shared: bool = False):
        self.queue, self.id, self.shared = queue, page_id, shared

    def __del__(self):
        try:
            allocate.dealloc_kvpage(self.queue.raw, [self.id])
        except Exception:  # the instance is ending: the host reclaims everything anyway
            pass


class Context:
    def __init__(self, queue: Queue):
        self.queue = queue
        self.pages: list[Page] = []
        self.last_len = 0
        self.committed: list[int] = []
        self.pending: list[int] = []
        self._embeds: list[int] = []
        self._outputs: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self.committed + self.pending

    def __len__(self) -> int:
        return len(self.committed) + len(self.pending)

    # --- input -----------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        self.pending += self.queue.tokenize(text)

    def fill_tokens(self, tokens: list[int]) -> None:
        self.pending += tokens

    def fill_chat(self, messages: list, add_generation_prompt: bool = True) -> None:
        self.fill(self.queue.apply_chat_template(messages, add_generation_prompt))

    # --- running the model -----------------------------------------------------------------

    def flush(self) -> None:
        """Run every pending token but the last (which the next decode step needs)."""
        if len(self.pending) > 1:
            tokens, self.pending = self.pending[:-1], self.pending[-1:]
            self._forward(tokens, [])

    def forward_pending(self, indices: list[int]) -> list[int]:
        """Run all pending tokens; output embeds at `indices` (valid until the next forward)."""
        tokens, self.pending = self.pending, []
        return self._forward(tokens, indices)

    def decode_step(self, sampler: Sampler) -> int:
        """Run the pending tokens, draw the next token, leave it pending."""
        token = self.queue.sample(self._step_output(), sampler).result()
        self.pending.append(token)
        return token

    def next_dist(self, k: int) -> tuple[list[int], list[float]]:
        """Run the pending tokens; the k most likely next tokens (nothing is appended)."""
        return self.queue.next_dist(self._step_output(), k).result()

    def generate(self, sampler: Sampler, stop: Stop) -> str:
        """Decode until `stop`; the text without the EOS token or the stop string."""
        generated: list[int] = []
        seed = sampler.seed
        while len(generated) < stop.max_tokens:
            token = self.decode_step(sampler.with_seed(seed))
            seed = None if seed is None else seed + 1
            if token in stop.eos:
                break
            generated.append(token)
            if stop.strings:
                cut = stop.cut(self.queue.detokenize(generated))
                if cut is not None:
                    return cut
        return self.queue.detokenize(generated)

    # --- branching and reuse ---------------------------------------------------------------

    def fork(self) -> Context:
        """A copy that can diverge: pages are shared, and copied before either side writes."""
        for page in self.pages:
            page.shared = True
        other = Context(self.queue)
        other.pages, other.last_len = list(self.pages), self.last_len
        other.committed, other.pending = list(self.committed), list(self.pending)
        return other

    def truncate(self, length: int) -> None:
        """Forget every token from position `length` on."""
        if length >= len(self):
            return
        if length >= len(self.committed):
            self.pending = self.pending[: length - len(self.committed)]
            return
        self.pending, self.committed = [], self.committed[:length]
        ps = self.queue.page_size
        self.pages = self.pages[: (length + ps - 1) // ps]
        self.last_len = length - (len(self.pages) - 1) * ps if self.pages else 0

    def export(self, name: str, persistent: bool = False) -> None:
        """Publish the committed tokens' pages (and the tokens) under `name`, in the same
        record as the Rust SDK's `Context::export`, so either SDK can import it."""
        if not self.pages:
            raise Error("invalid-argument", "nothing to export: no committed tokens (flush first)")
        self.queue.synchronize()
        host(allocate.export_kvpage, [p.id for p in self.pages], name, persistent)
        for page in self.pages:
            page.shared = True  # read-only from now on: appending copies the last page
        ps = self.queue.page_size
        starts = ",".join(str(i * ps) for i in range(len(self.pages)))
        record = f"{self.last_len}|{starts}|{','.join(map(str, self.committed))}"
        host(kvs.store_set, _export_key(name), record)

    @staticmethod
    def imported(queue: Queue, name: str) -> Context | None:
        """A context over an export's pages and tokens, or None if there is no such export."""
        record = kvs.store_get(_export_key(name))
        if record is None:
            return None
        try:
            ids = host(allocate.import_kvpage, name)
        except Error as e:
            if e.kind == "not-found":
                return None
            raise
        last_len, starts, tokens = record.split("|", 2)  # the Rust SDK's format too
        ps = queue.page_size
        if [int(s) for s in starts.split(",") if s] != [i * ps for i in range(len(ids))]:
            raise Error("unsupported", f"export {name!r} has dropped pages (attention sink or "
                                       "window), which the Python SDK cannot hold")
        ctx = Context(queue)
        ctx.committed = [int(t) for t in tokens.split(",") if t]
        ctx.pages = [Page(queue, i, shared=True) for i in ids]
        ctx.last_len = int(last_len)
        return ctx

    @staticmethod
    def unexport(name: str) -> None:
        """Remove an export made by `export` (pages already imported stay valid)."""
        kvs.store_delete(_export_key(name))
        host(allocate.unexport_kvpage, name)

    # --- internals -------------------------------------------------------------------------

    def _step_output(self) -> int:
        if not self.pending:
            raise Error("invalid-argument", "no pending token to predict from; fill the context first")
        return self.forward_pending([len(self.pending) - 1])[0]

    def _forward(self, tokens: list[int], indices: list[int]) -> list[int]:
        """Run `tokens`, in chunks of at most the backend's max_batch_tokens (one pass when
        they fit); output embeds at `indices` (positions in `tokens`)."""
        global _chunk_limit
        if not tokens:
            return []
        q = self.queue
        if len(self._outputs) < len(indices):
            self._outputs += host(allocate.alloc_emb, q.raw, len(indices) - len(self._outputs))
        outputs = self._outputs[: len(indices)]
        start = 0
        while start < len(tokens):
            end = min(len(tokens), start + max(1, _chunk_limit))
            chunk = [(i - start, out) for i, out in zip(indices, outputs) if start <= i < end]
            try:
                self._forward_chunk(tokens[start:end], [i for i, _ in chunk], [out for _, out in chunk])
            except Error as e:
                # The host refused the chunk before running anything: learn its limit, retry.
                size = end - start
                if size == 1 or e.kind != "invalid-argument" or _LIMIT_NAME not in e.message:
                    raise
                told = re.search(_LIMIT_NAME + r"\D*(\d+)", e.message)
                _chunk_limit = min(size - 1, max(1, int(told.group(1)) if told else size // 2))
                continue
            start = end
        return outputs

    def _forward_chunk(self, tokens: list[int], indices: list[int], outputs: list[int]) -> None:
        """One forward pass; fails before changing anything if the host refuses the embedding."""
        q, n, ps = self.queue, len(tokens), self.queue.page_size
        if len(self._embeds) < n:
            self._embeds += host(allocate.alloc_emb, q.raw, n - len(self._embeds))
        start = len(self.committed)
        host(input_text.embed_text, q.raw, tokens, list(range(start, start + n)), self._embeds[:n])
        free = ps - self.last_len if self.pages else 0
        if free and self.pages[-1].shared:
            self._copy_last_page()
        new = [Page(q, i) for i in host(allocate.alloc_kvpage, q.raw, -(-max(0, n - free) // ps))]
        out_pages = ([self.pages[-1].id] if free else []) + [p.id for p in new]
        host(forward.forward, q.raw, forward.ForwardPass(
            input_kv_pages=[p.id for p in self.pages], input_kv_last_page_len=self.last_len,
            input_embeds=self._embeds[:n], output_kv_pages=out_pages,
            output_kv_offset=self.last_len if free else 0, output_embeds=outputs,
            output_token_indices=list(indices), attention_mask=None))
        self.pages += new
        self.committed += tokens
        self.last_len = len(self.committed) - (len(self.pages) - 1) * ps
        if len(self._embeds) > KEPT_EMBEDS:  # a prefill's embeds: not needed for decoding
            host(allocate.dealloc_emb, q.raw, self._embeds[KEPT_EMBEDS:])
            del self._embeds[KEPT_EMBEDS:]

    def _copy_last_page(self) -> None:
        (copy,) = host(allocate.alloc_kvpage, self.queue.raw, 1)
        host(allocate.copy_kvpage, self.queue.raw, self.pages[-1].id, copy, 0, 0, self.last_len)
        self.pages[-1] = Page(self.queue, copy)

    def __del__(self):
        embeds = self._embeds + self._outputs
        if embeds:
            try:
                allocate.dealloc_emb(self.queue.raw, embeds)
            except Exception:
                pass


KEPT_EMBEDS = 16  # input embeds a context keeps between forwards

# The most tokens a Context runs in one forward pass. The host API does not tell the
# backend's max_batch_tokens, so this starts at its default (4096: a prompt that fits runs in
# one pass, exactly as unchunked) and drops to the host's limit the first time the host
# refuses a pass as too long (its error names the limit). One per instance.
_chunk_limit = 4096
_LIMIT_NAME = "max_batch_tokens"


def _export_key(name: str) -> str:
    return f"pie.context-export.{name}"
