"""docs/ stays true to the code it describes."""

from pathlib import Path

from executor.core.config.reference import render_key_tables


def test_configuration_doc_lists_every_key_as_the_code_defines_it():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    tables = doc.split("<!-- keys:begin -->\n", 1)[1].split("<!-- keys:end -->", 1)[0]
    assert tables.strip() == render_key_tables().strip()
