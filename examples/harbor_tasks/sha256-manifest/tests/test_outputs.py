import hashlib
import subprocess
from pathlib import Path


def test_manifest():
    lines = Path("/app/SHA256SUMS").read_text().splitlines()
    expected = []
    for rel in ["a.txt", "sub/b.bin", "sub/c.txt"]:
        digest = hashlib.sha256((Path("/app/files") / rel).read_bytes()).hexdigest()
        expected.append(f"{digest}  {rel}")
    assert lines == expected


def test_check_passes():
    out = subprocess.run(["sha256sum", "-c", "../SHA256SUMS"], cwd="/app/files", capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
