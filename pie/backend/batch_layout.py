"""How the items of one forward batch are admitted (`BatchLayout`): the token budget and the
scratch slots of items that keep no KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pie.backend.checks import ItemError

if TYPE_CHECKING:
    from pie.backend.engine import Engine, ForwardItem


class BatchLayout:
    """Items of one batch as they are admitted: the token budget left (max_batch_tokens)
    and the scratch slots that items without output pages write to."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens = 0
        self.scratch = engine.kv.scratch_start
        self.scratch_end = engine.kv.scratch_start + engine.scratch_tokens

    def add(self, pages: np.ndarray, last_len: int, n_new: int, out_pages: np.ndarray,
            out_offset: int, mask: bytes | None) -> ForwardItem:
        limit = self.engine.config.max_batch_tokens
        if self.tokens + n_new > limit:
            raise ItemError(f"batch exceeds max_batch_tokens={limit} "
                            f"({n_new} new tokens, {limit - self.tokens} left)")
        chunked, no_kv = self.engine.chunked, not len(out_pages)
        # Chunking off, the scratch holds max_batch_tokens: an item always finds room.
        alone = chunked is not None and (chunked.applies(n_new) or
                                         (no_kv and self.scratch + n_new > self.scratch_end))
        item = self.engine.forward_item(pages, last_len, n_new, out_pages, out_offset, mask,
                                        None if alone else self.scratch)
        if no_kv and not alone:
            self.scratch += n_new
        self.tokens += n_new
        return item
