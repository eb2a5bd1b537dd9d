"""SWE-style rows whose repository is only in their image (SWE-Gym/SWE-smith rows name an
image and carry no ``files``): the test patch and gold patch edit files the row does not
hold, so the task is made whole from the unpacked image (tasks/swe.py with_image_repo,
sandbox/image_repo.py) where it is graded."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from sandbox.config import ImageConfig
from sandbox.image_repo import ImageRepoCache, read_image_repo
from sandbox.images import ImageError, ImageStore
from tasks.images.examples import rows
from tasks.swe import parse_row, with_image_repo
from tests.image_helpers import example_images

ROWS = rows()


def _without_files(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "files"}


@pytest.mark.parametrize("row", ROWS, ids=[r["instance_id"] for r in ROWS])
def test_a_row_without_files_is_made_whole_exactly_as_the_row_with_them(row):
    deferred = parse_row(_without_files(row), task_set="examples")
    assert deferred.needs_image_repo and (deferred.files, deferred.hidden_tests, deferred.solution) == ({}, {}, {})
    full = parse_row(row, task_set="examples")
    whole = with_image_repo(deferred, row["files"])
    assert not whole.needs_image_repo
    assert msgspec.structs.asdict(whole) == msgspec.structs.asdict(full)
    # The test patch edits a test file that exists only in the repository.
    assert any(path in row["files"] for path in whole.hidden_tests)


def test_the_gold_patch_and_test_patch_never_reach_the_sampler():
    row = ROWS[0]
    event = parse_row(_without_files(row), task_set="examples").to_event("g", 4)
    wire = msgspec.json.encode(event).decode()
    assert event.files == {} and event.image == row["image"]
    for secret in (row["patch"], row["test_patch"]):
        for line in secret.splitlines():
            if line.startswith("+") and not line.startswith("+++") and len(line) > 12:
                assert line[1:].strip() not in wire


def test_a_row_without_files_still_fails_early_on_what_needs_no_repository():
    row = _without_files(ROWS[0])
    with pytest.raises(ValueError, match="give either patch or solution_files"):
        parse_row({**row, "solution_files": {"x.py": ""}})
    with pytest.raises(ValueError, match="not a pytest node id"):
        parse_row({**row, "FAIL_TO_PASS": ["nope"]})


def test_the_images_tree_is_read_exactly_and_a_row_that_does_not_fit_it_is_named():
    images = example_images()
    store = ImageStore(ImageConfig(cache_dir=images.cache_dir))
    row = ROWS[0]
    root = store.lookup(row["image"])
    assert root is not None
    # What the image holds at /testbed is the row's repository, byte for byte (no .git,
    # nothing else).
    assert read_image_repo(root, "/testbed") == row["files"]
    assert read_image_repo(root, "/no/such/dir") == {}

    cache = ImageRepoCache(size=1)
    deferred = parse_row(_without_files(row), task_set="examples")
    whole = cache.resolve(deferred, root)
    assert whole.hidden_tests == parse_row(row).hidden_tests
    assert cache.resolve(deferred, root) is whole  # kept per task and image digest

    # A test patch written against another version of the repository: its context does
    # not match the image's file -> the image's (infrastructure) error, naming the task.
    stale = row["test_patch"].replace("from namekit import column_name\n", "from namekit import nothing\n", 1)
    assert stale != row["test_patch"]
    wrong = parse_row({**_without_files(row), "instance_id": "stale-row", "test_patch": stale})
    with pytest.raises(ImageError, match="stale-row: .*test_patch.*does not apply") as info:
        cache.resolve(wrong, root)
    assert info.value.kind == "repo" and info.value.ref == row["image"]
    # An image with nothing at the workdir cannot make the row whole.
    elsewhere = msgspec.structs.replace(deferred, workdir="/nowhere")
    with pytest.raises(ImageError, match="no repository files at /nowhere"):
        asyncio.run(asyncio.to_thread(ImageRepoCache().resolve, elsewhere, root))
