"""docs/inferlets.md stays true: the generated table matches the tree, and the tutorial's
steps (`pie new`, `pie build`, `pie run DIR`) and code work against a real server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from pie_server import ROOT, TOKEN, run_inferlet
from pie.control.chat_template import chat_prompt
from pie.toolchain import build_inferlet

sys.path.insert(0, str(ROOT / "inferlets"))
import gen_doc  # noqa: E402

TUTORIAL = (ROOT / "docs" / "inferlets.md").read_text()


def test_every_inferlet_has_a_header_and_a_current_table_row():
    assert gen_doc.check() == []
    names = {p.name for p in (ROOT / "inferlets").iterdir() if (p / "Cargo.toml").is_file()}
    tested = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name)
    untested = [n for n in names - gen_doc.NOT_TECHNIQUES if f'"{n}"' not in tested]
    assert not untested, f"inferlets without an end-to-end test: {untested}"


def pie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pie.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_tutorial_new_build_run(tmp_path, pie_server):
    crate = tmp_path / "my_inferlet"
    made = pie("new", str(crate))
    assert made.returncode == 0, made.stderr
    assert pie("new", str(crate)).returncode == 1  # never overwrites
    prompt = ["--prompt", "Name three rivers.", "--max-tokens", "12"]
    done = pie("run", str(crate), "--server", f"http://{pie_server.address}", "--token", TOKEN, "--", *prompt)
    assert done.returncode == 0, done.stderr
    expected = run_inferlet(pie_server, "text_completion", prompt).messages
    assert done.stdout.splitlines() == expected


def test_tutorial_best_of_n_shares_the_prefill(tmp_path, pie_server, tokenizer, model_dir):
    crate = tmp_path / "best_of_n"
    assert pie("new", str(crate)).returncode == 0
    code = re.findall(r"```rust\n(.*?)```", TUTORIAL, re.S)[1]
    (crate / "src" / "lib.rs").write_text(code.replace("async fn main", "inferlet::main!(main);\n\nasync fn main", 1))
    before = pie_server.get("/stats")[1]["scheduler"]
    run = run_inferlet(pie_server, build_inferlet(crate).read_bytes(), [])
    after = pie_server.get("/stats")[1]["scheduler"]
    forwards = after["calls"]["forward"] - before["calls"].get("forward", 0)
    batches = after["batches"]["forward"] - before["batches"].get("forward", 0)
    # The four branches' passes were batched (unbatched = 1; how well depends on timing under
    # load: 1.76 seen in CI, ~3 on a quiet machine).
    assert forwards / batches > 1.5
    assert run.reason == "finished" and len(run.messages) == 4
    assert len(set(run.messages)) > 1  # four seeds, not one answer four times
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    prompt_tokens = len(tokenizer.encode(chat_prompt(template, "Invent a name for a cat."),
                                         add_special_tokens=False).ids)
    # one prefill plus at most 16 decode steps per fork; four prefills alone would exceed it
    assert run.usage["forward_tokens"] <= prompt_tokens + 4 * 16 < 4 * prompt_tokens + 4
