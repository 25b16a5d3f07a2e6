"""The host API (sdk/wit) and its reference (docs/api.md) agree, and the API is complete.

docs/api.md is generated from the WIT by sdk/wit/gen_api_doc.py; these tests fail when it
is stale or hand-edited, when a doc comment lacks what the reference needs, when the core
count is not the paper's 42, or when a function the paper names goes missing.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIT_DIR = ROOT / "sdk" / "wit"
GENERATOR = WIT_DIR / "gen_api_doc.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_api_doc", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


gen = _load_generator()

# Every function the paper names (Table 1, §4.1–4.3), under its WIT name.
PAPER_FUNCTIONS = {
    "get_arg": "runtime.get-arguments",
    "send": "messaging.send",
    "receive": "messaging.receive",
    "broadcast": "messaging.broadcast",
    "subscribe": "messaging.subscribe",
    "http_get": "http.http-get",
    "http_post": "http.http-post",
    "available_models": "runtime.available-models",
    "available_traits": "runtime.available-traits",
    "create_queue": "runtime.create-queue",
    "synchronize": "runtime.synchronize",
    "set_queue_priority": "runtime.set-queue-priority",
    "alloc_kvpage": "allocate.alloc-kvpage",
    "dealloc_kvpage": "allocate.dealloc-kvpage",
    "alloc_emb": "allocate.alloc-emb",
    "dealloc_emb": "allocate.dealloc-emb",
    "copy_kvpage": "allocate.copy-kvpage",
    "export_kvpage": "allocate.export-kvpage",
    "import_kvpage": "allocate.import-kvpage",
    "forward": "forward.forward",
    "forward_with_adapter": "forward.forward-with-adapter",
    "mask_kvpage": "forward.mask-kvpage",
    "embed_txt": "input-text.embed-text",
    "embed_img": "input-image.embed-image",
    "num_embs_needed": "input-image.num-embs-needed",
    "tokenize": "tokenize.tokenize",
    "detokenize": "tokenize.detokenize",
    "get_vocabs": "tokenize.get-vocabs",
    "get_next_dist": "output-text.get-next-dist",
}

# What a runtime needs beyond the paper's list (DESIGN §4).
RUNTIME_NECESSITIES = [
    "runtime.instance-id",
    "runtime.version",
    "runtime.log",
    "runtime.now",
    "runtime.random-bytes",
    "kvs.store-get",
    "kvs.store-set",
    "kvs.store-delete",
    "allocate.unexport-kvpage",
    "allocate.kv-page-size",
    "tokenize.get-eos-tokens",
    "tokenize.apply-chat-template",
    "output-text.sample",
    "futures.wait",
]

_DOC_FUNCTION_RE = re.compile(r"^### `([^`]+)`\n\n```wit\n(.+)\n```$", re.MULTILINE)


@pytest.fixture(scope="module")
def resolved():
    return gen.resolve_wit(WIT_DIR)


@pytest.fixture(scope="module")
def api(resolved):
    return gen.load_api(resolved)


@pytest.fixture(scope="module")
def doc_text():
    return gen.DOC_PATH.read_text()


def test_doc_comments_follow_the_rules(api, resolved):
    assert gen.problems(api, gen.error_kinds(resolved)) == []


def test_core_has_42_functions(api):
    core = [f.qualified for f in api.core]
    assert len(core) == 42, f"{len(core)} core functions: {core}"
    assert len(set(core)) == len(core)


def test_paper_functions_and_runtime_necessities_exist(api):
    names = {f.qualified for f in api.functions}
    missing = [f"{p} ({w})" for p, w in PAPER_FUNCTIONS.items() if w not in names]
    missing += [w for w in RUNTIME_NECESSITIES if w not in names]
    assert not missing, f"missing from sdk/wit: {missing}"


def test_world_imports_only_the_traits_and_exports_run(resolved):
    (package,) = resolved["packages"]  # no foreign package (WASI) is even referenced
    assert package["name"] == "pie:inferlet@0.1.0"
    (world,) = resolved["worlds"]
    interfaces = resolved["interfaces"]
    imported = {interfaces[v["interface"]["id"]]["name"] for v in world["imports"].values()}
    assert imported == {*gen.CORE_TRAITS, *gen.PLUMBING, *gen.EXTENSIONS}
    assert list(world["exports"]) == ["run"]


def test_every_wit_function_is_documented_with_its_signature(api, doc_text):
    documented = dict(_DOC_FUNCTION_RE.findall(doc_text))
    in_wit = {f.qualified: f.signature for f in api.functions}
    assert sorted(set(in_wit) - set(documented)) == [], "in the WIT but not in docs/api.md"
    assert sorted(set(documented) - set(in_wit)) == [], "in docs/api.md but not in the WIT"
    differ = {n: (documented[n], s) for n, s in in_wit.items() if documented[n] != s}
    assert differ == {}, "signature in docs/api.md != WIT: {name: (doc, wit)}"


def test_contents_lists_exactly_the_core(api, doc_text):
    assert "## Contents: 42 core functions" in doc_text
    rows = re.findall(r"^\| \d+ \| \[`([^`]+)`\]", doc_text, re.MULTILINE)
    assert rows == [f.qualified for f in api.core]


def test_signatures_are_spelled_as_wasm_tools_prints_them(api):
    """Guards the generator's type renderer with wasm-tools' own WIT printer."""
    printed = subprocess.run(
        [gen.find_wasm_tools(), "component", "wit", str(WIT_DIR)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    blocks = dict(re.findall(r"^(?:interface|world) ([\w-]+) \{\n(.*?)^\}", printed, re.S | re.M))
    unprinted = [
        f.qualified for f in api.functions if f"{f.signature};" not in blocks[f.interface]
    ]
    assert unprinted == []


def test_doc_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_rules_catch_an_undocumented_error(tmp_path):
    """The checks are not vacuous: dropping one function's Errors section is reported."""
    wit = tmp_path / "wit"
    shutil.copytree(WIT_DIR, wit, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    model = wit / "model.wit"
    text = model.read_text()
    broken = re.sub(
        r"    /// Errors:\n(?:    ///.*\n)*?(    import-kvpage: func)",
        r"\1",
        text,
        count=1,
    )
    assert broken != text
    model.write_text(broken)
    resolved = gen.resolve_wit(wit)
    found = gen.problems(gen.load_api(resolved), gen.error_kinds(resolved))
    assert found == ["allocate.import-kvpage: returns `error` but lists no Errors"]
