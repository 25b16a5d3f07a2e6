"""Generate the Rust SDK's canonical-ABI bindings from sdk/wit.

    python sdk/rust/gen_bindings.py          # rewrite sdk/rust/inferlet/src/bindings.rs
    python sdk/rust/gen_bindings.py --check  # exit 1 if the file is not up to date

wit-bindgen is not available offline, so this is our own small generator. It reads the
resolved WIT (`wasm-tools component wit --json`) and writes, per interface, a Rust module
with the WIT's types and one safe function per import. Each function lowers its arguments
to core wasm values as the Component Model's Canonical ABI prescribes and lifts the result
back (Canonical ABI explainer: component-model/design/mvp/CanonicalABI.md):

* Flattening: scalars are one value; strings and lists are (ptr, len); records and tuples
  concatenate their fields; variants (option, result, enum) are a discriminant followed by
  the element-wise "join" of their cases' flat values.
* More than 16 flat parameters are stored in memory and passed by pointer; a result of more
  than one flat value is written by the host into a return area whose pointer is passed
  as the last parameter.
* Lists and strings the host returns were allocated through our `cabi_realloc`; lifting
  takes ownership of them. Lists and strings passed to the host are borrowed for the call.
* Resources are i32 handles; each resource type gets a Rust struct that calls
  `[resource-drop]<name>` when dropped, and `[method]` / `[static]` / `[constructor]`
  imports become its methods.

The world's exports get `_export_<name>` / `_post_return_<name>` glue plus the macro
`__export_world!`, which the SDK's `main!` expands in the inferlet crate so the linker
keeps the export symbols. Memory helpers live in the hand-written `abi.rs`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIT_DIR = HERE.parent / "wit"
OUT = HERE / "inferlet" / "src" / "bindings.rs"
MAX_FLAT_PARAMS = 16
MAX_FLAT_RESULTS = 1

# WIT primitive -> (Rust type, flat core type, size = alignment in memory).
PRIMITIVES = {
    "bool": ("bool", "i32", 1), "u8": ("u8", "i32", 1), "s8": ("i8", "i32", 1),
    "u16": ("u16", "i32", 2), "s16": ("i16", "i32", 2), "u32": ("u32", "i32", 4),
    "s32": ("i32", "i32", 4), "char": ("char", "i32", 4), "u64": ("u64", "i64", 8),
    "s64": ("i64", "i64", 8), "f32": ("f32", "f32", 4), "f64": ("f64", "f64", 8),
}
# Primitives whose Rust values have exactly the canonical memory layout, so a list of
# them can be passed or taken as a Rust slice/Vec without conversion.
PLAIN = {"u8", "s8", "u16", "s16", "u32", "s32", "u64", "s64", "f32", "f64"}
# Which Rust integer type reads/writes a primitive in memory, and how to convert.
MEMORY_TYPE = {"bool": "u8", "char": "u32"}
RUST_KEYWORDS = {"as", "async", "await", "box", "break", "const", "continue", "crate", "dyn",
                 "else", "enum", "extern", "false", "fn", "for", "if", "impl", "in", "let",
                 "loop", "match", "mod", "move", "mut", "pub", "ref", "return", "self",
                 "static", "struct", "super", "trait", "true", "type", "unsafe", "use",
                 "where", "while", "yield"}


def snake(name: str) -> str:
    ident = name.replace("-", "_")
    return ident + "_" if ident in RUST_KEYWORDS else ident


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("-"))


def doc_comment(docs: dict | None, indent: str) -> str:
    text = (docs or {}).get("contents")
    if not text:
        return ""
    return "".join(f"{indent}///{' ' + line if line else ''}\n" for line in text.split("\n"))


class Generator:
    """Rust source for one resolved WIT world; see the module docstring for the ABI."""

    def __init__(self, wit: dict, world: str = "inferlet"):
        self.types = wit["types"]
        self.interfaces = wit["interfaces"]
        self.world = next(w for w in wit["worlds"] if w["name"] == world)
        self.package = wit["packages"][self.world["package"]]["name"]
        self.counter = 0

    # ---- type structure --------------------------------------------------------------

    def kind(self, t):
        """The structural kind of `t`, through type aliases: a primitive name or a dict."""
        while isinstance(t, int):
            k = self.types[t]["kind"]
            if isinstance(k, dict) and "type" in k:
                t = k["type"]
            else:
                return k
        return t

    def cases(self, k: dict) -> list:
        """The payload types of a variant-like kind, in discriminant order (None: no payload)."""
        if "option" in k:
            return [None, k["option"]]
        if "result" in k:
            return [k["result"]["ok"], k["result"]["err"]]
        if "variant" in k:
            return [c.get("type") for c in k["variant"]["cases"]]
        if "enum" in k:
            return [None] * len(k["enum"]["cases"])
        raise NotImplementedError(k)

    def fields(self, k: dict) -> list:
        """(Rust accessor, type) of each field of a record or tuple kind."""
        if "record" in k:
            return [(snake(f["name"]), f["type"]) for f in k["record"]["fields"]]
        return [(str(i), t) for i, t in enumerate(k["tuple"]["types"])]

    def is_variant(self, k) -> bool:
        return isinstance(k, dict) and any(key in k for key in ("option", "result", "variant", "enum"))

    def is_plain(self, t) -> bool:
        k = self.kind(t)
        return isinstance(k, str) and k in PLAIN

    def needs_free(self, t) -> bool:
        """Whether a lifted value of `t` owns memory (so post-return must free it)."""
        k = self.kind(t)
        if k == "string" or (isinstance(k, dict) and "list" in k):
            return True
        if isinstance(k, dict) and ("record" in k or "tuple" in k):
            return any(self.needs_free(ft) for _, ft in self.fields(k))
        if self.is_variant(k):
            return any(c is not None and self.needs_free(c) for c in self.cases(k))
        return False

    # ---- Canonical ABI: memory layout and flattening ---------------------------------

    def disc_size(self, n: int) -> int:
        return 1 if n <= 256 else 2 if n <= 65536 else 4

    def size_align(self, t) -> tuple[int, int]:
        k = self.kind(t)
        if isinstance(k, str):
            if k == "string":
                return 8, 4
            size = PRIMITIVES[k][2]
            return size, size
        if "list" in k:
            return 8, 4
        if "handle" in k:
            return 4, 4
        if "record" in k or "tuple" in k:
            return self.record_layout([ft for _, ft in self.fields(k)])[1:]
        if self.is_variant(k):
            cases = self.cases(k)
            disc = self.disc_size(len(cases))
            payload_size, align = 0, disc
            for c in cases:
                if c is not None:
                    s, a = self.size_align(c)
                    payload_size, align = max(payload_size, s), max(align, a)
            size = align_to(align_to(disc, align) + payload_size, align)
            return size, align
        raise NotImplementedError(f"WIT type {k} is not supported by gen_bindings.py")

    def record_layout(self, types: list) -> tuple[list[int], int, int]:
        """Field offsets, size and alignment of a record with these field types."""
        offsets, offset, align = [], 0, 1
        for t in types:
            s, a = self.size_align(t)
            offset = align_to(offset, a)
            offsets.append(offset)
            offset += s
            align = max(align, a)
        return offsets, align_to(offset, align), align

    def flat(self, t) -> list[str]:
        k = self.kind(t)
        if isinstance(k, str):
            return ["i32", "i32"] if k == "string" else [PRIMITIVES[k][1]]
        if "list" in k:
            return ["i32", "i32"]
        if "handle" in k:
            return ["i32"]
        if "record" in k or "tuple" in k:
            return [v for _, ft in self.fields(k) for v in self.flat(ft)]
        if self.is_variant(k):
            joined: list[str] = []
            for c in self.cases(k):
                for i, v in enumerate(self.flat(c) if c is not None else []):
                    joined.append(v) if i == len(joined) else joined.__setitem__(i, join(joined[i], v))
            return ["i32", *joined]
        raise NotImplementedError(f"WIT type {k} is not supported by gen_bindings.py")

    # ---- Rust types ------------------------------------------------------------------

    def path(self, t: int, here: int | None) -> str:
        """The Rust path of named type `t` as seen from interface `here` (None: top level)."""
        typedef = self.types[t]
        owner = typedef["owner"]["interface"]
        name = camel(typedef["name"])
        if owner == here:
            return name
        module = snake(self.interfaces[owner]["name"])
        return f"{module}::{name}" if here is None else f"super::{module}::{name}"

    def rust_type(self, t, here: int | None, param: bool = False) -> str:
        """The Rust type for `t`: owned, or for a top-level parameter borrowed (&str, &[T])."""
        if isinstance(t, str):
            if t == "string":
                return "&str" if param else "String"
            return PRIMITIVES[t][0]
        typedef = self.types[t]
        if typedef["name"] is not None:
            return self.path(t, here)
        k = typedef["kind"]
        if "list" in k:
            elem = k["list"]
            if param:
                return f"&[{self.rust_type(elem, here, param=self.is_borrow(elem))}]"
            return f"Vec<{self.rust_type(elem, here)}>"
        if "option" in k:
            return f"Option<{self.rust_type(k['option'], here)}>"
        if "result" in k:
            ok, err = k["result"]["ok"], k["result"]["err"]
            ok_t = "()" if ok is None else self.rust_type(ok, here)
            err_t = "()" if err is None else self.rust_type(err, here)
            return f"Result<{ok_t}, {err_t}>"
        if "tuple" in k:
            return "(" + "".join(self.rust_type(x, here) + ", " for x in k["tuple"]["types"]) + ")"
        if "handle" in k:
            (mode, resource), = k["handle"].items()
            return ("&" if mode == "borrow" else "") + self.path(resource, here)
        raise NotImplementedError(f"WIT type {k} is not supported by gen_bindings.py")

    def is_borrow(self, t) -> bool:
        k = self.kind(t)
        return isinstance(k, dict) and "handle" in k and "borrow" in k["handle"]

    def variant_arms(self, t, here) -> list[tuple[str, str | None]]:
        """(Rust pattern, payload binding) per case of a variant-like type."""
        k = self.kind(t)
        if "option" in k:
            return [("None", None), ("Some(v)", "v")]
        if "result" in k:
            ok, err = k["result"]["ok"], k["result"]["err"]
            return [("Ok(v)" if ok is not None else "Ok(_)", "v" if ok is not None else None),
                    ("Err(e)" if err is not None else "Err(_)", "e" if err is not None else None)]
        name = self.rust_type(t, here)
        if "enum" in k:
            return [(f"{name}::{camel(c['name'])}", None) for c in k["enum"]["cases"]]
        return [(f"{name}::{camel(c['name'])}(v)" if c.get("type") is not None
                 else f"{name}::{camel(c['name'])}", "v" if c.get("type") is not None else None)
                for c in k["variant"]["cases"]]

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    # ---- lowering (Rust -> core values / memory) -------------------------------------
    # `expr` is a Rust expression of type &T (borrowed mode, arguments to imports) or of
    # type T that may be moved (owned mode, an export's result handed to the host).

    def lower_flat(self, expr: str, t, stmts: list[str], here) -> list[str]:
        """Rust expressions for the flat core values of `expr` (a reference to a T)."""
        k = self.kind(t)
        if isinstance(k, str):
            if k == "string":
                return [f"{expr}.as_ptr() as i32", f"{expr}.len() as i32"]
            core = PRIMITIVES[k][1]
            if k in ("f32", "f64"):
                return [f"*{expr}"]
            return [f"*{expr} as {'u32 as ' if k == 'char' else ''}{core}"]
        if "list" in k:
            return [self.lower_list(expr, k["list"], stmts, here), f"{expr}.len() as i32"]
        if "handle" in k:
            return [f"{expr}.handle()"]
        if "enum" in k:
            return [f"*{expr} as i32"]
        if "record" in k or "tuple" in k:
            return [v for name, ft in self.fields(k) for v in self.lower_flat(field_ref(expr, name), ft, stmts, here)]
        cases = self.cases(k)
        joined = self.flat(t)[1:]
        names = [self.fresh("f") for _ in range(len(joined) + 1)]
        arms = []
        for i, ((pattern, binding), payload) in enumerate(zip(self.variant_arms(t, here), cases)):
            inner: list[str] = []
            values = self.lower_flat(binding, payload, inner, here) if payload is not None else []
            flat = self.flat(payload) if payload is not None else []
            coerced = [coerce(v, flat[j], joined[j]) for j, v in enumerate(values)]
            coerced += [f"0{joined[j]}" for j in range(len(values), len(joined))]
            body = "".join(s + " " for s in inner)
            arms.append(f"{pattern} => {{ {body}({i}i32, {', '.join(coerced)}) }}")
        stmts.append(f"let ({', '.join(names)},) = match {expr} {{ {' '.join(arms)} }};")
        return names

    def lower_list(self, expr: str, elem, stmts: list[str], here) -> str:
        """The i32 pointer to a list's elements in canonical layout, valid during the call."""
        if self.is_plain(elem):
            return f"{expr}.as_ptr() as i32"
        size, align = self.size_align(elem)
        buf, item = self.fresh("buf"), self.fresh("e")
        body: list[str] = []
        self.store(item, elem, f"{buf}.add(i * {size})", 0, body, here, owned=False)
        stmts.append(f"let {buf} = cleanup.alloc({expr}.len() * {size}, {align});")
        stmts.append(f"for (i, {item}) in {expr}.iter().enumerate() {{ {' '.join(body)} }}")
        return f"{buf} as i32"

    def store(self, expr: str, t, base: str, off: int, stmts: list[str], here, owned: bool) -> None:
        """Statements writing `expr` in canonical layout at `base` (a *mut u8) + `off`."""
        k = self.kind(t)
        value = expr if owned else f"*{expr}"
        ptr = at(base, off)
        if isinstance(k, dict) and "enum" in k:
            disc = {1: "u8", 2: "u16", 4: "u32"}[self.disc_size(len(k["enum"]["cases"]))]
            stmts.append(f"{ptr}.cast::<{disc}>().write({value} as {disc});")
            return
        if isinstance(k, str) and k != "string":
            mem = MEMORY_TYPE.get(k, PRIMITIVES[k][0])
            cast = f" as {mem}" if k in MEMORY_TYPE else ""
            stmts.append(f"{ptr}.cast::<{mem}>().write({value}{cast});")
            return
        if k == "string" or "list" in k:
            if owned:
                ptr_len = self.fresh("pl")
                elem = None if k == "string" else k["list"]
                stmts.append(f"let {ptr_len} = {self.leak(expr, elem, here)};")
                values = [f"{ptr_len}.0", f"{ptr_len}.1"]
            else:
                values = self.lower_flat(expr, t, stmts, here)
            stmts.append(f"{ptr}.cast::<i32>().write({values[0]});")
            stmts.append(f"{at(base, off + 4)}.cast::<i32>().write({values[1]});")
            return
        if "handle" in k:
            handle = f"{expr}.into_handle()" if owned else f"{expr}.handle()"
            stmts.append(f"{ptr}.cast::<i32>().write({handle});")
            return
        if "record" in k or "tuple" in k:
            fields = self.fields(k)
            offsets = self.record_layout([ft for _, ft in fields])[0]
            for (name, ft), field_off in zip(fields, offsets):
                field = f"{expr}.{name}" if owned else field_ref(expr, name)
                self.store(field, ft, base, off + field_off, stmts, here, owned)
            return
        cases = self.cases(k)
        disc = {1: "u8", 2: "u16", 4: "u32"}[self.disc_size(len(cases))]
        payload_at = align_to(self.disc_size(len(cases)), self.size_align(t)[1])
        arms = []
        for i, ((pattern, binding), payload) in enumerate(zip(self.variant_arms(t, here), cases)):
            body = [f"{ptr}.cast::<{disc}>().write({i});"]
            if payload is not None:
                self.store(binding, payload, base, off + payload_at, body, here, owned)
            arms.append(f"{pattern} => {{ {' '.join(body)} }}")
        stmts.append(f"match {expr} {{ {' '.join(arms)} }}")

    def leak(self, expr: str, elem, here) -> str:
        """(ptr, len) of an owned string or list handed to the host until post-return."""
        if elem is None:
            return f"crate::abi::leak_string({expr})"
        if self.is_plain(elem):
            return f"crate::abi::leak_vec({expr})"
        size, align = self.size_align(elem)
        buf, item, body = self.fresh("buf"), self.fresh("e"), []
        self.store(item, elem, f"{buf}.add(i * {size})", 0, body, here, owned=True)
        return (f"{{ let {buf} = crate::abi::alloc({expr}.len() * {size}, {align}); let n = {expr}.len(); "
                f"for (i, {item}) in {expr}.into_iter().enumerate() {{ {' '.join(body)} }} ({buf} as i32, n as i32) }}")

    # ---- lifting (core values / memory -> Rust) --------------------------------------

    def lift_flat(self, value: str, t, here) -> str:
        """The Rust value of a type whose flat form is the single core value `value`."""
        k = self.kind(t)
        if isinstance(k, str) and k != "string":
            if k == "bool":
                return f"{value} != 0"
            if k == "char":
                return f"char::from_u32({value} as u32).unwrap()"
            return value if k in ("f32", "f64") else f"{value} as {PRIMITIVES[k][0]}"
        if isinstance(k, dict) and "handle" in k and "own" in k["handle"]:
            return f"{self.rust_type(t, here)}::from_handle({value})"
        if isinstance(k, dict) and "enum" in k:
            return f"{self.rust_type(t, here)}::_lift({value} as u32)"
        raise NotImplementedError(f"lifting {k} from a single flat value")

    def load(self, base: str, off: int, t, here) -> str:
        """A Rust expression reading an owned T in canonical layout at `base` + `off`."""
        k = self.kind(t)
        ptr = at(base, off)
        if isinstance(k, str) and k != "string":
            mem = MEMORY_TYPE.get(k, PRIMITIVES[k][0])
            read = f"{ptr}.cast::<{mem}>().read()"
            return {"bool": f"{read} != 0", "char": f"char::from_u32({read}).unwrap()"}.get(k, read)
        if k == "string" or "list" in k:
            addr, n = f"{ptr}.cast::<i32>().read()", f"{at(base, off + 4)}.cast::<i32>().read()"
            if k == "string":
                return f"crate::abi::take_string({addr}, {n})"
            elem = k["list"]
            if self.is_plain(elem):
                return f"crate::abi::take_vec({addr}, {n})"
            size, align = self.size_align(elem)
            item = self.fresh("p")
            return f"crate::abi::take_list({addr}, {n}, {size}, {align}, |{item}| {self.load(item, 0, elem, here)})"
        if "handle" in k:
            return f"{self.rust_type(t, here)}::from_handle({ptr}.cast::<i32>().read())"
        if "enum" in k:
            disc = {1: "u8", 2: "u16", 4: "u32"}[self.disc_size(len(k["enum"]["cases"]))]
            return f"{self.rust_type(t, here)}::_lift({ptr}.cast::<{disc}>().read() as u32)"
        if "record" in k or "tuple" in k:
            fields = self.fields(k)
            offsets = self.record_layout([ft for _, ft in fields])[0]
            values = [self.load(base, off + o, ft, here) for (_, ft), o in zip(fields, offsets)]
            if "tuple" in k:
                return "(" + "".join(v + ", " for v in values) + ")"
            inits = ", ".join(f"{name}: {v}" for (name, _), v in zip(fields, values))
            return f"{self.rust_type(t, here)} {{ {inits} }}"
        cases = self.cases(k)
        disc = {1: "u8", 2: "u16", 4: "u32"}[self.disc_size(len(cases))]
        payload_at = align_to(self.disc_size(len(cases)), self.size_align(t)[1])
        arms = []
        for i, ((pattern, binding), payload) in enumerate(zip(self.variant_arms(t, here), cases)):
            if payload is None:
                value = pattern.replace("(_)", "(())")
            else:
                value = pattern.replace(f"({binding})", f"({self.load(base, off + payload_at, payload, here)})")
            arms.append(f"{i} => {value},")
        return f"match {ptr}.cast::<{disc}>().read() {{ {' '.join(arms)} _ => unreachable!() }}"

    # ---- emitters --------------------------------------------------------------------

    def emit(self) -> str:
        out = [HEADER.format(package=self.package, world=self.world["name"])]
        for item in self.world["imports"].values():
            out.append(self.emit_interface(item["interface"]["id"]))
        out.append(self.emit_exports())
        return "\n".join(out)

    def emit_interface(self, iface_id: int) -> str:
        iface = self.interfaces[iface_id]
        module = f"{self.package.split('@')[0]}/{iface['name']}@{self.package.split('@')[1]}"
        body = []
        for name, t in iface["types"].items():
            body.append(self.emit_typedef(t, iface_id, module))
        for name, func in iface["functions"].items():
            if func["kind"] == "freestanding":
                body.append(self.emit_function(func, iface_id, module, "    "))
        for name, t in iface["types"].items():
            methods = [f for f in iface["functions"].values()
                       if isinstance(f["kind"], dict) and list(f["kind"].values())[0] == t]
            if methods:
                inner = "".join(self.emit_function(f, iface_id, module, "        ") for f in methods)
                body.append(f"    impl {camel(name)} {{\n{inner}    }}\n")
        docs = doc_comment(iface.get("docs"), "")
        return f"{docs}pub mod {snake(iface['name'])} {{\n" + "\n".join(body) + "}\n"

    def emit_typedef(self, t: int, here: int, module: str) -> str:
        typedef = self.types[t]
        name, k = camel(typedef["name"]), typedef["kind"]
        docs = doc_comment(typedef.get("docs"), "    ")
        if k == "resource":
            return RESOURCE.format(docs=docs, name=name, module=module, wit_name=typedef["name"])
        if "type" in k:
            return f"{docs}    pub type {name} = {self.rust_type(k['type'], here)};\n"
        if "record" in k:
            fields = "".join(doc_comment(f.get("docs"), "        ")
                             + f"        pub {snake(f['name'])}: {self.rust_type(f['type'], here)},\n"
                             for f in k["record"]["fields"])
            return f"{docs}    #[derive(Clone, Debug, PartialEq)]\n    pub struct {name} {{\n{fields}    }}\n"
        if "enum" in k:
            cases = k["enum"]["cases"]
            variants = "".join(doc_comment(c.get("docs"), "        ") + f"        {camel(c['name'])},\n" for c in cases)
            lifts = " ".join(f"{i} => {name}::{camel(c['name'])}," for i, c in enumerate(cases))
            return (f"{docs}    #[derive(Clone, Copy, Debug, PartialEq, Eq)]\n    pub enum {name} {{\n{variants}    }}\n"
                    f"    impl {name} {{\n        #[doc(hidden)]\n        pub fn _lift(d: u32) -> Self {{ match d {{ {lifts} _ => unreachable!() }} }}\n    }}\n")
        if "variant" in k:
            cases = "".join(doc_comment(c.get("docs"), "        ") + f"        {camel(c['name'])}"
                            + (f"({self.rust_type(c['type'], here)})" if c.get("type") is not None else "") + ",\n"
                            for c in k["variant"]["cases"])
            return f"{docs}    #[derive(Clone, Debug, PartialEq)]\n    pub enum {name} {{\n{cases}    }}\n"
        raise NotImplementedError(f"WIT type definition {k} is not supported by gen_bindings.py")

    def emit_function(self, func: dict, here: int, module: str, indent: str) -> str:
        kind = func["kind"]
        wit_name = func["name"]
        rust_name = snake(wit_name.split(".")[-1]) if "." in wit_name else snake(wit_name)
        if isinstance(kind, dict) and "constructor" in kind:
            rust_name = "new"
        params, sig, lower_stmts, flat_args, flat_types = [], [], [], [], []
        for p in func["params"]:
            if p["name"] == "self" and isinstance(kind, dict) and "method" in kind:
                sig.append("&self")
                expr = "self"
            else:
                name = snake(p["name"])
                sig.append(f"{name}: {self.rust_type(p['type'], here, param=True)}")
                expr = name if self.rust_type(p["type"], here, param=True).startswith("&") else f"(&{name})"
                if not self.is_borrow(p["type"]) and isinstance(self.kind(p["type"]), dict) \
                        and "handle" in self.kind(p["type"]):
                    lower_stmts.append(f"let {name} = core::mem::ManuallyDrop::new({name});")
            params.append((expr, p["type"]))
        if sum(len(self.flat(t)) for _, t in params) > MAX_FLAT_PARAMS:
            offsets, size, align = self.record_layout([t for _, t in params])
            lower_stmts.append(f"let args = cleanup.alloc({size}, {align});")
            for (expr, t), off in zip(params, offsets):
                self.store(expr, t, "args", off, lower_stmts, here, owned=False)
            flat_args, flat_types = ["args as i32"], ["i32"]
        else:
            for expr, t in params:
                flat_types += self.flat(t)
                flat_args += self.lower_flat(expr, t, lower_stmts, here)
        result = func.get("result")
        ret_type = "" if result is None else f" -> {self.rust_type(result, here)}"
        import_ret, call_prefix, finish = "", "", ""
        if result is not None and len(self.flat(result)) <= MAX_FLAT_RESULTS:
            import_ret = f" -> {self.flat(result)[0]}"
            call_prefix = "let ret = "
            finish = self.lift_flat("ret", result, here)
        elif result is not None:
            size, _ = self.size_align(result)
            lower_stmts.insert(0, f"let mut ret_area = crate::abi::RetArea::<{size}>::new();")
            flat_args.append("ret_area.ptr() as i32")
            flat_types.append("i32")
            finish = self.load("ret_area.ptr()", 0, result, here)
        if self.uses_cleanup(lower_stmts):
            lower_stmts.insert(0, "let mut cleanup = crate::abi::Cleanup::new();")
        core_params = ", ".join(f"p{i}: {ty}" for i, ty in enumerate(flat_types))
        body = "".join(f"{indent}        {s}\n" for s in lower_stmts)
        call = f"{indent}        {call_prefix}import({', '.join(flat_args)});\n"
        tail = f"{indent}        {finish}\n" if finish else ""
        return (doc_comment(func.get("docs"), indent)
                + f"{indent}pub fn {rust_name}({', '.join(sig)}){ret_type} {{\n"
                + f"{indent}    #[link(wasm_import_module = \"{module}\")]\n"
                + f"{indent}    extern \"C\" {{\n{indent}        #[link_name = \"{wit_name}\"]\n"
                + f"{indent}        fn import({core_params}){import_ret};\n{indent}    }}\n"
                + f"{indent}    unsafe {{\n{body}{call}{tail}{indent}    }}\n{indent}}}\n")

    def uses_cleanup(self, stmts: list[str]) -> bool:
        return any("cleanup." in s for s in stmts)

    def emit_exports(self) -> str:
        """Glue for the world's exported functions and the `__export_world!` macro."""
        glue, macro_params, macro_items = [], [], []
        for name, item in self.world["exports"].items():
            func = item["function"]
            if func["params"]:
                raise NotImplementedError("world exports with parameters are not supported yet")
            ident, result = snake(name), func.get("result")
            rtype = "()" if result is None else self.rust_type(result, None)
            if result is None:
                core_ret, body = "", "    f();\n"
            elif len(self.flat(result)) <= MAX_FLAT_RESULTS:
                core_ret = f" -> {self.flat(result)[0]}"
                stmts: list[str] = []
                value = self.lower_flat("(&result)", result, stmts, None)[0]
                body = "    let result = f();\n" + "".join(f"    {s}\n" for s in stmts) + f"    {value}\n"
            else:
                size, align = self.size_align(result)
                stmts = []
                self.store("result", result, "ptr", 0, stmts, None, owned=True)
                glue.append(f"#[repr(C, align({align}))]\nstruct RetArea{camel(name)}([u8; {size}]);\n"
                            f"static mut RET_{ident.upper()}: RetArea{camel(name)} = RetArea{camel(name)}([0; {size}]);\n")
                core_ret = " -> i32"
                body = (f"    let result = f();\n    let ptr = core::ptr::addr_of_mut!(RET_{ident.upper()}) as *mut u8;\n"
                        + "".join(f"    {s}\n" for s in stmts) + "    ptr as i32\n")
            glue.append(doc_comment(func.get("docs"), "")
                        + f"#[doc(hidden)]\npub unsafe fn _export_{ident}(f: impl FnOnce() -> {rtype}){core_ret} {{\n{body}}}\n")
            macro_params.append(f"{ident}: $f_{ident}:expr")
            macro_items.append(
                f"        #[export_name = \"{name}\"]\n"
                f"        unsafe extern \"C\" fn __export_{ident}(){core_ret} {{ $crate::bindings::_export_{ident}($f_{ident}) }}\n")
            if result is not None and len(self.flat(result)) > MAX_FLAT_RESULTS and self.needs_free(result):
                glue.append(f"#[doc(hidden)]\npub unsafe fn _post_return_{ident}(ptr: i32) {{\n"
                            f"    let ptr = ptr as *const u8;\n    drop({self.load('ptr', 0, result, None)});\n}}\n")
                macro_items.append(
                    f"        #[export_name = \"cabi_post_{name}\"]\n"
                    f"        unsafe extern \"C\" fn __post_return_{ident}(ptr: i32) {{ $crate::bindings::_post_return_{ident}(ptr) }}\n")
        macro_items.append(
            "        #[export_name = \"cabi_realloc\"]\n"
            "        unsafe extern \"C\" fn __cabi_realloc(old: *mut u8, old_size: usize, align: usize, new_size: usize) -> *mut u8 {\n"
            "            $crate::abi::cabi_realloc(old, old_size, align, new_size)\n        }\n")
        macro = ("/// Defines the core exports of the world (each function, its post-return and\n"
                 "/// `cabi_realloc`) in the calling crate, so that the linker keeps them.\n"
                 "#[doc(hidden)]\n#[macro_export]\nmacro_rules! __export_world {\n"
                 f"    ({', '.join(macro_params)}) => {{\n" + "".join(macro_items) + "    };\n}\n")
        return "\n".join(glue) + "\n" + macro


def at(base: str, off: int) -> str:
    return f"{base}.add({off})" if off else base


def field_ref(expr: str, name: str) -> str:
    """A reference to field `name` of the value `expr` refers to: `(&x.f)` for `(&x)`."""
    inner = expr[2:-1] if expr.startswith("(&") and expr.endswith(")") else expr
    return f"(&{inner}.{name})"


def align_to(offset: int, align: int) -> int:
    return (offset + align - 1) // align * align


def join(a: str, b: str) -> str:
    """The Canonical ABI's join of two flat types in one variant slot."""
    if a == b:
        return a
    if {a, b} == {"i32", "f32"}:
        return "i32"
    return "i64"


def coerce(value: str, have: str, want: str) -> str:
    """Convert a flat value to its variant slot's joined type (bit patterns, zero-extended)."""
    if have == want:
        return value
    if have == "f32":
        return f"({value}).to_bits() as {want}"
    if have == "f64":
        return f"({value}).to_bits() as i64"
    return f"({value}) as u32 as i64"  # i32 -> i64


HEADER = """\
// @generated by sdk/rust/gen_bindings.py from sdk/wit ({package}, world `{world}`).
// Do not edit: change the WIT and run `python sdk/rust/gen_bindings.py`.
#![allow(clippy::all, unused_unsafe, unused_mut, unused_parens, dead_code)]
"""

RESOURCE = """\
{docs}    #[derive(Debug)]
    pub struct {name} {{
        handle: i32,
    }}
    impl {name} {{
        /// Takes ownership of a handle the host gave us.
        ///
        /// # Safety
        /// `handle` must be an owned `{wit_name}` handle not held by any other value.
        pub unsafe fn from_handle(handle: i32) -> Self {{
            Self {{ handle }}
        }}
        /// The handle, still owned by `self`.
        pub fn handle(&self) -> i32 {{
            self.handle
        }}
        /// The handle, now owned by the caller (no drop).
        pub fn into_handle(self) -> i32 {{
            let handle = self.handle;
            core::mem::forget(self);
            handle
        }}
    }}
    impl Drop for {name} {{
        fn drop(&mut self) {{
            #[link(wasm_import_module = "{module}")]
            extern "C" {{
                #[link_name = "[resource-drop]{wit_name}"]
                fn drop(handle: i32);
            }}
            unsafe {{ drop(self.handle) }}
        }}
    }}
"""


def resolved_wit(wit_dir: Path = WIT_DIR) -> dict:
    tool = subprocess.run(["wasm-tools", "component", "wit", "--json", str(wit_dir)],
                          capture_output=True, text=True)
    if tool.returncode != 0:
        sys.exit(f"wasm-tools component wit failed:\n{tool.stderr}")
    return json.loads(tool.stdout)


def generate(wit_dir: Path = WIT_DIR) -> str:
    return Generator(resolved_wit(wit_dir)).emit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if bindings.rs is out of date")
    args = parser.parse_args()
    source = generate()
    if args.check:
        if not OUT.exists() or OUT.read_text() != source:
            print(f"{OUT} is out of date with {WIT_DIR}: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(source)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
