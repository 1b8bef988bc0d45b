"""docs/ stays true to the code it describes."""

import re
from pathlib import Path

from executor.core.config.reference import render_flat_key_tables, render_key_tables


def test_configuration_doc_lists_every_key_as_the_code_defines_it():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    tables = doc.split("<!-- keys:begin -->\n", 1)[1].split("<!-- keys:end -->", 1)[0]
    assert tables.strip() == render_key_tables().strip()
    flat = doc.split("<!-- flat-keys:begin -->\n", 1)[1].split("<!-- flat-keys:end -->", 1)[0]
    assert flat.strip() == render_flat_key_tables().strip()


def test_adding_a_model_shows_qwen3_as_its_code_is():
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "adding_a_model.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert "class Qwen3ForCausalLM(Qwen2ForCausalLM)" in example
    assert example in (root / "models" / "qwen3" / "model.py").read_text()


def test_every_project_path_the_docs_name_exists():
    """A file or folder named in README.md or docs/ (other than benchmarks.md, a dated record of
    measurements) is there: a renamed module cannot leave a page pointing at nothing."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(page for page in (root / "docs").glob("*.md") if page.name != "benchmarks.md")]
    named = {
        path
        for page in pages
        for path in re.findall(
            r"`((?:executor|module|ops|models|tests|benchmarks|scripts)/[\w./]*?)`", page.read_text()
        )
    }
    missing = sorted(path for path in named if "<" not in path and not (root / path.rstrip("/")).exists())
    assert not missing, f"docs name paths that do not exist: {missing}"


def test_the_pages_state_the_num_blocks_check_as_one_rule():
    """docs/resuming.md and docs/kv_cache.md give the preflight's KV pool check (executor/offline/preflight.py's
    check_kv_pool, tests/bad_inputs/kv_pool_too_small) in the same words: a full max_model_len request."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    rule = (
        "an explicit `scheduler_config.num_blocks` must hold one request of `max_model_len` beside the null "
        "block (block 0)"
    )
    for name in ("resuming.md", "kv_cache.md"):
        assert rule in " ".join((docs / name).read_text().split()), name
    assert "1-token prompt" not in (docs / "resuming.md").read_text()
