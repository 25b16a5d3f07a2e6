"""`input-text`: token embeddings into embed slots."""

from __future__ import annotations

from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("input-text")) as input_text:
        b.counted(input_text)
        input_text.add_func("embed-text", b.call(
            lambda st, store, q, tokens, positions, embeds:
            st.session.embed_text(b.queue(st, store, q), tokens, positions, embeds)))
