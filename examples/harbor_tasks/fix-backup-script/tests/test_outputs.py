import subprocess


def test_copies(tmp_path):
    src = tmp_path / "my src"
    src.mkdir()
    for name in ["a.txt", "two words.txt", "c d e.log"]:
        (src / name).write_text(name)
    (src / "sub").mkdir()
    dest = tmp_path / "out dir"
    out = subprocess.run(["bash", "/app/backup.sh", str(src), str(dest)], capture_output=True, text=True,
                         timeout=10)
    assert out.stdout.strip() == "copied 3 files", out.stdout + out.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["a.txt", "c d e.log", "two words.txt"]
