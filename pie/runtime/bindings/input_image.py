"""`input-image`: image embeddings — this model (text only) answers `unsupported`."""

from __future__ import annotations

from typing import Any

from pie.control.errors import ErrorKind, HostError
from pie.runtime.bindings.common import PACKAGE, Bindings
from pie.runtime.host import HostState


def register(root: Any, b: Bindings) -> None:
    def no_images(st: HostState, store: Any, q: Any, *args: Any) -> Any:
        b.queue(st, store, q)
        raise HostError(ErrorKind.UNSUPPORTED, f"{st.session.c.hs.model_name} takes no image input")

    with root.add_instance(PACKAGE.format("input-image")) as input_image:
        b.counted(input_image)
        input_image.add_func("num-embs-needed", b.call(no_images))
        input_image.add_func("embed-image", b.call(no_images))
