"""SWE-style rows whose repository is only in their image (SWE-Gym/SWE-smith rows name an
image and carry no ``files``): the test patch and gold patch edit files the row does not
hold, so the task is made whole from the unpacked image (tasks/swe.py with_image_repo,
sandbox/image_repo.py) where it is graded."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path

import msgspec
import pytest

from sandbox.config import ImageConfig
from sandbox.image_repo import ImageRepoCache, read_image_repo
from sandbox.images import ImageError, ImageRoot, ImageStore
from sandbox.workspace import Snapshot, WorkspaceFile
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


# --- what an image holds that a task's text cannot (no image unpacked: a root folder) ---

LATIN_PLUGIN = b"# -*- coding: latin-1 -*-\n# Jos\xe9's plugin\ndef pytest_configure(config):\n    pass\n"
BIG_MODULE = b"def pytest_unconfigure(config):\n    pass\n" + b"#" * (1 << 20) + b"\n"
LATIN_CONFTEST = b"# -*- coding: latin-1 -*-\n# \xa9 the authors\nimport pytest\n"
SHARED_CFG = b"[tool:pytest]\naddopts = -p plug\n"
FAKE_FILES = {
    "a.py": b"A = 1\n", "README.md": b"# r\n", "latin.py": LATIN_PLUGIN, "big.py": BIG_MODULE, "run.sh": b"#!/bin/sh\n",
    "tests/conftest.py": LATIN_CONFTEST, "vendor/x/x.py": b"X = 1\n",
    ".git/HEAD": b"ref: main\n", "vendor/x/.git": b"gitdir: ../../.git/modules/x\n", "vendor/y/.hg/hgrc": b"[paths]\n",
}
# An absolute link and one leaving /testbed (both inside the image), the config an
# absolute link into the image's /etc, and a link that would be the host's /etc/hostname.
FAKE_LINKS = {"lib": "/usr/lib/python3", "docs.md": "../README.md", "setup.cfg": "/etc/shared/setup.cfg",
              "tox.ini": "../../../../../../etc/hostname"}


def _fake_root(tmp_path) -> ImageRoot:
    rootfs = tmp_path / "rootfs"
    for rel, data in FAKE_FILES.items():
        (rootfs / "testbed" / rel).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / "testbed" / rel).write_bytes(data)
    for rel, target in FAKE_LINKS.items():
        (rootfs / "testbed" / rel).symlink_to(target)
    # A setuid file, a device node and a FIFO in the repository (a copy keeps none).
    os.chmod(rootfs / "testbed/run.sh", 0o4755)
    os.mknod(rootfs / "testbed/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(rootfs / "testbed/pipe")
    (rootfs / "etc/shared").mkdir(parents=True)
    (rootfs / "etc/shared/setup.cfg").write_bytes(SHARED_CFG)
    return ImageRoot(ref="fake/image:1", digest=f"sha256:{os.urandom(8).hex()}", rootfs=str(rootfs))


def _session_snapshot(**changes) -> Snapshot:
    """What a session of the fake image snapshots (no VCS entries), with ``changes``
    (``a__b_dot_py`` stands for ``a/b.py``; bytes: a file, str: a link, None: deleted)."""
    files = {p: WorkspaceFile(p, d) for p, d in FAKE_FILES.items() if not {".git", ".hg"} & set(p.split("/"))}
    snap = Snapshot(files=files, symlinks=dict(FAKE_LINKS))
    for path, value in changes.items():
        path = path.replace("__", "/").replace("_dot_", ".")
        snap.files.pop(path, None)
        snap.symlinks.pop(path, None)
        if isinstance(value, bytes):
            snap.files[path] = WorkspaceFile(path, value)
        elif isinstance(value, str):
            snap.symlinks[path] = value
    return snap


def test_the_image_tree_is_the_base_links_binaries_and_nested_vcs_included(tmp_path):
    from sandbox.cheating import find_cheats
    from sandbox.image_changes import agent_view, tree_changes
    from sandbox.image_repo import read_image_tree

    root = _fake_root(tmp_path)
    # The task's text: UTF-8 files only, no version-control entry at any depth.
    text = read_image_repo(root, "/testbed")
    assert text == {"README.md": "# r\n", "a.py": "A = 1\n", "run.sh": "#!/bin/sh\n", "vendor/x/x.py": "X = 1\n"}
    tree = read_image_tree(root, "/testbed")
    assert tree.symlinks == FAKE_LINKS
    assert tree.vcs == (".git", "vendor/x/.git", "vendor/y/.hg")
    assert set(tree.files) == {"README.md", "a.py", "big.py", "latin.py", "run.sh", "tests/conftest.py",
                               "vendor/x/x.py"}
    # Configs as bytes, links followed inside the image (never to the host's /etc).
    assert tree.configs == {"setup.cfg": SHARED_CFG, "tests/conftest.py": LATIN_CONFTEST}

    untouched = _session_snapshot(added="/etc/passwd")
    # Before: the image's own links and hooks in files the text could not hold were the agent's.
    before = find_cheats(text, untouched, in_env=True)
    assert "symlink out of the workspace: lib -> /usr/lib/python3" in before
    assert "pytest hook pytest_configure defined in latin.py" in before
    assert "pytest hook pytest_unconfigure defined in big.py" in before
    # Against the image: only what the agent did (an escaping link it added stays refused).
    assert find_cheats(text, agent_view(untouched, tree), in_env=True) == [
        "symlink out of the workspace: added -> /etc/passwd"]
    changed = _session_snapshot(latin_dot_py=LATIN_PLUGIN + b"\n")
    assert find_cheats(text, agent_view(changed, tree), in_env=True) == [
        "pytest hook pytest_configure defined in latin.py"]

    # Deleted, a link made a file, a link re-pointed: removed from a fresh image tree.
    edited = _session_snapshot(a_dot_py=None, docs_dot_md=b"now a file\n", lib="/usr/lib", new="a.py")
    changes = tree_changes(edited, tree)
    assert changes.removed == ("a.py", "docs.md", "lib")
    assert changes.links == {"lib": "/usr/lib", "new": "a.py"}
    assert tree_changes(untouched, tree).removed == ()


def test_in_env_grading_keeps_an_images_linked_and_latin1_configs(tmp_path):
    from sandbox import grading_inenv
    from sandbox.grading_common import make_plan, solution_files
    from sandbox.image_changes import tree_changes
    from sandbox.image_repo import read_image_tree

    root = _fake_root(tmp_path)
    tree = read_image_tree(root, "/testbed")
    spec = msgspec.structs.replace(parse_row(_without_files(ROWS[0])), files=read_image_repo(root, "/testbed"),
                                   image_repo_row="")
    plan = make_plan(["tests/test_q.py::test_q"], {"tests/test_q.py": "def test_q():\n    pass\n"}, {})
    snap = _session_snapshot(pytest_dot_ini="mine.ini")
    files, notes, links = grading_inenv.tree(spec, solution_files(snap), plan, base_configs=tree.configs,
                                             changes=tree_changes(snap, tree))
    # The latin-1 conftest is the image's (kept, not "added"); the linked setup.cfg is
    # restored as a file from where its link leads in the image; no note for either.
    assert files["tests/conftest.py"] == LATIN_CONFTEST and files["setup.cfg"] == SHARED_CFG
    assert notes == ["pytest.ini (added as a link, removed)"] and links == {}
    assert grading_inenv.inifile_pin(spec, plan, "/testbed", tree.configs) == ["-c", "setup.cfg"]
    # Before: the text alone has no config, so an empty one was pinned.
    assert grading_inenv.inifile_pin(spec, plan, "/testbed")[1].endswith(".ini")


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_grading_tree_redoes_the_agents_removals_and_links_and_hides_nested_vcs(tmp_path, mode, monkeypatch):
    from sandbox import image_workspace

    if mode == "copy":
        monkeypatch.setattr(image_workspace, "_libc", type("Refuse", (), {"mount": lambda *a: -1})())
    root = _fake_root(tmp_path)
    ws, _ = image_workspace.create(tmp_path / "ws", 61999, {"setup.cfg": SHARED_CFG, "new.py": b"N = 1\n"}, None,
                                   root, "/testbed", removed=("a.py", "vendor/x/x.py", "docs.md"),
                                   links={"docs.md": "README.md"})
    try:
        assert ws.mode == mode
        tb = ws.root
        for gone in ("a.py", ".git", "vendor/x", "vendor/y/.hg"):
            assert not os.path.lexists(tb / gone), gone
        assert os.readlink(tb / "docs.md") == "README.md" and os.readlink(tb / "lib") == "/usr/lib/python3"
        # A file where the image has a link: the link is replaced, never followed.
        assert not (tb / "setup.cfg").is_symlink() and (tb / "setup.cfg").read_bytes() == SHARED_CFG
        assert (Path(root.rootfs) / "etc/shared/setup.cfg").read_bytes() == SHARED_CFG
        assert (tb / "vendor/y").is_dir() and (tb / "latin.py").read_bytes() == LATIN_PLUGIN
    finally:
        ws.remove()


def test_a_copied_tree_is_a_working_tree_only_and_not_charged_to_the_quota(tmp_path, monkeypatch):
    """The copy fallback (no overlay): before, ``cp -a`` brought the image's device nodes,
    FIFOs and setuid bits into the session, and the copy counted against the session's
    quota (a repository larger than the quota could not even be copied)."""
    from sandbox import image_workspace
    from sandbox.quota import Quota

    monkeypatch.setattr(image_workspace, "_libc", type("Refuse", (), {"mount": lambda *a: -1})())
    root = _fake_root(tmp_path)  # ~1.1 MB at /testbed, more than the quota below
    quota = Quota(size_bytes=256 * 1024, inodes=64)
    ws, _ = image_workspace.create(tmp_path / "ws", 61999, {}, quota, root, "/testbed")
    try:
        assert ws.mode == "copy" and (ws.root / "big.py").read_bytes() == BIG_MODULE
        assert not os.path.lexists(ws.root / "null") and not os.path.lexists(ws.root / "pipe")
        assert stat.S_IMODE((ws.root / "run.sh").stat().st_mode) == 0o755
        ws.write("mine.bin", b"x" * 200 * 1024)  # the session's quota is its own
        with pytest.raises(OSError) as full:
            ws.write("more.bin", b"x" * 200 * 1024)
        assert full.value.errno == errno.ENOSPC
    finally:
        ws.remove()
    with pytest.raises(ImageError, match="workdir / is the image's whole root"):
        image_workspace.create(tmp_path / "ws2", 61999, {}, quota, root, "/")


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_session_tree_shows_no_device_node_fifo_or_setuid_bit_in_either_mode(tmp_path, mode, monkeypatch):
    """Before: an overlay session (root) saw the image's device node, FIFO and setuid file
    as the image has them (inert under nodev/nosuid, but not what a copy shows)."""
    from sandbox import image_workspace

    if mode == "copy":
        monkeypatch.setattr(image_workspace, "_libc", type("Refuse", (), {"mount": lambda *a: -1})())
    root = _fake_root(tmp_path)
    os.makedirs(Path(root.rootfs) / "testbed/sub")
    os.mknod(Path(root.rootfs) / "testbed/sub/tty", stat.S_IFCHR | 0o666, os.makedev(5, 0))
    os.chmod(Path(root.rootfs) / "testbed/a.py", 0o2744)  # setgid without group-exec: chown keeps it
    ws, _ = image_workspace.create(tmp_path / "ws", 61999, {}, None, root, "/testbed")
    try:
        assert ws.mode == mode
        for gone in ("null", "pipe", "sub/tty"):
            assert not os.path.lexists(ws.root / gone), gone
        assert (ws.root / "sub").is_dir()
        assert stat.S_IMODE((ws.root / "run.sh").stat().st_mode) == 0o755
        assert stat.S_IMODE((ws.root / "a.py").stat().st_mode) == 0o744
        assert (ws.root / "run.sh").read_bytes() == b"#!/bin/sh\n"
    finally:
        ws.remove()
    # The image itself is unchanged.
    assert stat.S_IMODE(os.lstat(Path(root.rootfs) / "testbed/run.sh").st_mode) == 0o4755
    assert stat.S_ISCHR(os.lstat(Path(root.rootfs) / "testbed/null").st_mode)


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_snapshot_limits_count_the_sessions_changes_not_the_images_files(tmp_path, mode, monkeypatch):
    """Before: every file of the image's tree counted against max_snapshot_files /
    max_snapshot_bytes, so a session on a real repository (thousands of files) was
    refused at submit however little it changed."""
    from sandbox import image_workspace
    from sandbox.workspace import WorkspaceError

    if mode == "copy":
        monkeypatch.setattr(image_workspace, "_libc", type("Refuse", (), {"mount": lambda *a: -1})())
    root = _fake_root(tmp_path)
    for i in range(300):  # the image's repository: 300 files more than the limit below
        (Path(root.rootfs) / f"testbed/pkg/m{i:03d}.py").parent.mkdir(exist_ok=True)
        (Path(root.rootfs) / f"testbed/pkg/m{i:03d}.py").write_bytes(b"V = %d\n" % i)
    limits = {"max_files": 10, "max_bytes": 64 * 1024}  # big.py alone is 1 MiB
    ws, _ = image_workspace.create(tmp_path / "ws", 61999, {}, None, root, "/testbed")
    try:
        assert ws.mode == mode
        ws.write("pkg/m000.py", b"V = 9\n")  # same size, other bytes: the agent's
        ws.write("a.py", b"A = 2\nB = 3\n")
        for i in range(8):
            ws.write(f"new{i}.py", b"N = 1\n")
        snap = ws.snapshot(**limits)  # 10 files of the session's, exactly the limit
        assert len(snap.files) == 300 + 7 + 8 and snap.files["big.py"].data == BIG_MODULE
        assert snap.files["pkg/m000.py"].data == b"V = 9\n" and snap.files["pkg/m001.py"].data == b"V = 1\n"
        ws.write("new8.py", b"N = 1\n")
        with pytest.raises(WorkspaceError, match="more than 10 files"):
            ws.snapshot(**limits)
        ws.write("huge.bin", b"x" * 70 * 1024)
        with pytest.raises(WorkspaceError, match="more than 65536 bytes"):
            ws.snapshot(max_files=100, max_bytes=64 * 1024)
    finally:
        ws.remove()


def _image_only_file(tmp_path, name: str, data: bytes):
    """A fake image root whose /testbed holds ``name`` (non-UTF-8 ``data``: only in the
    image), and the SWE row's task made whole from that tree, which lacks the file."""
    root = _fake_root(tmp_path)
    (Path(root.rootfs) / "testbed" / name).write_bytes(data)
    spec = msgspec.structs.replace(parse_row(_without_files(ROWS[0])), files=read_image_repo(root, "/testbed"),
                                   image_repo_row="")
    assert name not in spec.files
    return root, spec


def test_in_env_grading_restores_an_images_non_utf8_plugin_module_byte_exact(tmp_path):
    """The image's setup.cfg loads ``-p plug``; plug.py is latin-1, so the task's text
    cannot hold it. Before: only plugins in the task's text were restored, so an agent's
    edit of plug.py (a fixture made to lie) stayed in the run."""
    from sandbox import grading_inenv
    from sandbox.grading_common import make_plan, solution_files
    from sandbox.image_changes import tree_changes

    plug = b"# -*- coding: latin-1 -*-\n# \xa9 Jos\xe9\nimport pytest\n\n\n@pytest.fixture\ndef factor():\n    return 2\n"
    root, spec = _image_only_file(tmp_path, "plug.py", plug)
    plan = make_plan(["tests/test_q.py::test_q"], {"tests/test_q.py": "def test_q():\n    pass\n"}, {})
    configs = grading_inenv.image_configs(root, spec, plan)
    assert configs["plug.py"] == plug and configs["setup.cfg"] == SHARED_CFG
    edited = _session_snapshot(plug_dot_py=b"import pytest\n\n\n@pytest.fixture\ndef factor():\n    return 3\n")
    from sandbox.image_repo import read_image_tree
    files, notes, _ = grading_inenv.tree(spec, solution_files(edited), plan, base_configs=configs,
                                         changes=tree_changes(edited, read_image_tree(root, "/testbed")))
    assert files["plug.py"] == plug
    assert notes == ["plug.py (changed, restored)"]
    deleted = _session_snapshot()
    files, notes, _ = grading_inenv.tree(spec, solution_files(deleted), plan, base_configs=configs,
                                         changes=tree_changes(deleted, read_image_tree(root, "/testbed")))
    assert files["plug.py"] == plug and notes == ["plug.py (deleted, restored)"]


def test_an_image_only_test_helper_runs_as_the_image_has_it_in_both_modes(tmp_path):
    """A helper module at the repository's root that the hidden tests assert through
    (testing_support.py), latin-1, so only in the image: the task's text lacks it. An
    agent's copy that asserts nothing must not run, in-env (restored byte-exact, the
    change named) or bridged (loaded in the tests' process from the image's bytes).
    Before: test support was looked for in the task's text only."""
    from sandbox import grading_bridged, grading_inenv
    from sandbox.grading_common import make_plan, solution_files
    from sandbox.image_changes import tree_changes
    from sandbox.image_repo import read_image_tree

    helper = b"# -*- coding: latin-1 -*-\n# \xa9 Jos\xe9\ndef check(got, want):\n    assert got == want\n"
    root, spec = _image_only_file(tmp_path, "testing_support.py", helper)
    plan = make_plan(["tests/test_q.py::test_q"], {"tests/test_q.py": (
        "from testing_support import check\n\n\ndef test_q():\n    check(1, 2)\n")}, {})
    configs = grading_inenv.image_configs(root, spec, plan)
    support = grading_inenv.image_support(root, spec, plan, configs)
    assert support == {"testing_support.py": helper}
    edited = _session_snapshot(testing_support_dot_py=b"def check(got, want):\n    pass\n")
    changes = tree_changes(edited, read_image_tree(root, "/testbed"))
    files, notes, _ = grading_inenv.tree(spec, solution_files(edited), plan, base_configs=configs, changes=changes,
                                         support=support)
    assert files["testing_support.py"] == helper and notes == ["testing_support.py (changed, restored)"]
    own, plugins = grading_bridged.tests_side(spec, plan, dict(configs), {}, support)
    assert plugins["testing_support.py"] == helper and "testing_support.py" not in own
    # From the task's text alone (what both modes looked at), the agent's copy stayed.
    files, notes, _ = grading_inenv.tree(spec, solution_files(edited), plan, base_configs=configs, changes=changes)
    assert files["testing_support.py"] == b"def check(got, want):\n    pass\n" and notes == []
    assert "testing_support.py" not in grading_bridged.tests_side(spec, plan, dict(configs), {})[1]
