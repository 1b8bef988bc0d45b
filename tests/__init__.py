import pytest

# The harnesses' check_* helpers assert for the tests that call them: rewrite their asserts too, so
# that a failure shows the values compared.
pytest.register_assert_rewrite("tests.paged_harness", "tests.deepseek_v3_harness")
