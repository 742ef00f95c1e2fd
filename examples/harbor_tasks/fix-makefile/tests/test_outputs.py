import subprocess
from pathlib import Path


def make(*args):
    return subprocess.run(["make", "-C", "/app", *args], capture_output=True, text=True, timeout=20)


def test_report_built():
    assert Path("/app/build/report.txt").read_text() == "REPORT\nall good\n"


def test_clean_and_rebuild():
    assert make("clean").returncode == 0
    assert not Path("/app/build").exists()
    out = make()
    assert out.returncode == 0, out.stderr
    assert Path("/app/build/report.txt").read_text() == "REPORT\nall good\n"
