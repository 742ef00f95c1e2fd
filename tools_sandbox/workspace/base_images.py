"""Local stand-ins for the public base images task folders name (`FROM python:3.11-slim`), built from the
distributions' package archives with mmdebstrap, for hosts that reach Debian's and Ubuntu's mirrors but no image
registry. `slime-env workspace build-base python:3.11-slim` makes one; `ensure_base_image(tag)` makes it on demand.

What "compatible" covers (and what it does not):
- the distribution and release the official image is built on (python:3.11-slim: Debian bookworm; python:3.13-slim:
  Debian trixie; python:3.12-slim: **Ubuntu noble** — no Debian release ships 3.12; debian:*, ubuntu:* as named);
- the Python minor version (`python3`, `python`, `pip`, `pip3` and `python3.X` on PATH; `pip install` works system-wide
  as in the official images: Debian's EXTERNALLY-MANAGED marker is removed), venv, and the image's `LANG`, `PATH`,
  `PYTHON_VERSION` variables and `CMD`;
- apt with the release's sources (`apt-get update && apt-get install ...` works in a Dockerfile), bash, coreutils,
  ca-certificates — plus this host's CA bundle, so HTTPS through the host's TLS-inspecting proxy works in builds.
Not covered: the patch version of Python and where it lives (Debian's /usr/bin/python3.11, not a source build in
/usr/local), the official images' exact package set and size, image digests, other architectures than the host's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slime_env.tools_sandbox.workspace.types import WorkspaceError

BASE_LABEL = "slime_env.base_image"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"
# Ubuntu's archive keyring, from Ubuntu's archive (Debian does not package it); pinned by hash.
UBUNTU_KEYRING = ("pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
                  "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8")


@dataclass(frozen=True)
class BaseRecipe:
    distro: str           # debian | ubuntu
    suite: str            # bookworm, trixie, noble, jammy
    python: str | None    # "3.11": Python with pip and venv, as in python:X images; None: the bare distribution
    components: str = "main"


_PY = {"3.11": ("debian", "bookworm"), "3.13": ("debian", "trixie"), "3.12": ("ubuntu", "noble"),
       "3.10": ("ubuntu", "jammy")}
_DEBIAN = {"bookworm": "bookworm", "12": "bookworm", "trixie": "trixie", "13": "trixie", "stable": "bookworm"}
_UBUNTU = {"24.04": "noble", "noble": "noble", "22.04": "jammy", "jammy": "jammy"}


def recipe_for(tag: str) -> BaseRecipe:
    """How to build a stand-in for the public image `tag`; WorkspaceError for a tag there is no recipe for."""
    name, _, version = tag.partition(":")
    name = name.removeprefix("docker.io/").removeprefix("library/")
    version = version or "latest"
    if name == "python":
        minor = ".".join(version.split("-")[0].split(".")[:2])
        if minor in ("3", "latest"):
            minor = "3.11"
        if minor in _PY:
            distro, suite = _PY[minor]
            if "bookworm" in version and minor != "3.11" or "trixie" in version and minor != "3.13":
                raise WorkspaceError(f"no local recipe for {tag!r}: Debian ships one Python per release")
            return BaseRecipe(distro, suite, minor, "main universe" if distro == "ubuntu" else "main")
    if name == "debian":
        suite = _DEBIAN.get(version.removesuffix("-slim"))
        if suite:
            return BaseRecipe("debian", suite, None)
    if name == "ubuntu":
        suite = _UBUNTU.get(version if version != "latest" else "24.04")
        if suite:
            return BaseRecipe("ubuntu", suite, None, "main universe")
    known = "python:3.10/3.11/3.12/3.13[-slim], debian:bookworm/trixie[-slim], ubuntu:22.04/24.04"
    raise WorkspaceError(f"no local recipe for base image {tag!r} (this host reaches no image registry); "
                         f"known: {known}")


def image_exists(client, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except Exception:  # noqa: BLE001 - ImageNotFound
        return False


def ensure_base_image(tag: str, *, client=None, log: Callable[[str], None] = print) -> bool:
    """Build `tag` from its recipe unless the host has it; True if it was built now."""
    from slime_env.tools_sandbox.workspace.docker import docker_client

    client = client or docker_client()
    if image_exists(client, tag):
        return False
    build_base_image(tag, client=client, log=log)
    return True


def build_base_image(tag: str, *, client=None, log: Callable[[str], None] = print) -> None:
    """Build the stand-in for `tag` (see the module docstring) and tag it so; WorkspaceError naming the step."""
    from slime_env.tools_sandbox.workspace.docker import docker_client

    recipe = recipe_for(tag)
    if shutil.which("mmdebstrap") is None:
        raise WorkspaceError("building base images needs mmdebstrap: apt-get install -y mmdebstrap")
    client = client or docker_client(timeout_s=1200)
    packages = ["ca-certificates", "bash", "coreutils", "procps", "less", "gzip", "tar"]
    if recipe.python:
        packages += ["python3", "python3-pip", "python3-venv", f"python{recipe.python}"]
    with tempfile.TemporaryDirectory(prefix="slime_env-base-") as tmp:
        tar = os.path.join(tmp, "rootfs.tar")
        argv = ["mmdebstrap", "--variant=apt", f"--components={recipe.components.replace(' ', ',')}",
                f"--include={','.join(packages)}", "--aptopt=Acquire::Retries \"3\"",
                f"--customize-hook={_customize_script(recipe, tmp)}"]
        if recipe.distro == "ubuntu":
            argv.append(f"--keyring={_ubuntu_keyring(tmp)}")
        argv += [recipe.suite, tar, DEBIAN_MIRROR if recipe.distro == "debian" else UBUNTU_MIRROR]
        log(f"mmdebstrap {recipe.distro} {recipe.suite} ({', '.join(packages)}) for {tag}")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise WorkspaceError(f"building {tag}: mmdebstrap failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        repository, _, version = tag.partition(":")
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   f"LABEL {BASE_LABEL}={tag}", f"LABEL {BASE_LABEL}.recipe={recipe.distro}-{recipe.suite}"]
        if recipe.python:
            changes += [f"ENV PYTHON_VERSION={_python_version(tar, recipe)}", 'CMD ["python3"]']
        else:
            changes.append('CMD ["bash"]')
        log(f"docker import {tag}")
        client.api.import_image_from_file(tar, repository=repository, tag=version or "latest", changes=changes)
    if not image_exists(client, tag):
        raise WorkspaceError(f"building {tag}: docker import produced no image")


def _customize_script(recipe: BaseRecipe, tmp: str) -> str:
    """A shell hook run on the finished root ($1): host CA certificates, python/pip names, system-wide pip."""
    host_ca = "/etc/ssl/certs/ca-certificates.crt"
    lines = ["set -e", 'root="$1"', 'mkdir -p "$root/usr/local/share/ca-certificates"']
    if os.path.isfile(host_ca):
        ca_copy = Path(tmp) / "host-ca.crt"
        shutil.copyfile(host_ca, ca_copy)
        lines += [f'cp {ca_copy} "$root/usr/local/share/ca-certificates/slime-env-host.crt"',
                  'chroot "$root" update-ca-certificates >/dev/null 2>&1 || true']
    lines += ['rm -rf "$root/var/lib/apt/lists/"* "$root/var/cache/apt/"*.bin',
              'mkdir -p "$root/tmp" && chmod 1777 "$root/tmp"']
    if recipe.python:
        lines += [f'rm -f "$root"/usr/lib/python{recipe.python}/EXTERNALLY-MANAGED',
                  'ln -sf /usr/bin/python3 "$root/usr/local/bin/python"',
                  'ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"',
                  'ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip3"']
    return "; ".join(lines)


def _python_version(tar: str, recipe: BaseRecipe) -> str:
    """The exact Python version inside the built root, from its python3.X package's Debian changelog."""
    import gzip
    import re
    import tarfile

    try:
        with tarfile.open(tar) as archive:
            member = archive.extractfile(f"./usr/share/doc/python{recipe.python}/changelog.Debian.gz")
            first = gzip.decompress(member.read()).decode("utf-8", "replace").splitlines()[0]
    except (OSError, KeyError, AttributeError, IndexError, EOFError):
        return recipe.python or ""
    found = re.search(r"\((\d+\.\d+\.\d+)", first)
    return found.group(1) if found else recipe.python or ""


def _ubuntu_keyring(tmp: str) -> str:
    """Ubuntu's archive keyring (the .deb from Ubuntu's archive, checked against its pinned hash)."""
    path, sha256 = UBUNTU_KEYRING
    try:
        with urllib.request.urlopen(f"{UBUNTU_MIRROR}/{path}", timeout=60) as r:
            data = r.read()
    except OSError as e:
        raise WorkspaceError(f"could not fetch Ubuntu's archive keyring from {UBUNTU_MIRROR}: {e}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise WorkspaceError(f"Ubuntu's archive keyring from {UBUNTU_MIRROR} does not match its pinned hash")
    deb = Path(tmp) / "ubuntu-keyring.deb"
    deb.write_bytes(data)
    out = Path(tmp) / "ubuntu-keyring"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True, capture_output=True)
    # apt checks signatures as its unprivileged `_apt` user: the keyring and the folders above it must be readable
    for folder in (Path(tmp), *[p for p in out.rglob("*") if p.is_dir()], out):
        folder.chmod(0o755)
    keyring = out / "usr/share/keyrings/ubuntu-archive-keyring.gpg"
    keyring.chmod(0o644)
    return str(keyring)
