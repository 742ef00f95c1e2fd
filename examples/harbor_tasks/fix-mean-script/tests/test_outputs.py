import subprocess


def run(path):
    return subprocess.run(["python3", "/app/stats.py", str(path)], capture_output=True, text=True, timeout=10)


def test_data_file():
    out = run("/app/data.txt")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5.00"


def test_other_file(tmp_path):
    p = tmp_path / "n.txt"
    p.write_text("1\n2\n\n")
    assert run(p).stdout.strip() == "1.50"
