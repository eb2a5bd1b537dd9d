"""The example image task set: three small repositories whose tests need a package that
is installed only in their image (inflection, tabulate, toolz: none is on the host).

Each instance is SWE-style: the repository at ``/testbed`` in its image, a problem
statement, a gold ``patch``, a ``test_patch`` adding the failing test, FAIL_TO_PASS and
PASS_TO_PASS ids. ``tasks/images/build.py`` builds the images and writes
``tasks/images/examples.jsonl`` from these definitions (``rows()``).
"""

from __future__ import annotations

import difflib

import msgspec

# One registry-style name per image; `rollway images pull NAME --from oci:...` (or the
# build script's --import) puts each into the sandbox host's store under it.
IMAGE_PREFIX = "rollway.local/examples"
IMAGE_TAG = "1"

# Pure-Python wheels from PyPI, pinned. pytest in the images is not the host's version.
BASE_PACKAGES = ("pytest==8.3.5", "pluggy==1.5.0", "iniconfig==2.0.0", "packaging==24.2")
DEBIAN_PACKAGES = ("python3.11", "python3-minimal", "python-is-python3", "bash", "coreutils")


class Example(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    packages: tuple[str, ...]
    problem_statement: str
    files: dict[str, str]  # the repository before the fix (what the image holds at /testbed)
    fixed: dict[str, str]  # files the gold patch changes, after it
    tests_after: dict[str, str]  # test files after the test patch
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def image(self) -> str:
        return f"{IMAGE_PREFIX}/{self.name}:{IMAGE_TAG}"


EXAMPLES = (
    Example(
        name="namekit",
        packages=("inflection==0.5.1",),
        problem_statement=(
            "namekit.table_name('BlogPost') returns 'blog_post', but a model's table name must be "
            "the plural snake-case form of its class name ('blog_posts'; 'Person' -> 'people')."
        ),
        files={
            "namekit/__init__.py": (
                '"""Names of database objects derived from model class names."""\n\n'
                "import inflection\n\n\n"
                "def column_name(attribute: str) -> str:\n"
                "    return inflection.underscore(attribute)\n\n\n"
                "def table_name(class_name: str) -> str:\n"
                '    """The table of a model class: plural snake case (\'BlogPost\' -> \'blog_posts\')."""\n'
                "    return inflection.underscore(class_name)\n"
            ),
            "tests/test_names.py": (
                "from namekit import column_name\n\n\n"
                "def test_column_name():\n"
                '    assert column_name("createdAt") == "created_at"\n'
            ),
            "README.md": "# namekit\n\nTable and column names from model names.\n",
            # The repository's own test configuration: a fixture the tests need, so a
            # grading that drops or loses the repository's conftest.py fails the gold patch.
            "tests/conftest.py": (
                "import pytest\n\n\n"
                "@pytest.fixture\n"
                "def model_tables():\n"
                '    return {"BlogPost": "blog_posts", "Person": "people"}\n'
            ),
        },
        fixed={
            "namekit/__init__.py": (
                '"""Names of database objects derived from model class names."""\n\n'
                "import inflection\n\n\n"
                "def column_name(attribute: str) -> str:\n"
                "    return inflection.underscore(attribute)\n\n\n"
                "def table_name(class_name: str) -> str:\n"
                '    """The table of a model class: plural snake case (\'BlogPost\' -> \'blog_posts\')."""\n'
                "    return inflection.pluralize(inflection.underscore(class_name))\n"
            ),
        },
        tests_after={
            "tests/test_names.py": (
                "from namekit import column_name, table_name\n\n\n"
                "def test_column_name():\n"
                '    assert column_name("createdAt") == "created_at"\n\n\n'
                "def test_table_name_is_plural(model_tables):\n"
                "    for model, table in model_tables.items():\n"
                "        assert table_name(model) == table\n"
            ),
        },
        fail_to_pass=("tests/test_names.py::test_table_name_is_plural",),
        pass_to_pass=("tests/test_names.py::test_column_name",),
    ),
    Example(
        name="gridfmt",
        packages=("tabulate==0.9.0",),
        problem_statement=(
            "gridfmt.markdown_table renders a plain text table, not Markdown: GitHub shows it as one "
            "paragraph. It must render a GitHub-flavoured Markdown table (a '| a | b |' header row "
            "followed by a '|---|---|' separator row)."
        ),
        files={
            "gridfmt.py": (
                '"""Tables for reports."""\n\n'
                "from tabulate import tabulate\n\n\n"
                "def text_table(rows, headers):\n"
                '    return tabulate(rows, headers=headers, tablefmt="plain")\n\n\n'
                "def markdown_table(rows, headers):\n"
                '    """A GitHub-flavoured Markdown table."""\n'
                '    return tabulate(rows, headers=headers, tablefmt="simple")\n'
            ),
            "tests/test_tables.py": (
                "from gridfmt import text_table\n\n\n"
                "def test_text_table():\n"
                '    assert text_table([["x", 1]], ["name", "n"]).splitlines()[1].split() == ["x", "1"]\n'
            ),
        },
        fixed={
            "gridfmt.py": (
                '"""Tables for reports."""\n\n'
                "from tabulate import tabulate\n\n\n"
                "def text_table(rows, headers):\n"
                '    return tabulate(rows, headers=headers, tablefmt="plain")\n\n\n'
                "def markdown_table(rows, headers):\n"
                '    """A GitHub-flavoured Markdown table."""\n'
                '    return tabulate(rows, headers=headers, tablefmt="github")\n'
            ),
        },
        tests_after={
            "tests/test_tables.py": (
                "from gridfmt import markdown_table, text_table\n\n\n"
                "def test_text_table():\n"
                '    assert text_table([["x", 1]], ["name", "n"]).splitlines()[1].split() == ["x", "1"]\n\n\n'
                "def test_markdown_table():\n"
                '    lines = markdown_table([["x", 1]], ["name", "n"]).splitlines()\n'
                '    assert lines[0].startswith("| name")\n'
                '    assert set(lines[1]) <= set("|-:")\n'
                '    assert lines[2].startswith("| x")\n'
            ),
        },
        fail_to_pass=("tests/test_tables.py::test_markdown_table",),
        pass_to_pass=("tests/test_tables.py::test_text_table",),
    ),
    Example(
        name="wordstats",
        packages=("toolz==1.0.0",),
        problem_statement=(
            "wordstats.top_words(text, n) should return the n most frequent words, most frequent first "
            "(ties in alphabetical order), but it returns the least frequent ones."
        ),
        files={
            "wordstats/__init__.py": (
                '"""Word statistics."""\n\n'
                "from toolz import count, frequencies, take\n\n\n"
                "def word_count(text: str) -> int:\n"
                "    return count(text.split())\n\n\n"
                "def top_words(text: str, n: int) -> list[str]:\n"
                "    counts = frequencies(text.lower().split())\n"
                "    return list(take(n, sorted(counts, key=lambda w: (counts[w], w))))\n"
            ),
            "tests/test_stats.py": (
                "from wordstats import word_count\n\n\n"
                "def test_word_count():\n"
                '    assert word_count("a b  c\\nd") == 4\n'
            ),
        },
        fixed={
            "wordstats/__init__.py": (
                '"""Word statistics."""\n\n'
                "from toolz import count, frequencies, take\n\n\n"
                "def word_count(text: str) -> int:\n"
                "    return count(text.split())\n\n\n"
                "def top_words(text: str, n: int) -> list[str]:\n"
                "    counts = frequencies(text.lower().split())\n"
                "    return list(take(n, sorted(counts, key=lambda w: (-counts[w], w))))\n"
            ),
        },
        tests_after={
            "tests/test_stats.py": (
                "from wordstats import top_words, word_count\n\n\n"
                "def test_word_count():\n"
                '    assert word_count("a b  c\\nd") == 4\n\n\n'
                "def test_top_words():\n"
                '    assert top_words("b a b c a b d", 2) == ["b", "a"]\n'
                '    assert top_words("y x", 2) == ["x", "y"]\n'
            ),
        },
        fail_to_pass=("tests/test_stats.py::test_top_words",),
        pass_to_pass=("tests/test_stats.py::test_word_count",),
    ),
)


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A ``git diff``-style patch from ``before`` to ``after`` (changed files only)."""
    out = []
    for path in sorted(after):
        old = before.get(path)
        if old == after[path]:
            continue
        out += difflib.unified_diff(
            (old or "").splitlines(keepends=True), after[path].splitlines(keepends=True),
            fromfile=f"a/{path}" if old is not None else "/dev/null", tofile=f"b/{path}",
        )
    return "".join(out)


def rows() -> list[dict]:
    """The JSONL rows (tasks/swe.py format) of the example set."""
    return [
        {
            "instance_id": f"rollway-examples__{ex.name}-1",
            "repo": f"rollway-examples/{ex.name}",
            "image": ex.image,
            "problem_statement": ex.problem_statement,
            "files": ex.files,
            "patch": unified_diff(ex.files, ex.fixed),
            "test_patch": unified_diff(ex.files, ex.tests_after),
            "FAIL_TO_PASS": list(ex.fail_to_pass),
            "PASS_TO_PASS": list(ex.pass_to_pass),
            "difficulty": "<15 min fix",
        }
        for ex in EXAMPLES
    ]
