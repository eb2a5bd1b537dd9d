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
import urllib.error
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
    def __init__(self, folder: Path, auth: str = "") -> None:
        """``auth``: an htpasswd file the registry checks every request against."""
        if not REGISTRY_BIN.exists():
            raise AssertionError(f"{REGISTRY_BIN} is missing: run scripts/setup (it builds the OCI registry)")
        self.folder, self.port = folder, _free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = folder / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {folder}/data\n"
                          f"http:\n  addr: {self.host}\n"
                          + (f"auth:\n  htpasswd:\n    realm: rollway-test\n    path: {auth}\n" if auth else ""))
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
        except urllib.error.HTTPError as exc:
            return exc.code == 401  # serving, and asking for credentials
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


def _htpasswd_line(user: str, password: str) -> str:
    """One bcrypt htpasswd line (the only hash distribution accepts), by libxcrypt's
    ``$2b$`` through the standard library (no apache2-utils or bcrypt wheel needed)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 4))
    assert hashed and hashed.startswith("$2b$"), f"this libc's crypt() has no bcrypt: {hashed!r}"
    return f"{user}:{hashed}\n"


def _auth_file(path: Path, host: str, user: str, password: str) -> str:
    """containers-auth.json(5), what `skopeo login --authfile` / `docker login` write."""
    import base64

    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    return str(path)


def test_a_registry_that_wants_credentials_pulls_with_the_auth_file_and_names_a_refusal(tmp_path):
    """SWE-Gym-style images often live in a private registry: ``sandbox.images.auth_file``
    is handed to skopeo; no credentials or wrong ones are an 'auth' failure naming the
    image (the operator's fix is the auth file), never 'missing', and nothing is kept."""
    images = example_images()
    folder = tmp_path / "registry"
    folder.mkdir()
    (folder / "htpasswd").write_text(_htpasswd_line("puller", "s3cret-pw"))
    reg = Registry(folder, auth=str(folder / "htpasswd"))
    try:
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", "puller:s3cret-pw",
                        f"oci:{images.layout}:namekit", f"docker://{reg.host}/private/namekit:1"],
                       check=True, capture_output=True)
        ref = f"{reg.host}/private/namekit:1"
        for label, auth in (("no credentials", ""),
                            ("a wrong password", _auth_file(tmp_path / "bad.json", reg.host, "puller", "nope"))):
            store = ImageStore(ImageConfig(cache_dir=str(tmp_path / f"cache-{len(auth)}"),
                                           registries_conf=str(reg.conf), auth_file=auth))
            with pytest.raises(ImageError) as info:
                asyncio.run(store.ensure(ref))
            assert (info.value.kind, info.value.ref) == ("auth", ref), (label, info.value)
            assert "auth_file" in str(info.value) and ref in str(info.value), (label, info.value)
            assert store.list() == [] and store.pulls == 0, label
        good = ImageStore(ImageConfig(cache_dir=str(tmp_path / "cache-ok"), registries_conf=str(reg.conf),
                                      auth_file=_auth_file(tmp_path / "ok.json", reg.host, "puller", "s3cret-pw")))
        root = asyncio.run(good.ensure(ref))
        assert root.digest == _manifest(images.layout, "namekit")["digest"]
        assert Path(root.rootfs, "testbed/namekit/__init__.py").is_file()
    finally:
        reg.stop()
