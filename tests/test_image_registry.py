"""The image store against a real OCI registry (CNCF distribution, the registry Docker
Hub runs; scripts/setup builds it into .cache/bin): what `rollway images pull` does with
SWE-Gym-style references (``registry/name:tag``, ``name@sha256:...``), a registry served
over plain HTTP (containers-registries.conf ``insecure``), a missing tag, a blob the
registry serves corrupt, and a registry that is down."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from sandbox.config import ImageConfig
from sandbox.images import ImageError, ImageStore
from tests.image_helpers import example_images
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
REGISTRY_BIN = REPO / ".cache" / "bin" / "registry"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    def __init__(self, folder: Path) -> None:
        if not REGISTRY_BIN.exists():
            raise AssertionError(f"{REGISTRY_BIN} is missing: run scripts/setup (it builds the OCI registry)")
        self.folder, self.port = folder, _free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = folder / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {folder}/data\n"
                          f"http:\n  addr: {self.host}\n")
        self.conf = folder / "registries.conf"
        self.conf.write_text(f'[[registry]]\nlocation = "{self.host}"\ninsecure = true\n')
        self.log = open(folder / "registry.log", "wb")
        self.proc = subprocess.Popen([str(REGISTRY_BIN), "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._answers, 30, f"the registry at {self.host}", proc=self.proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{(folder / 'registry.log').read_text()[-2000:]}") from None

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).read()
            return True
        except OSError:
            return False

    def push(self, layout: str, tag: str, name: str) -> None:
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{tag}",
                        f"docker://{self.host}/{name}"], check=True, capture_output=True)

    def blob(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.folder / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def _manifest(layout: str, tag: str) -> dict:
    index = json.loads(Path(layout, "index.json").read_text())
    entry = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
    manifest = json.loads(Path(layout, "blobs/sha256", entry["digest"].split(":")[1]).read_text())
    return {"digest": entry["digest"], **manifest}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    images = example_images()
    reg = Registry(tmp_path_factory.mktemp("registry"))
    try:
        reg.push(images.layout, "namekit", "examples/namekit:1")
        reg.push(images.layout, "gridfmt", "examples/gridfmt:1")
        yield reg, images.layout
    finally:
        reg.stop()


def _store(tmp_path: Path, reg: Registry | None = None) -> ImageStore:
    return ImageStore(ImageConfig(cache_dir=str(tmp_path / "cache"), registries_conf=str(reg.conf) if reg else ""))


def test_a_registry_image_is_pulled_verified_unpacked_and_shared_by_tag_and_digest(registry, tmp_path):
    reg, layout = registry
    store = _store(tmp_path, reg)
    want = _manifest(layout, "namekit")["digest"]
    root = asyncio.run(store.ensure(f"{reg.host}/examples/namekit:1"))
    assert root.digest == want  # the manifest the layout holds, byte for byte through the registry
    assert Path(root.rootfs, "testbed/namekit/__init__.py").read_text().startswith('"""Names of database objects')
    # The same manifest by digest (how SWE-bench pins images): the same root, no second unpack.
    by_digest = asyncio.run(store.ensure(f"{reg.host}/examples/namekit@{want}"))
    assert (by_digest.rootfs, by_digest.digest, store.pulls) == (root.rootfs, want, 1)
    assert [sorted(i.refs) for i in store.list()] == [sorted([f"{reg.host}/examples/namekit:1",
                                                               f"{reg.host}/examples/namekit@{want}"])]


def test_a_plain_http_registry_needs_registries_conf_and_the_error_says_so(registry, tmp_path):
    reg, _ = registry
    store = _store(tmp_path)  # no registries.conf: skopeo insists on HTTPS
    ref = f"{reg.host}/examples/namekit:1"
    with pytest.raises(ImageError, match="HTTP response to HTTPS client") as info:
        asyncio.run(store.ensure(ref))
    assert info.value.ref == ref and store.list() == [] and store.pulls == 0


def test_a_missing_tag_is_named_as_missing(registry, tmp_path):
    reg, _ = registry
    with pytest.raises(ImageError, match="examples/namekit:no-such-tag") as info:
        asyncio.run(_store(tmp_path, reg).ensure(f"{reg.host}/examples/namekit:no-such-tag"))
    assert info.value.kind == "missing"


def test_a_blob_served_corrupt_is_refused_and_nothing_is_kept(registry, tmp_path):
    reg, layout = registry
    # gridfmt's own top layer (its base layers are shared with namekit).
    top = _manifest(layout, "gridfmt")["layers"][-1]["digest"]
    blob = reg.blob(top)
    original = blob.read_bytes()
    try:
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        store = _store(tmp_path, reg)
        with pytest.raises(ImageError, match="gridfmt") as info:
            asyncio.run(store.ensure(f"{reg.host}/examples/gridfmt:1"))
        assert info.value.kind == "digest", info.value
        assert store.list() == [] and not list((tmp_path / "cache" / "roots").iterdir())
    finally:
        blob.write_bytes(original)


def test_rollway_images_pull_from_the_registry_and_a_registry_that_is_down(registry, tmp_path):
    reg, _ = registry
    ref = f"{reg.host}/examples/namekit:1"
    env = {**os.environ, "ROLLWAY_SANDBOX__IMAGES__REGISTRIES_CONF": str(reg.conf)}
    cli = [str(REPO / ".venv/bin/rollway"), "images", "--cache-dir", str(tmp_path / "cli-cache"), "pull", ref]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok {ref} sha256:") and "1 of 1 image(s) ready" in done.stdout
    # Another port where nothing listens: a clear failure naming the image, exit 1.
    down = f"127.0.0.1:{_free_port()}/examples/namekit:1"
    cli[-1] = down
    failed = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1
    assert f"FAILED image '{down}'" in failed.stdout and "connection refused" in failed.stdout
