"""Unit tests of the Rust SDK (sdk/rust/inferlet) against a fake host: generated bindings,
the toolchain, and the canonical-ABI glue.

The inferlets are built with `pie.toolchain.build_inferlet` (which installs Debian's Rust
toolchain when missing, as root) into components, then run under wasmtime-py against small
fake hosts written here in Python — no Pie runtime, server or backend, and, for
text_completion, a toy model (characters as tokens, a scripted answer) — so every lowering
and lifting the guest does is checked against wasmtime's own implementation of the
Canonical ABI, and the SDK's paging against a host that checks every page it is given.

End-to-end runs of the same inferlets (real `pie serve`, runtime, backend and weights) are
in test_e2e.py and the test_inferlets_*.py modules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from wasmtime import Engine, Store
from wasmtime.component import Component, Linker, Record, ResourceAny, ResourceHost, ResourceType

from pie.toolchain import ToolchainError, build_inferlet, wasm_tools

REPO = Path(__file__).resolve().parent.parent
INFERLETS = REPO / "inferlets"


@pytest.fixture(scope="module")
def components() -> dict[str, Path]:
    """Both inferlets built as components (the cargo target dir is reused across runs)."""
    try:
        return {name: build_inferlet(INFERLETS / name) for name in ("hello", "text_completion")}
    except ToolchainError as e:
        if "sudo" in str(e):  # not root: build_inferlet may not install the toolchain
            pytest.skip(f"no wasm32 Rust toolchain and not root to install it: {e}")
        raise


def test_bindings_are_generated_from_the_current_wit():
    done = subprocess.run([sys.executable, str(REPO / "sdk/rust/gen_bindings.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_inferlets_build_into_valid_components(components):
    expected = {
        "hello": ["import pie:inferlet/messaging@0.1.0;", "import pie:inferlet/runtime@0.1.0;"],
        "text_completion": ["import pie:inferlet/inference@0.1.0;",
                            "import pie:inferlet/tokenize@0.1.0;", "import pie:inferlet/allocate@0.1.0;"],
    }
    # Plain decoding is fused passes: no embed-text / forward / sample triple.
    absent = {"text_completion": ["pie:inferlet/forward@", "pie:inferlet/input-text@",
                                  "pie:inferlet/output-text@"]}
    for name, path in components.items():
        subprocess.run([wasm_tools(), "validate", str(path)], check=True)
        wit = subprocess.run([wasm_tools(), "component", "wit", str(path)],
                             capture_output=True, text=True, check=True).stdout
        assert "export run: func() -> result<_, string>;" in wit
        for line in expected[name]:
            assert line in wit, f"{name}: {line!r} missing from\n{wit}"
        for interface in absent.get(name, []):
            assert interface not in wit, f"{name} imports {interface}"


class HostRoot:
    """The linker's root instance, whose host functions get each `borrow<T>` argument as
    the resource's rep (an int).

    Converting a borrow with `to_host` also ends it; wasmtime traps a call that leaves a
    borrow argument unended ("borrow handles still remain at the end of the call"), and
    doing it twice corrupts the handle table. Pie's runtime must do the same, once.
    """

    def __init__(self, linker: Linker):
        self.root = linker.root()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.root.__exit__(*exc)

    def add_instance(self, name: str):
        instance = self.root.add_instance(name)
        add_func = instance.add_func

        def add_func_taking_reps(func_name, func):
            def call(store, *args):
                args = [arg.to_host(store).rep if isinstance(arg, ResourceAny) and not arg.owned else arg
                        for arg in args]
                args = [[a.to_host(store).rep if isinstance(a, ResourceAny) and not a.owned else a for a in arg]
                        if isinstance(arg, list) else arg for arg in args]
                return func(store, *args)
            add_func(func_name, call)
        instance.add_func = add_func_taking_reps
        return instance


class FakeHost:
    """Host resources for the guest: rep -> Python object, per resource type."""

    POLLABLE, FUTURE_STRING, QUEUE = 1, 2, 3

    def __init__(self):
        self.objects: dict[int, object] = {}
        self.next_rep = 1

    def own(self, obj, kind: int) -> ResourceHost:
        rep, self.next_rep = self.next_rep, self.next_rep + 1
        self.objects[rep] = obj
        return ResourceHost.own(rep, kind)

    def get(self, store, rep: int):
        return self.objects[rep]

    def drop(self, store, rep):
        del self.objects[rep]


def test_hello_echoes_against_a_fake_host(components):
    """hello against a fake host (futures, runtime and messaging faked here): arguments
    come back as one message, then each message until "quit"; every future is pending at
    first, so the executor really waits in the host's `wait`."""
    host, sent = FakeHost(), []
    incoming = iter(["hi", "there", "quit", "never read"])

    class Future:  # a future-string that becomes ready once polled
        def __init__(self, value):
            self.value, self.ready = value, False

    engine = Engine()
    linker = Linker(engine)
    with HostRoot(linker) as root:
        with root.add_instance("pie:inferlet/futures@0.1.0") as futures:
            futures.add_resource("pollable", ResourceType.host(FakeHost.POLLABLE), host.drop)
            futures.add_resource("future-string", ResourceType.host(FakeHost.FUTURE_STRING), host.drop)
            futures.add_func("[method]future-string.subscribe",
                             lambda store, f: host.own(host.get(store, f), FakeHost.POLLABLE))
            futures.add_func("[method]future-string.get",
                             lambda store, f: (lambda fut: fut.value if fut.ready else None)(host.get(store, f)))

            watched = {}  # key -> future

            def wait(store):
                for future in watched.values():
                    future.ready = True
                keys = sorted(watched)
                watched.clear()
                return keys
            futures.add_func("[method]pollable.watch", lambda store, p, key: watched.update({key: host.get(store, p)}))
            futures.add_func("wait", wait)
        with root.add_instance("pie:inferlet/runtime@0.1.0") as runtime:
            runtime.add_func("get-arguments", lambda store: ["hello", "wörld"])
            runtime.add_func("log", lambda store, level, message: pytest.fail(f"hello logged {message}"))  # the panic hook's
        # The SDK's executor links the fused-pass results (queues, take); hello awaits none.
        with root.add_instance("pie:inferlet/types@0.1.0") as types:
            types.add_resource("queue", ResourceType.host(FakeHost.QUEUE), host.drop)
        with root.add_instance("pie:inferlet/inference@0.1.0") as inference:
            for name in ("take", "results-ready"):
                inference.add_func(name, lambda store, *args, name=name: pytest.fail(f"hello called {name}"))
        with root.add_instance("pie:inferlet/messaging@0.1.0") as messaging:
            messaging.add_func("send", lambda store, message: sent.append(message))
            messaging.add_func("receive",
                               lambda store: host.own(Future(next(incoming)), FakeHost.FUTURE_STRING))

    store = Store(engine)
    instance = linker.instantiate(store, Component.from_file(engine, str(components["hello"])))
    run = instance.get_func(store, "run")
    result = run(store)
    run.post_return(store)
    assert result is None  # ok(())
    assert sent == ["hello wörld", "hi", "there"]
    assert host.objects == {}, "the guest leaked resources"


class FakeModel(FakeHost):
    """A fake host with a toy model behind the real API shapes, checking the guest's paging.

    Tokens are characters (id = code point, 0 = EOS). The KV cache stores (token, position)
    per slot; `forward` reads the context back from the pages it is given, so a wrong page
    list, last-page length or offset shows up as a wrong sequence. The "model" answers
    ANSWER one character per step after the prompt, then EOS.
    """

    QUEUE, FUTURE_TOKEN = 3, 4
    PAGE_SIZE, EOS, ANSWER = 4, 0, "Paris."

    def __init__(self, args: list[str]):
        super().__init__()
        self.args, self.sent, self.samplers, self.watched = args, [], [], []
        self.kv: dict[int, list] = {}
        self.embeds: dict[int, object] = {}
        self.next_id = 100
        self.prompt = ""
        self.results: list = []  # inference results not yet taken

    def ids(self, count: int, table: dict) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        table.update((i, [None] * self.PAGE_SIZE if table is self.kv else None) for i in ids)
        return ids

    def free(self, ids, table: dict) -> None:
        for i in ids:
            del table[i]

    def template(self, store, q, messages, add_generation_prompt):
        text = "".join(f"<{m.role}>{m.content}</{m.role}>" for m in messages)
        self.prompt = text + ("<assistant>" if add_generation_prompt else "")
        return self.prompt

    def forward(self, store, q, p):
        pages, last_len = getattr(p, "input-kv-pages"), getattr(p, "input-kv-last-page-len")
        context = [slot for i, page in enumerate(pages)
                   for slot in self.kv[page][:self.PAGE_SIZE if i < len(pages) - 1 else last_len]]
        new = [self.embeds[e] for e in getattr(p, "input-embeds")]
        out_pages, offset = getattr(p, "output-kv-pages"), getattr(p, "output-kv-offset")
        if pages and last_len < self.PAGE_SIZE:  # appending to the partial last page
            assert (out_pages[0], offset) == (pages[-1], last_len)
        for i, item in enumerate(new, start=offset):
            self.kv[out_pages[i // self.PAGE_SIZE]][i % self.PAGE_SIZE] = item
        sequence = context + new
        assert [pos for _, pos in sequence] == list(range(len(sequence)))
        for e, index in zip(getattr(p, "output-embeds"), getattr(p, "output-token-indices")):
            self.embeds[e] = "".join(chr(t) for t, _ in context + new[:index + 1])

    def execute_pass(self, store, q, p):
        """`inference.execute`: one step of `run_pass` (drawing only if an output asks)."""
        return FakeModel.run_pass(self, store, q, p, 1, False)

    def run_pass(self, store, q, p, steps, streaming):
        """A host-side run (`inference.run`) on the toy model, all at once: its first step
        reads the context back from the pages as `forward` does, every step writes its new
        tokens at the next slots of the output pages and feeds back the token it drew."""
        pages, last_len = getattr(p, "input-kv-pages"), getattr(p, "input-kv-last-page-len")
        sequence = [slot for i, page in enumerate(pages)
                    for slot in self.kv[page][:self.PAGE_SIZE if i < len(pages) - 1 else last_len]]
        out_pages, slot = getattr(p, "output-kv-pages"), getattr(p, "output-kv-offset")
        if pages and last_len < self.PAGE_SIZE:  # appending to the partial last page
            assert (out_pages[0], slot) == (pages[-1], last_len)
        self.samplers += [o.sample for o in p.outputs]
        new, drawn = list(zip(getattr(p, "input-tokens"), p.positions)), []
        for _ in range(steps if p.outputs else 0):
            for item in new:
                self.kv[out_pages[slot // self.PAGE_SIZE]][slot % self.PAGE_SIZE] = item
                slot += 1
            sequence += new
            assert [pos for _, pos in sequence] == list(range(len(sequence)))
            k = len("".join(chr(t) for t, _ in sequence)) - len(self.prompt)
            drawn.append(ord(self.ANSWER[k]) if k < len(self.ANSWER) else self.EOS)
            if drawn[-1] in getattr(p, "stop-tokens"):
                break
            new = [(drawn[-1], len(sequence))]
        for item in new if not p.outputs else ():  # a prefill chunk: written, nothing drawn
            self.kv[out_pages[slot // self.PAGE_SIZE]][slot % self.PAGE_SIZE] = item
            slot += 1
        result = Record()
        setattr(result, "pass", len(self.results) + 1)
        result.status, result.tokens, result.details, result.failure = "done", drawn, [], None
        self.results.append(result)
        return len(self.results)

    def copy_kvpage(self, store, q, src, dst, src_offset, dst_offset, n):
        self.kv[dst][dst_offset:dst_offset + n] = self.kv[src][src_offset:src_offset + n]

    @staticmethod
    def unexpected(name: str):
        """A host function the guest links but must not call in these tests."""
        def call(store, *args):
            raise AssertionError(f"the guest called {name}")
        return call

    def sample(self, store, q, emb, sampler):
        self.samplers.append(sampler)
        text = self.embeds[emb]
        assert text.startswith(self.prompt), text
        k = len(text) - len(self.prompt)
        return self.own(ord(self.ANSWER[k]) if k < len(self.ANSWER) else self.EOS, self.FUTURE_TOKEN)

    def link(self, engine: Engine) -> Linker:
        linker = Linker(engine)
        with HostRoot(linker) as root:
            with root.add_instance("pie:inferlet/types@0.1.0") as types:
                types.add_resource("queue", ResourceType.host(self.QUEUE), self.drop)
            with root.add_instance("pie:inferlet/futures@0.1.0") as futures:
                futures.add_resource("pollable", ResourceType.host(self.POLLABLE), self.drop)
                futures.add_func("[method]pollable.watch", lambda store, p, key: self.watched.append(key))
                futures.add_func("wait", lambda store: [self.watched.pop() for _ in list(self.watched)][::-1])
                # text_completion --turns receives user messages; these runs have one turn.
                futures.add_resource("future-string", ResourceType.host(self.FUTURE_STRING), self.drop)
                for name in ("[method]future-string.subscribe", "[method]future-string.get"):
                    futures.add_func(name, self.unexpected(name))
            with root.add_instance("pie:inferlet/runtime@0.1.0") as runtime:
                runtime.add_func("get-arguments", lambda store: self.args)
                runtime.add_func("log", lambda store, level, message: self.sent.append(f"log: {message}"))
                runtime.add_func("available-models", lambda store: ["toy"])
                runtime.add_func("create-queue", lambda store, model: self.own(model, self.QUEUE))
            with root.add_instance("pie:inferlet/messaging@0.1.0") as messaging:
                messaging.add_func("send", lambda store, message: self.sent.append(message))
                messaging.add_func("receive", self.unexpected("receive"))
            with root.add_instance("pie:inferlet/allocate@0.1.0") as allocate:
                allocate.add_func("kv-page-size", lambda store, q: self.PAGE_SIZE)
                allocate.add_func("alloc-kvpage", lambda store, q, n: self.ids(n, self.kv))
                allocate.add_func("dealloc-kvpage", lambda store, q, ids: self.free(ids, self.kv))
                allocate.add_func("alloc-emb", lambda store, q, n: self.ids(n, self.embeds))
                allocate.add_func("dealloc-emb", lambda store, q, ids: self.free(ids, self.embeds))
                allocate.add_func("copy-kvpage", self.copy_kvpage)
                for name in ("export-kvpage", "import-kvpage", "unexport-kvpage"):
                    allocate.add_func(name, self.unexpected(name))
            with root.add_instance("pie:inferlet/memory@0.1.0") as memory:
                memory.add_func("set-kv-class", self.unexpected("set-kv-class"))
            with root.add_instance("pie:inferlet/scheduling@0.1.0") as scheduling:
                for name in ("set-queue-objective", "set-job-size"):
                    scheduling.add_func(name, self.unexpected(name))
            with root.add_instance("pie:inferlet/kvs@0.1.0") as kvs:
                for name in ("store-get", "store-set", "store-delete"):
                    kvs.add_func(name, self.unexpected(name))
            with root.add_instance("pie:inferlet/input-text@0.1.0") as input_text:
                input_text.add_func("embed-text", lambda store, q, tokens, positions, embeds: self.embeds.update(
                    (e, (t, p)) for t, p, e in zip(tokens, positions, embeds)))
            with root.add_instance("pie:inferlet/forward@0.1.0") as forward:
                forward.add_func("forward", self.forward)
                forward.add_func("mask-kvpage", self.unexpected("mask-kvpage"))
            with root.add_instance("pie:inferlet/tokenize@0.1.0") as tokenize:
                tokenize.add_func("tokenize", lambda store, q, text: [ord(c) for c in text])
                tokenize.add_func("detokenize", lambda store, q, ids: "".join(chr(i) for i in ids))
                tokenize.add_func("get-eos-tokens", lambda store, q: [self.EOS])
                tokenize.add_func("apply-chat-template", self.template)
            with root.add_instance("pie:inferlet/inference@0.1.0") as inference:
                inference.add_func("run", self.run_pass)
                inference.add_func("execute", self.execute_pass)
                inference.add_func("take", lambda store, q, block: [self.results.pop(0) for _ in list(self.results)])
                inference.add_func("results-ready", lambda store, q: self.own(None, self.POLLABLE))
                inference.add_func("cancel", self.unexpected("cancel"))
            with root.add_instance("pie:inferlet/output-text@0.1.0") as output_text:
                output_text.add_resource("future-token", ResourceType.host(self.FUTURE_TOKEN), self.drop)
                output_text.add_func("sample", self.sample)
                output_text.add_func("[method]future-token.subscribe",
                                     lambda store, f: self.own(None, self.POLLABLE))
                output_text.add_func("[method]future-token.get", lambda store, f: self.get(store, f))
        return linker

    def run(self, component: Path):
        engine = Engine()
        store = Store(engine)
        instance = self.link(engine).instantiate(store, Component.from_file(engine, str(component)))
        run = instance.get_func(store, "run")
        result = run(store)
        run.post_return(store)
        return result


@pytest.mark.parametrize("max_tokens, expected", [(32, "Paris."), (3, "Par")])
def test_text_completion_against_a_fake_host_and_toy_model(components, max_tokens, expected):
    """text_completion against FakeModel: the SDK's chat template call, a multi-page
    prompt, a host-side run into the pages the SDK reserved (across page boundaries),
    greedy sampling, stop at EOS or max tokens, and every page and embed freed — the toy
    model's answer, not a real one."""
    host = FakeModel(["--prompt", "Capital of France?", "--max-tokens", str(max_tokens),
                      "--system", "Be brief."])
    assert host.run(components["text_completion"]) is None
    assert host.sent == [expected]
    assert host.prompt == "<system>Be brief.</system><user>Capital of France?</user><assistant>"
    assert all(s.temperature == 0 and s.seed is None for s in host.samplers)
    assert host.kv == {} and host.embeds == {} and host.objects == {}, "the guest leaked"


def test_text_completion_reports_bad_arguments_to_a_fake_host(components):
    host = FakeModel(["--max-tokens", "8"])
    assert host.run(components["text_completion"]) == "--prompt is required"
    host = FakeModel(["--prompt", "x", "--max-tokens", "many"])
    assert host.run(components["text_completion"]) == 'invalid number for --max-tokens: "many"'


def test_every_generated_import_matches_the_wit(tmp_path):
    """A crate that links every generated import wrapper must become a valid component:
    `wasm-tools component new` checks each core signature against the Canonical ABI, so
    functions the inferlets do not use (parameter spilling, http, ...) are covered too."""
    sys.path.insert(0, str(REPO / "sdk/rust"))
    from gen_bindings import camel, resolved_wit, snake

    wit = resolved_wit()
    paths = []
    for iface in wit["interfaces"]:
        for name, func in iface["functions"].items():
            module = f"inferlet::bindings::{snake(iface['name'])}"
            if func["kind"] == "freestanding":
                paths.append(f"{module}::{snake(name)}")
            else:  # [method]resource.name
                resource, method = name.split("]", 1)[1].split(".")
                paths.append(f"{module}::{camel(resource)}::{snake(method)}")
    uses = "\n".join(f"        std::hint::black_box({p} as *const ());" for p in paths)
    workspace = (INFERLETS / "Cargo.toml").read_text().split("[profile.release]", 1)[1]
    (tmp_path / "Cargo.toml").write_text(
        '[package]\nname = "all_imports"\nversion = "0.1.0"\nedition = "2021"\n\n'
        '[lib]\ncrate-type = ["cdylib"]\n\n'
        f'[dependencies]\ninferlet = {{ path = "{REPO / "sdk/rust/inferlet"}" }}\n\n'
        f"[workspace]\n\n[profile.release]{workspace}")  # same profile: reuses the built std
    (tmp_path / "src").mkdir()
    (tmp_path / "src/lib.rs").write_text(
        "inferlet::main!(main);\n\nasync fn main() -> Result<(), String> {\n"
        f"    if inferlet::args().is_empty() {{\n{uses}\n    }}\n    Ok(())\n}}\n")
    component = build_inferlet(tmp_path)
    wit_text = subprocess.run([wasm_tools(), "component", "wit", str(component)],
                              capture_output=True, text=True, check=True).stdout
    assert wit_text.count("func(") == len(paths) + 1  # + run
