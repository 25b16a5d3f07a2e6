"""`tokenize`: the model's tokenizer and chat template, run in the control process."""

from __future__ import annotations

from typing import Any

from pie.control.errors import ErrorKind, HostError
from pie.runtime.bindings.common import PACKAGE, Bindings
from pie.runtime.host import HostState


def register(root: Any, b: Bindings) -> None:
    tok, q = b.controller.tokenizer, b.queue

    def detokenize(st: HostState, store: Any, x: Any, ids: list[int]) -> str:
        q(st, store, x)
        vocab = st.session.c.hs.vocab_size
        if ids and max(ids) >= vocab:  # C speed: a streaming inferlet passes its whole text each token
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"token id out of range [0, {vocab})")
        return tok.decode(ids)

    def chat(st: HostState, store: Any, x: Any, messages: list[Any], add_generation_prompt: bool) -> str:
        q(st, store, x)
        try:
            return tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt)
        except Exception as e:  # a template error is the caller's input, not a crash
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"chat template: {e}") from None

    with root.add_instance(PACKAGE.format("tokenize")) as tokenize:
        b.counted(tokenize)
        tokenize.add_func("tokenize", b.call(lambda st, store, x, text: (q(st, store, x), tok.encode(text))[1], False))
        tokenize.add_func("detokenize", b.call(detokenize))
        tokenize.add_func("get-vocabs", b.call(
            lambda st, store, x: (q(st, store, x), [list(v) for v in tok.vocabs])[1], False))
        tokenize.add_func("get-eos-tokens", b.call(lambda st, store, x: (q(st, store, x), tok.eos_token_ids)[1], False))
        tokenize.add_func("apply-chat-template", b.call(chat))
