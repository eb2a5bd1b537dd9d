"""Uid-range claims (sandbox/uid_claim.py) against a hostile local user and odd
configurations, and the start-up sweep (sandbox/stale_trees.py) that reads them. No
sandboxed process runs here: claims in the test's own folder, trees as plain folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from sandbox import uid_claim
from sandbox.uid_claim import UnsafeLockDir, claim_uid_range


def test_a_claims_folder_inside_a_folder_another_user_can_write_is_refused(tmp_path):
    """The folder's own checks do not protect it from whoever can write a folder above
    it: they can rename the claims' folder away (no race needed) or swap it between the
    check and the open, and the next service makes a fresh folder and claims a range a
    live service holds (each flocks its own file): they kill each other's commands. A
    folder above that others may write (without the sticky bit, or owned by another user)
    is refused; a sticky one of root's (/tmp) and links in safe folders (/var/run) are not."""
    # Before: the first claim was taken, and after `mv shared/locks shared/moved` (what any
    # user may do in `shared`) a second service claimed 60000 again.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {shared}, is writable by group or others "
                                            f"without the sticky bit \\(mode 777\\)"):
        claim_uid_range(60000, 8, shared / "deeper" / "locks", solution_uid_offset=20000)

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "locks").mkdir(mode=0o700)  # ours, in a folder another user owns (may rename in)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {theirs}, is owned by uid 65534"):
        claim_uid_range(60000, 8, theirs / "locks", solution_uid_offset=20000)

    sticky_theirs = tmp_path / "sticky-theirs"
    sticky_theirs.mkdir()
    sticky_theirs.chmod(0o1777)
    os.chown(sticky_theirs, 65534, 65534)  # a sticky folder's owner may still rename what is in it
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {sticky_theirs}, is owned by uid 65534"):
        claim_uid_range(60000, 8, sticky_theirs / "locks", solution_uid_offset=20000)

    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (shared / "link").symlink_to(safe)  # the link itself can be changed by anyone
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {shared}, is writable"):
        claim_uid_range(60000, 8, shared / "link" / "locks", solution_uid_offset=20000)

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot rename what is ours in it
    claim = claim_uid_range(60000, 8, sticky / "locks", solution_uid_offset=20000)
    assert claim.base == 60000
    claim.release()
    (tmp_path / "run-link").symlink_to(safe)  # as /var/run -> /run
    claim = claim_uid_range(60000, 8, tmp_path / "run-link" / "locks", solution_uid_offset=20000)
    assert claim.base == 60000 and (safe / "locks" / "uids-60000.lock").exists()
    claim.release()
